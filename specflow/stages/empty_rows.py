"""Rows that no token survives: found in every shape() call, an error only where it matters.

A shaped row is *empty* when every logit is -inf (the grammar and the processors together forbid
every token) and *broken* when a logit is NaN or +inf (softmax turns either into NaN). Sampling
from such a row would pick an arbitrary token, usually id 0, silently. So:

- shape() marks such rows and hands on a harmless stand-in (all zeros: uniform), so the verifier
  and a draft's sampler never see NaN;
- after verification, a marked position counts only if the round reached it: position p of a
  call whose first draft index is f sits at depth d = f + p, and depth d is examined iff the row
  accepted at least d drafts. Positions past a rejection are never used (plain decoding need not
  pass there), so they raise nothing: speculation changes no outcome, errors included;
- a counted position is an `EmptyDistributionError` whose one line names the request, the token,
  and the cause, found by replaying the shaping stages one by one on that row.

The stand-in is exact: where a draft's row was replaced, q is uniform and the draft is sampled from
that same q, so the verifier still sees the distribution the draft came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specflow.errors import InputError

NEG_INF = float("-inf")


class EmptyDistributionError(InputError):
    """A request reached a position where no token can be chosen (or the logits were NaN)."""


def mark_empty(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with unusable rows set to 0, unusable [B, P] bool) for logits [B, P, V]."""
    # one reduction: the max of a row is -inf when all are, +inf or NaN when any is (max
    # propagates NaN)
    unusable = ~torch.isfinite(logits.amax(-1))                                # [B, P]
    return logits.masked_fill(unusable[..., None], 0.0), unusable


@dataclass
class ShapeCall:
    """One shape() call of this round, kept until the round's check."""

    source: str                      # "draft" or "target"
    request_ids: list[int]           # [B'] rows of this call (a draft call may have fewer)
    token_ids: list[list[int]]       # [B'][L] committed tokens (live lists, checked before trim)
    draft_token_ids: torch.Tensor    # [B', D]
    first_draft_index: int
    unusable: torch.Tensor           # [B', P] bool
    raw: torch.Tensor | None         # [B', P, V] the logits before shaping (target only)


class EmptyRowLog:
    """The shape() calls of one round, checked once after verification."""

    def __init__(self) -> None:
        self.calls: list[ShapeCall] = []

    def clear(self) -> None:
        self.calls.clear()

    def add(self, call: ShapeCall) -> None:
        self.calls.append(call)

    def first_counted(self, request_ids: list[int], num_accepted: torch.Tensor
                      ) -> tuple[ShapeCall, int, int] | None:
        """The first (call, row, position) marked unusable at a depth its row reached, or None.

        num_accepted: [B] accepted drafts per row of the round batch (request_ids order).
        One host read for the whole round, and none when nothing was marked.
        """
        if not self.calls:
            return None
        where = {rid: b for b, rid in enumerate(request_ids)}
        counted = []
        for call in self.calls:
            rows = torch.tensor([where[r] for r in call.request_ids], device=num_accepted.device)
            P = call.unusable.shape[1]
            depth = call.first_draft_index + torch.arange(P, device=num_accepted.device)   # [P]
            reached = depth[None, :] <= num_accepted[rows][:, None]                       # [B', P]
            counted.append(call.unusable.to(reached.device) & reached)
        flags = torch.stack([c.any() for c in counted])                       # [calls]
        if not bool(flags.any()):
            return None
        # the target's view first: a draft marked at a depth is usually the same cause
        order = sorted(range(len(self.calls)), key=lambda i: self.calls[i].source != "target")
        for i in order:
            hits = counted[i].nonzero()
            if len(hits):
                b, p = hits[0].tolist()
                return self.calls[i], b, p
        return None


StageFn = tuple[str, Callable]       # (stage name, function(shaping=...)), in call order
# (logits [1, P, V], call, row) -> the ShapingBatch of that one row
Shaper = Callable[[torch.Tensor, ShapeCall, int], object]


def diagnose(call: ShapeCall, row: int, position: int, stages: list[StageFn], make_shaping: Shaper,
             vocab_size: int) -> str:
    """Replay the shaping stages on one row and say which one left no token (or made NaN).

    The target's raw logits are kept for this; a draft's are gone, so its row is replayed from
    uniform logits, which finds every cause but the draft model's own numbers.
    """
    P = call.unusable.shape[1]
    if call.raw is not None:
        logits = call.raw[row:row + 1].float().clone()                         # [1, P, V]
        if _broken(logits[0, position]):
            return (f"the {call.source} model's logits are NaN or infinite here (a numerical "
                    f"fault in the model or its weights; dtype=float32 avoids half-precision "
                    f"overflow)")
    else:
        logits = torch.zeros(1, P, vocab_size)                                 # [1, P, V]
    before, narrowed = _allowed(logits[0, position]), None
    for name, fn in stages:
        shaping = make_shaping(logits, call, row)
        fn(shaping=shaping)
        logits = shaping.logits
        now = logits[0, position]
        if _broken(now):
            return f"{name} turned the logits into NaN or infinity; check its settings"
        allowed = _allowed(now)
        if allowed == 0:
            if narrowed is not None:
                return (f"{narrowed[0]} allows only {narrowed[1]} token(s) here and {name} "
                        f"forbids all of them; these settings conflict, change one of them")
            return f"{name} forbids every token here; check its settings"
        if allowed < before:
            narrowed = (name, allowed)
        before = allowed
    return (f"the {call.source} model's logits are NaN or -inf wherever the shaping stages "
            f"allow a token (a numerical fault in the model, or a draft vocabulary that lacks "
            f"the allowed tokens)")


def _broken(row: torch.Tensor) -> bool:
    return bool((row.isnan() | (row == float("inf"))).any())


def _allowed(row: torch.Tensor) -> int:
    return int((row > NEG_INF).sum())


def describe(call: ShapeCall, row: int, position: int, stages: list[StageFn], make_shaping: Shaper,
             vocab_size: int, output_index: int) -> str:
    """The error's one line: which request, which output token, what emptied it."""
    cause = diagnose(call, row, position, stages, make_shaping, vocab_size)
    return (f"request {call.request_ids[row]}, output token {output_index}: no token can be "
            f"chosen, because {cause}")

