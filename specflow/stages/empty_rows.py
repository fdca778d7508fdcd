"""Rows that no token survives: found in every shape() call, an error only where it matters.

A shaped row is *empty* when every logit is -inf (the grammar and the processors together forbid
every token) and *broken* when a logit is NaN or +inf (softmax turns either into NaN). Sampling
from such a row would pick an arbitrary token, usually id 0, silently. So:

- shape() marks such rows and hands on a harmless stand-in (all zeros: uniform), so the verifier
  and a draft's sampler never see NaN;
- after the stop trimmer, a marked target position p counts only if plain decoding would have
  sampled from it: p < consumed, the accepted drafts plus the recovered or bonus token, cut after
  the EOS or stop that ended the row. Positions past a rejection or past the end raise nothing:
  speculation changes no outcome, errors included;
- a counted position is an `EmptyDistributionError` whose one line names the request, the token,
  and the cause, found by replaying the shaping stages one by one on that row.

A draft's rows are marked and replaced too but never raise: the draft is sampled from the
stand-in q and the verifier gets that same q, so the round stays exact, and the target's row at
the same prefix (same masks, same processors) decides whether settings conflict. A draft model
whose own logits are NaN shows as low acceptance, not as an error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from specflow.backends.lean.native import row_max
from specflow.errors import InputError
from specflow.state import ShapingBatch

NEG_INF = float("-inf")


class EmptyDistributionError(InputError):
    """A request reached a position where no token can be chosen (or the logits were NaN)."""


def mark_empty(logits: torch.Tensor, inplace: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits with unusable rows set to 0, unusable [B, P] bool) for logits [B, P, V]; with
    inplace, `logits` itself is edited (when the caller owns it). On a CPU, where reading the
    flags costs nothing, unusable is None when every row is usable (the common case)."""
    # one reduction: the max of a row is -inf when all are, +inf or NaN when any is (max
    # propagates NaN)
    maxima = row_max(logits)                                                   # [B, P]
    # the few maxima read as floats: 2-3x quicker than isfinite().all()
    if logits.device.type == "cpu" and all(map(math.isfinite, maxima.view(-1).tolist())):  # cpu only
        return logits, None
    unusable = ~torch.isfinite(maxima)                                         # [B, P]
    fill = logits.masked_fill_ if inplace else logits.masked_fill
    return fill(unusable[..., None], 0.0), unusable


@dataclass
class ShapeCall:
    """One shape() call of this round, kept until the round's check."""

    source: str                      # "draft" or "target"
    request_ids: list[int]           # [B'] rows of this call (a draft call may have fewer)
    token_ids: list[list[int]]       # [B'][L] committed tokens (live lists, checked before trim)
    draft_token_ids: torch.Tensor    # [B', D]
    first_draft_index: int
    unusable: torch.Tensor | None    # [B', P] bool, after shaping (None: every row usable)
    raw_max: torch.Tensor | None = None   # [B', P] the model's own logits' maxima, taken before
                                     # shaping (a stage may edit them in place afterwards): not
                                     # finite where the model itself left no usable token
    paths: list[list[int]] | None = None   # [B'] a tree's rows: the node path each row shapes
    sampling: list[dict | None] | None = None   # [B'] requests' own sampling settings, or None
    greedy: bool = False             # a greedy round (sampling processors skipped)

    def one_row(self, logits: torch.Tensor, row: int) -> ShapingBatch:
        """The ShapingBatch of one row of this call, over `logits` [1, P, V] (for a replay)."""
        return ShapingBatch(logits, [self.token_ids[row]], self.draft_token_ids[row:row + 1],
                            self.first_draft_index, [self.request_ids[row]], self.source,
                            None if self.sampling is None else [self.sampling[row]], self.greedy)


class EmptyRowLog:
    """The shape() calls of one round, checked once after verification."""

    def __init__(self) -> None:
        self.calls: list[ShapeCall] = []

    def clear(self) -> None:
        self.calls.clear()

    def add(self, call: ShapeCall) -> None:
        self.calls.append(call)

    def first_counted(self, request_ids: list[int], consumed: list[int],
                      accepted: list[list[int]] | None = None
                      ) -> tuple[ShapeCall, int, int] | None:
        """The first (call, row, position) marked unusable that plain decoding would have
        sampled from, or None.

        consumed: [B] per row of the round batch (request_ids order), the positions sampled from
        this round. The calls' `unusable` flags are on the host by now (Pipeline._to_host read
        them with the verifier's output), so this reads nothing from the device.
        """
        calls = [c for c in self.calls if c.unusable is not None]
        if not any(bool(call.unusable.any()) for call in calls):            # the common case
            return None
        where = {rid: b for b, rid in enumerate(request_ids)}
        counted = []
        for call in calls:
            unusable = call.unusable.cpu()
            limits = [consumed[where[r]] for r in call.request_ids]
            if call.paths is not None and accepted is not None:
                # a tree path row: only its positions on the accepted path were sampled from
                limits = [min(n, 1 + _common(path, accepted[where[r]]))
                          for n, path, r in zip(limits, call.paths, call.request_ids)]
            limit = torch.tensor(limits)                                                  # [B']
            P = unusable.shape[1]
            depth = call.first_draft_index + torch.arange(P)                             # [P]
            reached = depth[None, :] < limit[:, None]                                   # [B', P]
            counted.append(unusable & reached)
        flags = torch.stack([c.any() for c in counted])                       # [calls]
        if not bool(flags.any()):
            return None
        for i in range(len(calls)):
            hits = counted[i].nonzero()
            if len(hits):
                b, p = hits[0].tolist()
                return calls[i], b, p
        return None


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two node paths."""
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


StageFn = tuple[str, Callable]       # (stage name, function(shaping=...)), in call order


def diagnose(call: ShapeCall, row: int, position: int, stages: list[StageFn],
             vocab_size: int) -> str:
    """Replay the shaping stages on one row and say which one left no token (or made NaN)."""
    P = call.unusable.shape[1]
    if call.raw_max is not None and not bool(torch.isfinite(call.raw_max[row, position])):
        return (f"the {call.source} model's logits are NaN, infinite or all -inf here (a "
                f"numerical fault in the model or its weights; dtype=float32 avoids "
                f"half-precision overflow)")
    # the masks and processors, replayed on uniform logits: they depend on the prefix, not on
    # the values (the model's own logits were fine, and are not kept)
    logits = torch.zeros(1, P, vocab_size)                                     # [1, P, V]
    before, narrowed = _allowed(logits[0, position]), None
    for name, fn in stages:
        shaping = call.one_row(logits, row)
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
    return ("a shaping stage that depends on the logits' values turned them into NaN or "
            "removed every token (a temperature so small it overflows, say); check the "
            "logits settings")


def _broken(row: torch.Tensor) -> bool:
    return bool((row.isnan() | (row == float("inf"))).any())


def _allowed(row: torch.Tensor) -> int:
    return int((row > NEG_INF).sum())


def describe(call: ShapeCall, row: int, position: int, stages: list[StageFn], vocab_size: int,
             output_index: int) -> str:
    """The error's one line: which request, which output token, what emptied it."""
    cause = diagnose(call, row, position, stages, vocab_size)
    return (f"request {call.request_ids[row]}, output token {output_index}: no token can be "
            f"chosen, because {cause}")

