"""Whether a lean forward runs its passes through the decoder layers as one native call
(backends/lean/native_pass.py) or as the eager layers: `native: auto | true | false`.

The native pass does in one call what the eager layers do in ~35 torch operations a layer. Left
to itself (`LeanLlama.native_layers = None`), a pass runs natively where the native *product* won
`kernels.pick()` for its row count. That ties a whole pass to one product's timing: where a
library product streams the weights about as fast as the native one (both at the memory's
bandwidth), a pick lost by a hair leaves every pass its ~35 ops a layer of Python and dispatch
(SmolLM2, one position at 256 keys, 2-core EPYC: 32.6 ms eager with MKL's one-row product against
21.8 ms native, in one hour's runs, the one-row products alone 18-19 ms either way).

So where the product pick went to a library form for one row or for a few, `auto` times whole
passes at the pipeline's two ends (one row at one position; every slot at k+1 positions), the
native pass and the eager layers in turns (backends/turns.py), and runs natively where the two
ends' native/eager ratios average at most 1 (as `pack` weighs its ends,
backends/lean/packing.py; a tie goes native; the times are kept for later runs,
backends/choice_cache.py). Where the native product won both, the native pass wins too (its
products are the faster ones), and nothing is timed; so for a model held in GGUF blocks (its
eager layers run the same block products). `true` runs every pass it can natively, `false` none.

Private to the transformers backend: `HFBackend.tune` runs `plan` before choosing
`pack` (a packed weight never takes the native pass, so packing is timed against the dense
layout's faster way); `HFBackend.describe` reports the pass sizes that run natively.
"""
from __future__ import annotations

from specflow.backends.choice import Choice, Decided, kept_for, mean_ratio, time_ends
from specflow.backends.lean.native_pass import NativePass

REPS = 3           # passes timed per end and way in each round (Backend.time_pass's median)
ROUNDS = 3


def can_choose(backend) -> bool:
    lean = backend.lean            # an HFBackend's lean forward, or None
    return lean is not None and backend.device.type == "cpu" and NativePass.supported(lean)


def plan(backend, setting, positions: int, rows: int = 1) -> Choice | Decided:
    """`native` for `backend`, whose fullest pass scores `positions` positions in each of
    `rows` rows: a Choice between the native pass (True) and the eager layers (False), or a
    Decided value: True/False as set, or None where the native pass cannot run at all (no lean
    forward, not a CPU, no compiler, a model it does not cover) or, under auto, follows the
    product pick, which chose the native product."""
    if not can_choose(backend):
        return Decided(None)
    lean = backend.lean
    if setting is True or setting is False:
        lean.native_layers = setting
        return Decided(setting)
    lean.native_layers = None
    if (lean.kernels.one_row == "native" and lean.kernels.few_rows == "native") \
            or NativePass.all_held(lean):
        return Decided(None)

    def measure(on: bool, clock) -> list[float]:
        lean.native_layers = on
        try:
            return time_ends(backend, rows, positions, REPS, clock)
        finally:
            lean.native_layers = None

    def rule(best: dict) -> bool:
        return mean_ratio(best[True], best[False]) <= 1                         # a tie: native

    def apply(on: bool) -> None:
        lean.native_layers = on

    return Choice("native", (True, False), measure, rule, apply,
                  key=kept_for(backend, "native", rows=rows, positions=positions, reps=REPS,
                               rounds=ROUNDS), rounds=ROUNDS)

