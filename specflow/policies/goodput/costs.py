"""What passes cost, timed once after the pipeline is built: the priors of the policy's cost fits.

The online fits alone cannot find how a cost grows when every round looks the same: steady
full-batch rounds at one k all score about the same number of positions, so the data only say
a + b x at that x, and a flat prior (b = 0) made extra positions look free, so k never fell
under load. Timed passes at two sizes give the slope before any round runs.

- the target: `Backend.time_pass` over one position in one row and over k_max + 1 positions in
  every slot (a simulated target is not timed: its clock is the truth);
- drafting: one draft step as the proposer times it (the `specflow_draft_step_seconds` hook) in
  one row and in every slot, one row over a tree's width (what one more frontier node adds), and
  one row over CATCH_UP_POSITIONS (what a draft model's catch-up costs per token fed). A proposer
  that answers None drafts without a model (n-gram lookup): its drafting is learned online only,
  from a prior relative to a target pass.

Given a key for the proposer (`measure(key=...)`), what was timed is kept for later runs on the
machine beside the target's own key (backends/choice_cache.py), like the choices made at start.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

REPS = 5                   # timed passes per measurement (their median)
CATCH_UP_POSITIONS = 64    # one long step, to find a draft's seconds per position fed

StepSeconds = Callable[[int, int], "float | None"]   # (rows, positions) -> seconds, or None


@dataclass
class MeasuredCosts:
    """Seconds timed at build; None (or 0) where nothing could be timed."""

    target: tuple[float, float] | None = None   # a target pass: (fixed, per position)
    draft: tuple[float, float] | None = None    # a draft step: (fixed, per drafting row)
    branch: float = 0.0          # one more frontier node in a tree's draft step
    catch_up: float = 0.0        # one token a draft model feeds to catch up


def target_cost(target, rows: int, positions: int) -> tuple[float, float] | None:
    """(fixed, per position) seconds of a target pass from two timed ones (one position in one
    row; `positions` in each of `rows` rows), or None for a simulated target (its clock is the
    truth) or when both would be the same pass."""
    if target is None or target.clock is not None or rows * positions <= 1:
        return None
    one = target.time_pass(rows=1, positions=1, reps=REPS)
    full = target.time_pass(rows=rows, positions=positions, reps=REPS)
    per_position = max(0.0, (full - one) / (rows * positions - 1))
    return max(one - per_position, 0.0), per_position


def draft_costs(step: StepSeconds, rows: int, width: int) -> MeasuredCosts:
    """A proposer's drafting costs from its timed steps (`step(rows, positions)`; None: it
    drafts without a model, nothing is timed). rows: the batch slots; width: most children per
    tree node (1 = chains: no branch cost)."""
    one = step(1, 1)
    if one is None:
        return MeasuredCosts()
    out = MeasuredCosts()
    if rows > 1:         # a step in every slot: (fixed, per row)
        per_row = max(0.0, (step(rows, 1) - one) / (rows - 1))
        out.draft = (max(one - per_row, 0.0), per_row)
    if width > 1:        # a tree's step feeds its frontier: topk positions against one
        out.branch = max(0.0, (step(1, width) - one) / (width - 1))
    out.catch_up = max(0.0, (step(1, CATCH_UP_POSITIONS) - one) / (CATCH_UP_POSITIONS - 1))
    return out


def measure(target, rows: int, positions: int, step: StepSeconds, width: int,
            key: dict | None = None) -> MeasuredCosts:
    """Everything the policy times at build. Drafting is timed only beside a timed target: its
    costs are priced against the target's, in the same seconds. With `key` (what the drafting
    depends on: the proposer's settings, the draft model's own key) and a target that has one
    (`choice_key()`), the seconds are kept for later runs (backends/choice_cache.py)."""
    own = None if target is None or target.clock is not None else target.choice_key()
    if key is None or own is None:
        return _measure(target, rows, positions, step, width)
    from specflow.backends import choice_cache

    def usable(kept) -> bool:
        return isinstance(kept, dict) and set(kept) == {"target", "draft", "branch", "catch_up"}

    kept = choice_cache.recall(
        "goodput.costs", {"target": own, "rows": rows, "positions": positions,
                          "width": width, "reps": REPS, **key},
        lambda: asdict(_measure(target, rows, positions, step, width)), usable)
    pair = lambda v: None if v is None else (float(v[0]), float(v[1]))   # noqa: E731
    return MeasuredCosts(pair(kept["target"]), pair(kept["draft"]), float(kept["branch"]),
                         float(kept["catch_up"]))


def _measure(target, rows: int, positions: int, step: StepSeconds, width: int) -> MeasuredCosts:
    timed = target_cost(target, rows, positions)
    if timed is None:
        return MeasuredCosts()
    out = draft_costs(step, rows, width)
    out.target = timed
    return out
