"""Adaptive depth (`loops="auto"`): each generated token runs loops one at a time and stops after loop
d >= max(min_loops, 2) once KL(p_d || p_{d-1}) of its exit distributions is below the threshold; the loops it
skipped keep, at its position, the K/V of the last loop it ran. Checked against a float64 NumPy reference of that
rule written here from the description, and for the engine's own consistency: batching, scoring, the threshold-0
limit (every token runs every loop) and what is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest

import tinyloop
from reference import head_logits, layer_over_past
from shapes import TINY
from tinyloop import AutoDepth, SamplingParams
from tinyloop.modelfile.draft_vocab import write_vocabularies


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


class AutoReference:
    """The adaptive rule in float64. The exit distribution is the softmax over the head's `exit_ids` rows (None: all
    rows, as on a file without an exit or draft vocabulary). The prompt runs every loop; each later token runs loops
    until the rule stops it, and the loops it skipped get its last loop's K/V. `kls` records every divergence the
    rule compared, for the margin check."""

    def __init__(self, cfg, weights, loops: int, min_loops: int, threshold: float, kv=np.float32, exit_ids=None):
        self.cfg, self.loops, self.min_loops, self.threshold, self.kv = cfg, loops, min_loops, threshold, kv
        self.exit_ids = slice(None) if exit_ids is None else np.asarray(exit_ids)
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        self.kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.n = 0
        self.kls: list[float] = []

    def _run(self, name: str, x: np.ndarray, new: dict) -> np.ndarray:
        x, k, v = layer_over_past(self.cfg, self.w, name.rsplit("@", 1)[0], x, self.n, self.kept.get(name), self.kv)
        new[name] = (k, v)
        return x

    def _commit(self, new: dict, tokens: int) -> None:
        for name, (k, v) in new.items():
            pk, pv = self.kept.get(name, (np.zeros((0, *k.shape[1:])), np.zeros((0, *v.shape[1:]))))
            self.kept[name] = (np.concatenate([pk, k]), np.concatenate([pv, v]))
        self.n += tokens

    def prompt(self, tokens: list[int]) -> np.ndarray:
        cfg, new = self.cfg, {}
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        for i in range(cfg.prelude_count):
            x = self._run(f"pre.{i}", x, new)
        for lp in range(self.loops):
            for j in range(cfg.block_count):
                x = self._run(f"blk.{j}@{lp}", x, new)
        self._commit(new, len(tokens))
        return head_logits(cfg, self.w, x[-1:])[0]

    def token(self, t: int) -> tuple[np.ndarray, int]:
        """Logits after feeding `t` under the rule, and the loops it ran."""
        cfg, new = self.cfg, {}
        x = self.w["token_embd.weight"][np.asarray([t])]
        for i in range(cfg.prelude_count):
            x = self._run(f"pre.{i}", x, new)
        first, prev, exit_ = max(self.min_loops, 2), None, self.loops
        for lp in range(self.loops):
            for j in range(cfg.block_count):
                x = self._run(f"blk.{j}@{lp}", x, new)
            d = lp + 1
            if d == self.loops or d + 1 < first:
                continue
            logp = _log_softmax(head_logits(cfg, self.w, x)[0][self.exit_ids])
            if d >= first and prev is not None:
                kl = float(np.sum(np.exp(logp) * (logp - prev)))
                self.kls.append(kl)
                if kl < self.threshold:
                    exit_ = d
                    break
            prev = logp
        for lp in range(exit_, self.loops):
            for j in range(cfg.block_count):
                new[f"blk.{j}@{lp}"] = new[f"blk.{j}@{exit_ - 1}"]
        self._commit(new, 1)
        return head_logits(cfg, self.w, x)[0], exit_


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50257) for _ in range(n)]


def _greedy_reference(tiny, prompt, loops, min_loops, threshold, n, kv=np.float32, exit_ids=None):
    ref = AutoReference(tiny.cfg, tiny.weights, loops, min_loops, threshold, kv, exit_ids)
    logits, tokens, depths = ref.prompt(prompt), [], []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits, d = ref.token(tokens[-1])
        depths.append(d)
    return tokens, depths[:-1], ref.kls  # the last token is emitted, never fed


def _clear_threshold(run):
    """A threshold the rule's decisions do not sit near (every divergence compared at least 1% away from it, where
    float32 and float64 decide alike) under which tokens stop at different depths, some before the last loop.
    `run(threshold)` runs the reference: (its result, the depths, the divergences compared)."""
    kls = np.sort(run(0.0)[2])
    gaps = sorted(zip(kls[1:] / kls[:-1], np.sqrt(kls[1:] * kls[:-1]), strict=True), reverse=True)
    for _, th in gaps:
        result, depths, seen = run(float(th))
        if min(abs(k - th) for k in seen) > 0.01 * th and len(set(depths)) > 1 and min(depths) < max(depths):
            return float(th), result, depths
    raise AssertionError("no threshold away from every compared divergence")


@pytest.mark.parametrize("loops,min_loops,mode", [(5, 2, "fp16"), (6, 3, "fp16"), (5, 2, "int8")])
def test_generation_follows_the_reference_rule(tiny, loops, min_loops, mode):
    """int8: the skipped loops get the stored codes and scales, which the reference's rounded rows stand for."""
    engine = tinyloop.Engine(tiny.path, kv_cache_mode=mode)
    assert engine.info.draft_vocab_size == 0  # the reference reads the full head, as the engine does then
    prompt, n, kv = _prompt(9, seed=loops), 12, np.float32 if mode == "fp16" else mode
    threshold, want, depths = _clear_threshold(lambda th: _greedy_reference(tiny, prompt, loops, min_loops, th, n, kv))
    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    rule = AutoDepth(min_loops=min_loops, max_loops=loops, threshold=threshold)
    out = engine.generate(prompt, greedy, loops=rule)
    assert list(out.tokens) == want
    assert out.auto_loops == (len(depths), sum(depths))
    # The rule matters: every loop for every token chooses other tokens or runs more loops.
    fixed = engine.generate(prompt, greedy, loops=loops)
    assert list(fixed.tokens) != want or sum(depths) < loops * len(depths)


def _scored_reference(tiny, ids, loops, min_loops, threshold, exit_ids=None):
    ref = AutoReference(tiny.cfg, tiny.weights, loops, min_loops, threshold, exit_ids=exit_ids)
    logits, logps, depths = ref.prompt(ids[:1]), [], [loops]
    for i, t in enumerate(ids[1:]):
        logps.append(_log_softmax(logits)[t])
        if i + 2 < len(ids):
            logits, d = ref.token(t)
            depths.append(d)
    return logps, depths, ref.kls


def test_scoring_under_the_rule_matches_the_reference(tiny):
    engine = tinyloop.Engine(tiny.path)
    loops, min_loops, ids = 5, 2, _prompt(14, seed=7)
    threshold, want_lp, want_d = _clear_threshold(lambda th: _scored_reference(tiny, ids, loops, min_loops, th))
    logps, depths = engine.score_auto(ids, AutoDepth(min_loops=min_loops, max_loops=loops, threshold=threshold))
    assert depths == want_d and min(depths) < loops
    assert np.abs(np.asarray(logps) - np.asarray(want_lp)).max() < 1e-3


def test_the_rule_compares_over_the_exit_vocabulary(tiny, tmp_path):
    """A file listing an exit vocabulary: the rule compares loops over those rows, not over the draft vocabulary the
    file also lists (nor the full head); generation and scoring follow the reference restricted to them."""
    rng = np.random.default_rng(5)
    chosen = rng.choice(50257, 1040, replace=False)
    exit_ids, draft_ids = chosen[:16], chosen[16:]
    path = tmp_path / "exit.tinyloop"
    write_vocabularies(tiny.path, path, [int(t) for t in draft_ids], [int(t) for t in exit_ids])
    engine = tinyloop.Engine(path)
    assert (engine.info.exit_vocab_size, engine.info.draft_vocab_size) == (16, 1024)
    exit_ids = np.sort(exit_ids)
    loops, min_loops, ids = 5, 2, _prompt(14, seed=7)

    def scored(th, listed=exit_ids):
        return _scored_reference(tiny, ids, loops, min_loops, th, exit_ids=listed)

    threshold, want_lp, want_d = _clear_threshold(scored)
    logps, depths = engine.score_auto(ids, AutoDepth(min_loops=min_loops, max_loops=loops, threshold=threshold))
    assert depths == want_d and np.abs(np.asarray(logps) - np.asarray(want_lp)).max() < 1e-3
    assert scored(threshold, np.sort(draft_ids))[1] != want_d != scored(threshold, None)[1]

    prompt, n = _prompt(9, seed=3), 12
    threshold, want, depths = _clear_threshold(
        lambda th: _greedy_reference(tiny, prompt, loops, min_loops, th, n, exit_ids=exit_ids)
    )
    out = engine.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        loops=AutoDepth(min_loops=min_loops, max_loops=loops, threshold=threshold),
    )
    assert (list(out.tokens), out.auto_loops) == (want, (len(depths), sum(depths)))


def test_threshold_zero_runs_every_loop_and_matches_fixed_depth(tiny):
    engine = tinyloop.Engine(tiny.path)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = _prompt(11, seed=3)
    fixed = engine.generate(prompt, greedy, loops=4)
    auto = engine.generate(prompt, greedy, loops=AutoDepth(max_loops=4, threshold=0.0))
    assert list(auto.tokens) == list(fixed.tokens)
    assert auto.auto_loops == (9, 36)
    assert fixed.auto_loops == (0, 0)


def test_batched_streams_at_different_depths_match_solo(tiny_long):
    engine = tinyloop.Engine(tiny_long.path)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    loops_of = ["auto", 3, AutoDepth(min_loops=3, max_loops=6, threshold=1e-4), "auto"]
    prompts = [_prompt(n, seed=n) for n in (5, 9, 30, 300)]  # 300 > PREFILL_CHUNK: prefilled in chunks
    solo = [engine.generate(p, greedy, loops=lp) for p, lp in zip(prompts, loops_of, strict=True)]
    streams = [engine.stream(p, greedy, loops=lp) for p, lp in zip(prompts, loops_of, strict=True)]
    got: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(streams)))
    while live:
        events = engine.step_many([streams[i] for i in live])
        for i, ev in zip(list(live), events, strict=True):
            assert not isinstance(ev, BaseException), ev
            if ev.token_id >= 0:
                got[i].append(ev.token_id)
            if ev.finish_reason is not None:
                live.remove(i)
    assert got == [list(s.tokens) for s in solo]
    assert [s.auto_loops for s in streams] == [s.auto_loops for s in solo]


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_speculative_decoding_under_the_rule_is_plain_adaptive_decoding(tiny, mode):
    """Drafts run fewer loops than any token may stop at, so their K/V is what plain adaptive decoding computes;
    the verification rows stop one by one under the rule (a stopped row holds its exit loop's K/V for the rows after
    it). Greedy: the same tokens and the same loops as without drafts, at thresholds where rows stop at different
    loops within a round."""
    engine = tinyloop.Engine(tiny.path, kv_cache_mode=mode)
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    prompt = _prompt(9, seed=11)
    _, _, kls = _greedy_reference(tiny, prompt, 6, 3, 0.0, 14)
    for q in (0.2, 0.5, 0.8):
        rule = AutoDepth(min_loops=3, max_loops=6, threshold=float(np.quantile(kls, q)))
        plain = engine.generate(prompt, greedy, loops=rule)
        assert 0 < plain.auto_loops[1] < 6 * plain.auto_loops[0]  # some tokens stopped early
        for draft in ((1, 3), (2, 4), (2, 1)):
            spec = engine.generate(prompt, greedy, loops=rule, draft=draft)
            assert list(spec.tokens) == list(plain.tokens), (q, draft)
            assert spec.auto_loops == plain.auto_loops and spec.draft_proposed > 0
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True)
    out = engine.generate(prompt, sampled, loops=AutoDepth(min_loops=3, max_loops=6), draft=(2, 3))
    assert len(out.tokens) == 14 and out.auto_loops[0] == 13 and out.draft_proposed >= out.draft_accepted


def test_batched_speculative_and_plain_adaptive_streams_match_solo(tiny_long):
    engine = tinyloop.Engine(tiny_long.path)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    rule = AutoDepth(min_loops=3, max_loops=6, threshold=1e-4)
    settings = [dict(loops=rule, draft=(2, 3)), dict(loops=rule), dict(loops=6, draft=(2, 3)), dict(loops=4)]
    prompts = [_prompt(n, seed=n) for n in (7, 12, 5, 20)]
    solo = [engine.generate(p, greedy, **kw) for p, kw in zip(prompts, settings, strict=True)]
    streams = [engine.stream(p, greedy, **kw) for p, kw in zip(prompts, settings, strict=True)]
    got: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(streams)))
    while live:
        for i, ev in zip(list(live), engine.step_many([streams[i] for i in live]), strict=True):
            assert not isinstance(ev, BaseException), ev
            if ev.token_id >= 0:
                got[i].append(ev.token_id)
            if ev.finish_reason is not None:
                live.remove(i)
    assert got == [list(s.tokens) for s in solo]
    assert [s.auto_loops for s in streams] == [s.auto_loops for s in solo]


def test_what_is_refused_is_named(tiny):
    engine = tinyloop.Engine(tiny.path)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(tinyloop.InvalidRequestError, match=r"draft_loops \(2\) must be below max\(min_loops, 2\)"):
        engine.generate([1, 2, 3], greedy, loops="auto", draft=(2, 2))
    with pytest.raises(tinyloop.InvalidRequestError, match="K_branches"):
        engine.generate([1, 2, 3], greedy, loops=AutoDepth(min_loops=3), draft=(1, 2), k_branches=2)
    with pytest.raises(tinyloop.InvalidRequestError, match="min_loops"):
        engine.generate([1, 2, 3], greedy, loops=AutoDepth(min_loops=5, max_loops=4))
    with pytest.raises(tinyloop.InvalidRequestError, match="exit_threshold"):
        engine.generate([1, 2, 3], greedy, loops=AutoDepth(threshold=-1.0))
    with pytest.raises(ValueError, match="loops must be"):
        engine.generate([1, 2, 3], greedy, loops="deep")
    assert engine.generate([1, 2, 3], greedy, loops="auto").finish_reason in ("stop", "length")


def test_with_loops_sharing_kv_threshold_zero_is_the_shared_fixed_depth(tiny):
    """With one shared slot per layer there is no skipped loop's slot to fill: the rule only decides the depth."""
    engine = tinyloop.Engine(tiny.path, kv_share="last")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = _prompt(10, seed=4)
    fixed = engine.generate(prompt, greedy, loops=4)
    auto = engine.generate(prompt, greedy, loops=AutoDepth(max_loops=4, threshold=0.0))
    assert list(auto.tokens) == list(fixed.tokens) and auto.auto_loops == (7, 28)
    early = engine.generate(prompt, greedy, loops=AutoDepth(min_loops=2, max_loops=4, threshold=1e9))
    assert early.auto_loops == (7, 14)  # every token stops at its first check


def test_the_files_exit_threshold_is_the_default(tiny, model_factory):
    """`tinyloop.exit_threshold` is what `"auto"` uses when the request gives no threshold (and a request's wins)."""
    import dataclasses

    plain = tinyloop.Engine(tiny.path)
    assert plain.exit_rule == "settle" and plain.exit_threshold == pytest.approx(3e-3)
    eager = model_factory(dataclasses.replace(TINY, exit_threshold=1e9, name="tiny-eager"), seed=0)
    engine = tinyloop.Engine(eager.path)
    assert engine.exit_threshold == pytest.approx(1e9)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = _prompt(10, seed=4)
    assert engine.generate(prompt, greedy, loops=AutoDepth(max_loops=4)).auto_loops == (7, 14)  # the first check
    explicit = engine.generate(prompt, greedy, loops=AutoDepth(max_loops=4, threshold=0.0))
    assert explicit.auto_loops == (7, 28)
    assert list(explicit.tokens) == list(plain.generate(prompt, greedy, loops=4).tokens)


def test_the_command_line_takes_auto(tiny, capsys):
    from tinyloop.__main__ import main

    assert main(["generate", str(tiny.path), "Hello", "--loops", "auto", "--max-tokens", "6"]) == 0
    want = tinyloop.Engine(tiny.path).generate("Hello", SamplingParams(temperature=0.0, max_tokens=6), loops="auto")
    assert capsys.readouterr().out == "Hello" + want.text + "\n"
    with pytest.raises(SystemExit):
        main(["generate", str(tiny.path), "Hello", "--loops", "deep"])
    assert 'a number of loops or "auto"' in capsys.readouterr().err


def test_speculative_under_the_rule_on_the_default_model():
    """The real model's rounds stop their rows at different loops far more often than the tiny random one's: the
    rows after a stopped one must read its exit loop's K/V in the verification pass itself."""
    from tinyloop.server.config import DEFAULT_MODEL

    engine = tinyloop.Engine(DEFAULT_MODEL)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["The king said unto his servants", "In the beginning", "User: Hi\nAssistant:", "To be, or not"]
    for threshold in (0.003, 0.03):
        rule = AutoDepth(min_loops=3, max_loops=8, threshold=threshold)
        for prompt in prompts:
            plain = engine.generate(prompt, greedy, loops=rule)
            for draft in ((2, 4), (1, 3)):
                spec = engine.generate(prompt, greedy, loops=rule, draft=draft)
                assert (list(spec.tokens), spec.auto_loops) == (list(plain.tokens), plain.auto_loops), (prompt, draft)
