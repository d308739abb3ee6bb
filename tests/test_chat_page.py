"""The chat page (`GET /`) in a real browser: Debian's chromium, headless, driven by selenium through Debian's
chromedriver (nothing downloaded). A message goes out, the streamed answer arrives with its stats, a server with an
API key makes the page ask for it, and the page's assets are served without one (they hold no data).

Without chromium and chromedriver on this machine the browser tests are skipped (`.ci/run` installs them);
`TINYLOOP_UPDATE_SCREENSHOT=1` also writes the screenshot the README shows to docs/chat.png."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from serverutil import running_server
from tinyloop.server.config import DEFAULT_MODEL

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
browser_only = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver")
DOCS = Path(__file__).resolve().parents[1] / "docs"
WAIT = 60  # seconds any one thing may take to show


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,760"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT).until(lambda d: condition(d), message=f"timed out waiting for {what}")
    except TimeoutException as e:  # say what the page showed
        raise AssertionError(
            f"timed out waiting for {what}; the page shows:\n{driver.find_element('tag name', 'body').text}"
        ) from e


def _say(driver, text: str):
    """Send `text` and wait for the answer's stats line; returns (answer text, stats text)."""
    from selenium.webdriver.common.by import By

    before = len(driver.find_elements(By.CSS_SELECTOR, ".turn.assistant .stats"))
    box = driver.find_element(By.ID, "message")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()
    stats = _wait(
        driver,
        lambda d: (s := d.find_elements(By.CSS_SELECTOR, ".turn.assistant .stats"))[before:] and s[-1].text and s[-1],
        "the answer's stats",
    )
    answer = driver.find_elements(By.CSS_SELECTOR, ".turn.assistant .content")[-1].text
    return answer, stats.text


def _set(driver, control: str, value) -> None:
    driver.execute_script(
        f"const c = document.getElementById('{control}'); c.value = {value!r}; c.dispatchEvent(new Event('input'))"
    )


@browser_only
def test_a_message_gets_a_streamed_answer_with_stats(browser, tiny, tmp_path):
    """Greedy, so the page's streamed answer can be checked against the API's own non-streamed one."""
    from selenium.webdriver.common.by import By

    with running_server(tiny.path) as base:
        browser.get(f"{base}/")
        _wait(browser, lambda d: d.find_element(By.ID, "model").text == tiny.path.stem, "the model's id")
        assert not browser.find_element(By.ID, "key-form").is_displayed()  # no key needed, none asked for
        _set(browser, "loops", 4)
        _set(browser, "temperature", 0)
        _set(browser, "max-tokens", 24)  # three turns fit the tiny model's 256 positions
        answer, stats = _say(browser, "Tell me about the sea.")
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}]}
        body |= {"temperature": 0, "max_tokens": 24, "loops": 4}
        direct = httpx.post(f"{base}/api/v0/chat/completions", json=body, timeout=60).json()
        assert answer == direct["choices"][0]["message"]["content"].strip() and answer
        n = direct["usage"]["completion_tokens"]
        assert f"{n} tokens" in stats and "tok/s" in stats and "loops 4" in stats, stats
        user = browser.find_elements(By.CSS_SELECTOR, ".turn.user .content")
        assert [u.text for u in user] == ["Tell me about the sea."]
        # A second turn sends the whole conversation: the server reuses the first turn's KV.
        answer2, stats2 = _say(browser, "And the ships?")
        assert answer2 and "prompt tokens reused" in stats2, stats2
        # Speculative mode shows the drafts' acceptance.
        browser.find_element(By.ID, "speculative").click()
        _, stats3 = _say(browser, "And the wind?")
        assert "drafts accepted" in stats3 and "loops 4" in stats3, stats3
        # Adaptive depth (which turns speculative off) shows the mean loops the answer's tokens ran.
        browser.find_element(By.ID, "auto").click()
        assert not browser.find_element(By.ID, "speculative").is_selected()
        _, stats4 = _say(browser, "And the rain?")
        assert "loops auto, mean" in stats4 and "of 4" in stats4 and "drafts" not in stats4, stats4
        shot = tmp_path / "chat.png"
        browser.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("TINYLOOP_UPDATE_SCREENSHOT"):  # the README's picture: the shipped model, sampled
        with running_server(DEFAULT_MODEL) as base:
            browser.get(f"{base}/")
            _wait(browser, lambda d: d.find_element(By.ID, "model").text == "default", "the model's id")
            browser.set_window_size(1000, 1100)
            _set(browser, "max-tokens", 40)
            _say(browser, "Tell me about the sea.")
            _say(browser, "And the ships?")
            browser.execute_script("window.scrollTo(0, 0)")
            browser.save_screenshot(str(DOCS / "chat.png"))


@browser_only
def test_the_page_asks_for_the_api_key(browser, tiny):
    from selenium.webdriver.common.by import By

    with running_server(tiny.path, "--api-key", "sesame") as base:
        browser.get(f"{base}/")
        form = _wait(browser, lambda d: (f := d.find_element(By.ID, "key-form")).is_displayed() and f, "the key form")
        key = browser.find_element(By.ID, "key")
        key.send_keys("wrong")
        form.find_element(By.TAG_NAME, "button").click()
        _wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-error").text, "the refusal")
        key.clear()
        key.send_keys("sesame")
        form.find_element(By.TAG_NAME, "button").click()
        _wait(browser, lambda d: not d.find_element(By.ID, "key-form").is_displayed(), "the form to close")
        _, stats = _say(browser, "Hello")
        assert "tok/s" in stats, stats


def test_the_page_is_served_without_a_key_and_nothing_else_is(tiny):
    with running_server(tiny.path, "--api-key", "sesame") as base:
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/page/chat.js">' in page.text
        js = httpx.get(f"{base}/page/chat.js")
        assert js.status_code == 200 and "text/javascript" in js.headers["content-type"] and "/api/v0/" in js.text
        assert httpx.get(f"{base}/page/chat.css").status_code == 200
        assert httpx.get(f"{base}/page/../config.py").status_code in (401, 404)
        assert httpx.get(f"{base}/page/index.html").status_code == 401  # not an asset name: the key is needed
        assert httpx.get(f"{base}/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sesame"}
        assert httpx.get(f"{base}/page/secrets.txt", headers=auth).json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("usage", [False, True])
def test_api_v0_streams_end_with_stats(server, usage):
    """The stats ride on the stream's last chunk: the usage chunk when asked for, else the finish_reason chunk."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 5, "loops": 2}
    if usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server}/api/v0/chat/completions", json=body, timeout=30) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    last = chunks[-1]
    assert [c for c in chunks if "stats" in c] == [last]
    if usage:
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == last["stats"]["completion_tokens"]
    else:
        assert last["choices"][0]["finish_reason"] == "length" and last["stats"]["completion_tokens"] == 5
    assert last["stats"]["loops_used"] == 2 and last["model_info"]["default_loops"] > 0
