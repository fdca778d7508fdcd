"""Whether the target's (and a draft model's) lean forward packs its weights for oneDNN:
`pack: auto | true | false`.

Packing is a trade measured on whole passes: with the weights in oneDNN's packed layout passes
of several positions, or of several rows, cost much less than with MKL's dense products, while a
one-position pass may cost more (each oneDNN call has more fixed overhead: a model whose weights
fit the cache loses there) or less (a model far larger than the cache, whose one-row pass reads
its weights: packed streams them faster on some CPUs). A pipeline runs passes between two ends: one
row at one position (plain decoding of a lone request) and a full batch at k+1 positions
(max_batch_size rows; k = 0 without speculation). `auto` times a pass at each end both ways when
the pipeline is built, the layouts taking turns (the times kept for later runs:
backends/choice_cache.py), and packs when the two ends' packed/dense ratios
average below 1 (for plain decoding of one row both ends are that pass): each end counts for its
own relative cost, where a sum of times let the full batch's pass decide alone (SmolLM2 at 16 rows
x 5 positions: dense 19 + 215 ms, packed 43 + 193, a coin toss by the sum, while every pass between
the ends, one row's above all, runs faster dense). A draft model steps between one row (a chain at
batch 1) and its fullest step (a tree's frontier, proposer.topk positions, or one position, in
every slot), and a one-row step can be dearer packed while a wider one is cheaper: so
`plan_draft` times steps of 1, 2, 4, ... rows both ways and keeps both layouts where packed
wins only the wider ones (its weights once more; a draft is small by design), each pass taking the
faster. `true` packs whenever the CPU's torch build can, `false` never (for both models). For the
target a packed weight replaces the dense one, so neither choice costs memory, but for an LM head
tied to the embedding, packed as a copy (the lookup reads the dense table): it is the widest
product of a pass, and at many positions oneDNN reads it far faster than MKL. A change of thread
count afterwards keeps the choice. CUDA, forward=hf and non-lean models never pack.

Private to the transformers backend: `HFBackend.tune` runs `plan` (target) or `plan_draft`
(draft model) when the pipeline is built, passes are timed with
`Backend.time_pass`, and `HFBackend.describe` reports the choice (metrics.json `packed`,
`draft_packed`).

The figures behind this (per machine): docs/decisions.md, "Measured on this project's machines".
"""
from __future__ import annotations

from specflow.backends.choice import (Choice, Decided, first_of_lasting_wins, kept_for, mean_ratio,
                                     time_ends, time_pass)
from specflow.backends.lean.kernels import can_pack

REPS = 15          # passes timed per end and layout, in ROUNDS turns of each layout
ROUNDS = 3         # (timed all dense, then all packed, a SmolLM2 batch of 16 at k = 3, where the
                   # two layouts' fullest passes tie and the dense one-row pass is half the
                   # packed one, came out packed or dense by the minute)
DRAFT_REPS = 15    # passes timed per point and layout for a draft model (its passes are short)


def packable(backend) -> bool:
    lean = backend.lean            # an HFBackend's lean forward, or None
    return lean is not None and lean.quantized is None and backend.device.type == "cpu" \
        and can_pack(backend.model.dtype)           # (int8/int4 weights have their own layout)


def _untimed(setting, backend) -> Decided | None:
    """What `pack` decides without timing anything, applied: false and a backend that cannot
    pack stay dense, true packs; None: auto times (also a one-position, one-row pipeline: on a
    model larger than the cache a packed one-row pass can be the faster)."""
    if setting is False or not packable(backend):
        return Decided(False)
    if setting is True:
        backend.lean.pack()
        return Decided(True)
    return None


def _in_layout(lean, measure, **how):
    """A Choice's measure(packs, clock): measure(clock) with the dense weights (packs False) or
    packed (lean.pack(**how), undone after)."""
    def timed(packs: bool, clock) -> list[float]:
        if packs:
            lean.pack(**how)
        try:
            return list(measure(clock))
        finally:
            if packs:
                lean.unpack()
    return timed


def plan(backend, setting, positions: int, rows: int = 1) -> Choice | Decided:
    """`pack` for the target `backend`, whose fullest pass scores `positions` positions (k+1)
    in each of `rows` rows (the batch): dense (False) against packed (True) at both ends."""
    if (decided := _untimed(setting, backend)) is not None:
        return decided
    lean = backend.lean
    measure = _in_layout(lean, lambda clock: time_ends(backend, rows, positions, REPS // ROUNDS,
                                                       clock))

    def apply(packs: bool) -> None:
        if packs:
            lean.pack()

    return Choice("pack", (False, True), measure,
                  lambda best: mean_ratio(best[True], best[False]) < 1, apply,
                  key=kept_for(backend, "pack", rows=rows, positions=positions, reps=REPS,
                               rounds=ROUNDS), rounds=ROUNDS)


def plan_draft(backend, setting, positions: int, rows: int = 1) -> Choice | Decided:
    """`pack` for a draft model whose fullest step scores `positions` positions (a tree's
    frontier, or one) in each of `rows` rows; the decision: whether any of its passes run packed.

    `auto` times steps of 1, 2, 4, ... rows up to `rows` (and the fullest) dense and packed, the
    layouts in turns (backends/turns.py), and packs from the fewest product rows (B x T) at which
    packed wins there and at every wider point timed. From one row: every weight packed, as for
    the target. Wider: the draft keeps both layouts (LeanLlama.pack(keep_dense=True)), so its
    one-row chain steps stay on MKL's dense products (cheaper for one row) and its frontier
    steps take oneDNN, for its weights' memory once more (a draft is small by design). Never:
    dense."""
    if (decided := _untimed(setting, backend)) is not None:
        return decided
    lean = backend.lean
    points = sorted({(1, 1), *((1, 2 ** i) for i in range(1, rows.bit_length())), (1, rows),
                     (positions, rows)}, key=lambda p: (p[0] * p[1], p))
    measure = _in_layout(lean, lambda clock: [
        time_pass(backend, q, p, DRAFT_REPS // ROUNDS, clock)
        for p, q in points], keep_dense=True, from_rows=1)

    def rule(best: dict) -> int | None:        # the first point packed serves from, or None
        return first_of_lasting_wins([pk < dn for pk, dn in zip(best[True], best[False])])

    def apply(start: int | None) -> None:
        if start == 0:
            lean.pack()
        elif start is not None:
            lean.pack(keep_dense=True, from_rows=points[start][0] * points[start][1])

    return Choice("draft_pack", (False, True), measure, rule, apply,
                  lambda start: start is not None,
                  key=kept_for(backend, "draft_pack", points=points, reps=DRAFT_REPS,
                               rounds=ROUNDS), rounds=ROUNDS)

