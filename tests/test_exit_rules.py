"""The arithmetic behind `benches/exit_rules.py`'s bound on exit rules: the priced assignment (each token exits at
the loop minimizing its expected extra loss plus a price per loop) spends its loops where they buy the most — no
assignment with as few loops in total has a smaller total loss — and the "loops at +1%" figure interpolates
between the settings around 1%."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

from exit_rules import apply, at_one_percent, cheapest


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_loops", [1, 2])
def test_priced_exits_beat_every_assignment_with_as_few_loops(seed: int, min_loops: int) -> None:
    rng = np.random.default_rng(seed)
    tokens, loops = 5, 4
    cost = rng.exponential(size=(tokens, loops))
    nll = rng.exponential(size=(tokens, loops))
    for price in (0.05, 0.3, 1.0):
        mean_loops, ppl = cheapest(cost, price, nll, min_loops)
        total = price * np.arange(min_loops, loops + 1) + cost[:, min_loops - 1 :]
        chosen = total.argmin(1) + min_loops - 1
        assert mean_loops == pytest.approx(chosen.mean() + 1)
        assert ppl == pytest.approx(math.exp(nll[np.arange(tokens), chosen].mean()))
        budget, spent = chosen.sum(), cost[np.arange(tokens), chosen].sum()
        for exits in itertools.product(range(min_loops - 1, loops), repeat=tokens):
            if sum(exits) <= budget:
                assert cost[np.arange(tokens), list(exits)].sum() >= spent - 1e-12


def test_threshold_rule_exits_at_the_first_loop_allowed_and_else_at_the_last() -> None:
    nll = np.array([[3.0, 2.0, 1.0], [6.0, 5.0, 4.0]])
    stop = np.array([[True, True, False], [False, False, False]])
    mean_loops, ppl = apply(stop, nll, min_loops=2)
    assert mean_loops == pytest.approx((2 + 3) / 2)
    assert ppl == pytest.approx(math.exp((2.0 + 4.0) / 2))


def test_loops_at_one_percent_interpolates_between_the_settings_around_it() -> None:
    rows = [
        {"rule": "r", "vs_last_pct": 2.0, "mean_loops": 4.0},
        {"rule": "r", "vs_last_pct": 0.5, "mean_loops": 5.5},
        {"rule": "r", "vs_last_pct": 4.0, "mean_loops": 3.0},
        {"rule": "other", "vs_last_pct": 1.0, "mean_loops": 2.0},
        {"rule": "other", "vs_last_pct": 3.0, "mean_loops": 1.0},
    ]
    assert at_one_percent(rows, "r") == pytest.approx(5.0)
    assert at_one_percent(rows, "other") == pytest.approx(2.0)
    assert at_one_percent([r for r in rows if r["vs_last_pct"] > 1], "r") is None
