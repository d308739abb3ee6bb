"""tinyloop's depth knob, on every request family: `loops` is a number of loops, or `"auto"` — adaptive depth
(`tinyloop.AutoDepth`: each generated token stops looping once its next-token distribution has settled) — whose rule
`min_loops`, `max_loops` and `exit_threshold` tune. Those three are refused by name without `"auto"`."""

from __future__ import annotations

from typing import Any, Literal

from .._core import MAX_LOOPS, AutoDepth, Speculative
from .errors import APIError
from .strict import Strict, ranged

AUTO = "auto"
RULE_FIELDS = ("min_loops", "max_loops", "exit_threshold")
MAX_EXIT_THRESHOLD = 10.0


class DepthFields(Strict):
    loops: int | Literal["auto"] | None = ranged(None, 1, MAX_LOOPS)
    min_loops: int | None = ranged(None, 1, MAX_LOOPS)
    max_loops: int | None = ranged(None, 1, MAX_LOOPS)
    exit_threshold: float | None = ranged(None, 0.0, MAX_EXIT_THRESHOLD)

    def check_ranges(self) -> None:
        super().check_ranges()
        if self.loops != AUTO:
            for name in RULE_FIELDS:
                if getattr(self, name) is not None:
                    raise APIError(400, f'{name} applies only with loops "auto"', param=name)
        elif self.min_loops is not None and self.max_loops is not None and self.min_loops > self.max_loops:
            raise APIError(
                400, f"min_loops ({self.min_loops}) must be at most max_loops ({self.max_loops})", param="min_loops"
            )

    def loop_arg(self, verify_loops: int | None = None) -> int | AutoDepth | None:
        """What `Generation(loops=...)` takes for this request (speculative: up to `verify_loops`)."""
        if self.loops is None or isinstance(self.loops, int):
            return self.loops
        return AutoDepth(
            min_loops=self.min_loops or AutoDepth().min_loops,
            max_loops=verify_loops or self.max_loops,
            threshold=self.exit_threshold,
        )

    def check_drafts(self, draft_loops: int, verify_loops: int | None, tree: bool) -> None:
        """Speculative decoding under `"auto"`: chain mode only, drafting fewer loops than any token may stop at, and
        up to the verify depth (`max_loops` may only repeat it)."""
        if self.loops != AUTO:
            return
        if tree:
            raise APIError(
                400, 'tree_speculative is not available with loops "auto": use mode "speculative"', param="loops"
            )
        if verify_loops is not None and self.max_loops not in (None, verify_loops):
            raise APIError(400, f"max_loops must be verify_loops ({verify_loops}) when speculative", param="max_loops")
        check_auto_drafts(self.min_loops or AutoDepth().min_loops, draft_loops)

    def loop_arg_for(self, spec: Speculative | None) -> int | AutoDepth | None:
        """`loop_arg` beside speculative settings: a fixed depth is theirs (`verify_loops`), `"auto"` runs up to it."""
        if spec is None:
            return self.loop_arg()
        return self.loop_arg(spec.verify_loops) if self.loops == AUTO else None

    def depth_fields(self) -> dict[str, Any]:
        """The depth fields this request sets, to hand to another schema."""
        return {name: getattr(self, name) for name in ("loops", *RULE_FIELDS) if getattr(self, name) is not None}


def check_auto_drafts(min_loops: int, draft_loops: int) -> None:
    """Drafts run loops that no token may stop before: `draft_loops` below the first loop the rule checks after."""
    first = max(min_loops, 2)
    if draft_loops >= first:
        raise APIError(
            400,
            f'with loops "auto", draft_loops ({draft_loops}) must be below max(min_loops, 2) ({first})',
            param="draft_loops",
        )


def stats(auto_loops: list[tuple[int, int]]) -> dict[str, Any]:
    """The `stats` fields of adaptive depth, over the choices' (tokens decided, loops they ran)."""
    tokens, loops = sum(t for t, _ in auto_loops), sum(n for _, n in auto_loops)
    return {"mean_loops": round(loops / tokens, 3) if tokens else None, "adaptive_tokens": tokens}
