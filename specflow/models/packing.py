"""Whether the target's (and a draft model's) lean forward packs its weights for oneDNN:
`pack: auto | true | false`.

Packing is a trade measured on whole passes. On a 2-core AMD EPYC (fp32, demo target, context
256) one position costs 3.9 ms packed against 3.2 dense (each oneDNN call has ~14 us more
overhead than MKL's, and it streams a single row more slowly), while 5 positions cost 4.3 against
5.9, 9 positions 5.7 against 8.9, and a batch of 8 rows at 5 positions 16 against 20. A pipeline
runs passes between two ends: one row at one position (plain decoding of a lone request) and a
full batch at k+1 positions (max_batch_size rows; k = 0 without speculation). `auto` times a pass
at each end both ways when the pipeline is built and packs when their sum is lower packed; if
the full pass is the one-row pass, nothing is timed and the weights stay dense. A draft model is
decided alike when it is built, its fullest step being a tree's frontier (proposer.topk
positions) or one position in every slot. (Its one-row step is ~0.6 ms dearer packed on the
demo draft and its 16-row steps ~20% cheaper, so at batch 16 the two ends nearly tie and auto
may keep it dense, although whole runs of 16 requests measured ~10% faster with it packed:
`pack=true` packs both.) `true` packs whenever the CPU's torch build can, `false` never. A
packed weight replaces the dense one, so neither choice costs memory, but for an LM head tied
to the embedding, packed as a copy (the lookup reads the dense table): the widest product of a
pass, a quarter of the demo target's weights, and at 17 positions oneDNN reads it in about half
MKL's time (a 17-position tree pass 12 ms packed against 18-23 dense). A change of thread count
afterwards keeps the choice. CUDA, forward=hf and non-lean models never pack.
"""
from __future__ import annotations

from specflow.models.kernels import can_pack
from specflow.models.threads import pass_seconds

REPS = 15          # passes timed per end and layout (~0.5 s on the demo target)


def packable(backend) -> bool:
    lean = getattr(backend, "lean", None)
    return lean is not None and backend.device.type == "cpu" and can_pack(backend.model.dtype)


def choose_pack(setting, backend, positions: int, rows: int = 1) -> bool:
    """Apply `pack` for the target `backend`, whose fullest pass scores `positions` positions
    (k+1) in each of `rows` rows (the batch); return whether its weights are packed."""
    if setting is False or not packable(backend):
        return False
    lean = backend.lean
    if setting is True:
        lean.pack()
        return True
    if positions * rows <= 1:
        return False

    def both_ends() -> float:
        return pass_seconds(backend, REPS) + pass_seconds(backend, REPS, positions, rows)

    dense = both_ends()
    lean.pack()
    if both_ends() >= dense:
        lean.unpack()
    return lean.packed
