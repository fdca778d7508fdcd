"""GGUF tensors of any block type without a quantizer (the `gguf` package quantizes only some):
random quantized bits with scales chosen so the weights are of a model's size."""
from __future__ import annotations

import numpy as np

from specflow.backends.lean.blocks import FILE_BLOCK

# where each type's float16 scale (and minimum) lie in its block
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,)}
SIZES = {**FILE_BLOCK, "IQ4_NL": (18, 32)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, cols / weights-per-block x bytes]: a tensor of `type_name` blocks, each
    quantized bit random, each float16 scale ~ scale (a minimum's: ~ 8 x scale, the middle of a
    4-bit range, so the weights' mean is near 0; negative where it is added, Q4_1 / Q5_1)."""
    size, per = SIZES[type_name]
    b = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for i, at in enumerate(SCALES[type_name]):
        v = np.abs(rng.standard_normal((rows, cols // per))) * scale * (8 if i else 1) + scale / 10
        if i and type_name in ("Q4_1", "Q5_1"):
            v = -v
        b[..., at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, cols // per, 2)
    return b.reshape(rows, -1)
