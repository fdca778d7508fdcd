"""Whether the target's lean forward packs its weights for oneDNN: `pack: auto | true | false`.

Packing is a trade measured on whole passes. On a 2-core AMD EPYC (fp32, demo target) a pass over
5 positions costs 4.3 ms packed against 5.9 ms dense, and 9 positions 5.7 against 8.9, but one
position costs 3.9 ms packed against 3.2 dense (each oneDNN call has ~14 us more overhead than
MKL's, and it streams a single row more slowly). Plain decoding scores one position a pass, and a
speculating pipeline mostly k+1. So `auto` packs only when the pipeline speculates, and only
when one pass of each kind, timed both ways on this machine when the pipeline is built, costs
less packed: pass(1) + pass(k+1). `true` packs whenever the CPU's torch build can, `false` never.
A packed weight replaces the dense one, so neither choice costs memory; a change of thread count
afterwards keeps the choice. CUDA, forward=hf and non-lean models never pack.
"""
from __future__ import annotations

from specflow.models.kernels import can_pack
from specflow.models.threads import pass_seconds

REPS = 15          # passes timed per kind and layout (~0.3 s on the demo target)


def packable(backend) -> bool:
    lean = getattr(backend, "lean", None)
    return lean is not None and backend.device.type == "cpu" and can_pack(backend.model.dtype)


def choose_pack(setting, backend, positions: int) -> bool:
    """Apply `pack` for the target `backend` whose verification passes score `positions`
    positions (1: it does not speculate); return whether its weights are packed."""
    if setting is False or not packable(backend):
        return False
    lean = backend.lean
    if setting is True:
        lean.pack()
        return True
    if positions <= 1:
        return False
    dense = pass_seconds(backend, REPS) + pass_seconds(backend, REPS, positions)
    lean.pack()
    packed = pass_seconds(backend, REPS) + pass_seconds(backend, REPS, positions)
    if packed >= dense:
        lean.unpack()
    return lean.packed
