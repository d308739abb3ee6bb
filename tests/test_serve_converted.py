"""A converted Qwen2 checkpoint behind `tinyloop-serve`: chat goes through the checkpoint's own template (ChatML, its
control tokens parsed), the answer is `transformers`' greedy continuation of that prompt, and it ends at an end
token the checkpoint's generation_config lists (not the tokenizer's eos)."""

from __future__ import annotations

import json

import httpx
import jinja2
from openai import OpenAI
from tokenizers import Tokenizer

import tinyloop
from hf_checkpoints import CHATML, Flavour, build_checkpoint, end_within
from serverutil import running_server
from tinyloop.modelfile.convert import convert

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def test_a_converted_qwen2_answers_chat_through_its_template_and_stops_at_its_end_token(tmp_path):
    directory = build_checkpoint(tmp_path / "hf", Flavour("qwen2"), seed=4)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = jinja2.Environment().from_string(CHATML).render(messages=MESSAGES, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<|im_start|>") in prompt
    end = tok.token_to_id("<|endoftext|>")  # generation_config's second end token; tokenizer_config's is <|im_end|>
    want = end_within(directory, prompt, end, lo=4, hi=40)
    out = tmp_path / "qwen2.tinyloop"
    convert(directory, out, outtype="f32", progress=False)
    with running_server(out) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        r = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert r.usage.prompt_tokens == len(prompt)
    assert choice.finish_reason == "stop" and r.usage.completion_tokens == len(want) - 1  # the end token is not output
    assert choice.message.content == tok.decode(want[:-1], skip_special_tokens=False).lstrip()


def test_a_converted_llama_starts_plain_prompts_with_its_bos_token(tmp_path):
    """Llama's tokenizer puts `<|begin_of_text|>` before a text (its post-processor); the server does the same for
    completions and for `/tokenize` with `add_special`, as `tokenizers` does with `add_special_tokens`."""
    directory = build_checkpoint(tmp_path / "hf", Flavour("llama"), seed=5)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    out = tmp_path / "llama.tinyloop"
    convert(directory, out, outtype="f32", progress=False)
    text = "Once upon a time, in 1999, there were 3 bears."
    want = tok.encode(text).ids
    assert want[0] == tok.token_to_id("<|begin_of_text|>")
    with running_server(out) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        r = client.completions.create(model="m", prompt=text, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens == len(want)
        with_bos = httpx.post(f"{base}/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
        without = httpx.post(f"{base}/tokenize", json={"content": text}).json()["tokens"]
    assert with_bos == want and without == want[1:]


def test_the_checkpoints_sampling_settings_are_the_servers_defaults(tmp_path):
    """generation_config.json's sampling fields travel in the file (`tinyloop.generation.*`); a request that leaves
    a field out gets the file's value, one that sends it keeps its own, and `--generate-config` wins over the file.
    (`repetition_penalty` is a field of the `/api/v0` family, which is where it applies.)"""
    directory = build_checkpoint(tmp_path / "hf", Flavour("qwen2"), seed=6)
    generation = json.loads((directory / "generation_config.json").read_text())
    generation |= {"do_sample": True, "temperature": 0.0, "repetition_penalty": 2.0}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    out = tmp_path / "qwen2.tinyloop"
    convert(directory, out, outtype="f32", progress=False)
    assert tinyloop.Engine(out).generation_defaults == {"temperature": 0.0, "repetition_penalty": 2.0}
    body = {"model": "m", "prompt": "one two one two one two", "max_tokens": 16}

    def text(base: str, **fields) -> str:
        r = httpx.post(f"{base}/api/v0/completions", json=body | fields, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with running_server(out) as base:
        by_file = text(base)
        assert by_file == text(base, temperature=0.0, repetition_penalty=2.0)
        plain = text(base, temperature=0.0, repetition_penalty=1.0)
        assert plain != by_file
    config = tmp_path / "defaults.json"
    config.write_text(json.dumps({"repetition_penalty": 1.0}))
    with running_server(out, "--generate-config", str(config)) as base:
        assert text(base) == plain
