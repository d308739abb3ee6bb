"""What every family's request becomes before it reaches the engine, built once: its sampling settings (`Sampling`:
the request's own values, then the server's and the model file's defaults for those its family has no field for)
and, on the families whose speculative knob is `draft_loops` (Responses, Messages), its drafts."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._core import MAX_TREE_ROWS, SamplingParams, Speculative
from .depth import DepthFields
from .errors import APIError


@dataclass(frozen=True)
class Sampling:
    """A request's sampling, as `SamplingParams` takes it; the defaults are the neutral ones (OpenAI's)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 128
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None

    @classmethod
    def of(cls, own: Mapping[str, Any], defaults: Mapping[str, Any]) -> Sampling:
        """`own` (the fields the request's family has, already holding its values or its defaults), then `defaults`
        for the fields it does not have."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in defaults.items() if k in names} | dict(own))

    def params(self, sample: int = 0) -> SamplingParams:
        """Sample `sample` of the request: with a seed, sample i uses seed + i so that the n samples differ."""
        fields = dataclasses.asdict(self)
        fields["seed"] = None if self.seed is None else (self.seed + sample) % 2**64
        return SamplingParams(**fields)


def drafts(
    depth: DepthFields, draft_loops: int | None, draft_ahead: int, default_loops: int, temperature: float
) -> Speculative | None:
    """tinyloop's speculative knob on the Responses and Messages families: `draft_ahead` tokens drafted at
    `draft_loops` and verified at the request's depth (None: no drafts)."""
    if draft_loops is None:
        return None
    verify = depth.loops if isinstance(depth.loops, int) else default_loops
    depth.check_drafts(draft_loops, None, tree=False)
    check_speculative("speculative", draft_ahead, 1, draft_loops, verify, temperature)
    return Speculative(draft_loops, verify, draft_ahead)


def check_speculative(
    mode: str, draft_ahead: int, k_branches: int, draft_loops: int, verify_loops: int, temperature: float
) -> None:
    if draft_loops >= verify_loops:
        raise APIError(
            400, f"draft_loops ({draft_loops}) must be below verify_loops ({verify_loops})", param="draft_loops"
        )
    if mode == "tree_speculative":
        if temperature != 0.0:
            raise APIError(400, "tree_speculative is greedy-only: temperature must be 0.0", param="temperature")
        if k_branches * draft_ahead > MAX_TREE_ROWS:
            raise APIError(
                400,
                f"K_branches * draft_ahead must be at most {MAX_TREE_ROWS}, got {k_branches} * {draft_ahead}",
                param="K_branches",
            )
