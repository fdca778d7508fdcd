"""A GGUF file's blocks held as they are (`dtype=auto` on a GGUF file whose layers are of the
types held_types() names), and its LM head's.

Where specflow's native kernel builds, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks
are kept with the file's own scales, minimums and quantized weights in one of the kernel's four
tile kinds and multiplied by it (backends/lean/blocks.py says which holds which, all exact), the
head too. Elsewhere Q4_0 / Q4_1 go into ATen's int4 layout, as follows. A Q4_1 block holds 32 weights of a
row as 4-bit q with a float16 scale d and minimum m (value = q x d + m); Q4_0 as (q - 8) x d.
That is the int4 layout with group 32, scale d and zero m + 8d (or 0):
backends/lean/quantized.py. So the blocks are taken from the file bit for bit, and the values
the products read are the file's, up to the float32 rounding of m + 8d (the scales and minimums
widen from float16 exactly). In a block, byte j holds weight j in its low nibble and weight j +
16 in its high one (ggml's layout).

transformers reorders the rows of Llama's q and k projections when it reads a GGUF file (ggml
interleaves each head's rotary halves; not Qwen2's); the blocks' rows are read in the order
whose values equal the model transformers loaded, checked before anything is replaced, and a
file matching neither keeps the float path.
"""
from __future__ import annotations


import numpy as np
import torch

from specflow.backends.lean import blocks as native_blocks
from specflow.backends.lean import gguf_index
from specflow.backends.lean.quantized import from_int4_blocks

INT4_TYPES = ("Q4_0", "Q4_1")
BLOCK = 32
# ggml's names for a layer's products -> the lean forward's (field, part) (backends/lean/forward.py)
PARTS = {"attn_q": (1, 0), "attn_k": (1, 1), "attn_v": (1, 2), "attn_output": (3, 0),
         "ffn_gate": (6, 0), "ffn_up": (6, 1), "ffn_down": (7, 0)}


def read_q4(data: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 tensor's rows (uint8 [N, blocks x bytes]) -> q [N, K] uint8 in [0, 15],
    scale and zero [N, K / 32] float32 (value = (q - 8) x scale + zero): ATen's int4 layout's
    parts from the file's (blocks.file_parts)."""
    _, d, m, q = native_blocks.file_parts(data, kind)
    d32 = d.astype(np.float32)
    zero = m.astype(np.float32) + 8 * d32                     # Q4_0: -8d + 8d, exactly 0
    return (torch.from_numpy(q.reshape(q.shape[0], -1).copy()), torch.from_numpy(d32),
            torch.from_numpy(zero))


def _rotary_rows(n: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a GGUF q/k projection of `heads` heads (its
    reverse_permute_weights): row r of the model is row order[r] of the file."""
    half = n // heads // 2
    return torch.arange(n).reshape(heads, half, 2).transpose(1, 2).reshape(n)


def file_types(path: str) -> dict[str, str]:
    """Each tensor's quantization type name in a GGUF file."""
    return {t.name: t.tensor_type.name for t in gguf_index.read(path)}


def held_types() -> tuple[str, ...]:
    """The block types dtype=auto holds as they are: where specflow's native kernel builds,
    blocks.FILE_TYPES (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K); elsewhere Q4_0 and Q4_1
    (ATen's int4 layout)."""
    return native_blocks.FILE_TYPES if native_blocks.available() else INT4_TYPES


def other_layer_types(types: dict[str, str], held: tuple[str, ...] | None = None) -> list[str]:
    """The types of a file's layer products (`file_types`) other than `held` (held_types()):
    none, and every layer's blocks are held as they are."""
    held = held_types() if held is None else held
    return sorted({kind for name, kind in types.items() if name.startswith("blk.")
                   and name.split(".")[2] in PARTS and kind not in held})


def layer_blocks(path: str, layers: int, heads: int, kv_heads: int,
                 rotary_order: bool = True) -> dict | None:
    """{(layer, field): BlockWeight, or QuantizedWeight on ATen's int4} for every product of
    every layer, from a file whose layer products are all of held_types() (None otherwise):
    q/k/v and gate/up stacked as the lean forward fuses them (of two types: in a kind that
    holds both, blocks.stack); `rotary_order`: q/k rows
    reordered as transformers does for Llama (ggml's convert interleaves them; a Qwen2 file is
    stored in the model's own order)."""
    found: dict[tuple[int, int], list] = {}
    as_blocks = native_blocks.available()        # else ATen's int4 layout (values as they are)
    held_kinds = held_types()
    for t in gguf_index.read(path):
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in PARTS:
            continue
        if t.tensor_type.name not in held_kinds:
            return None
        i, (field, part) = int(parts[1]), PARTS[parts[2]]
        if as_blocks:
            held = native_blocks.from_file_blocks(np.asarray(t.data), t.tensor_type.name)
        else:
            held = read_q4(np.asarray(t.data), t.tensor_type.name)
        if rotary_order and parts[2] in ("attn_q", "attn_k"):
            n = held.shape[0] if as_blocks else held[0].shape[0]
            order = _rotary_rows(n, heads if parts[2] == "attn_q" else kv_heads)
            held = native_blocks.reorder_rows(held, order) if as_blocks else \
                tuple(p[order] for p in held)
        found.setdefault((i, field), [None] * (3 if field == 1 else 2 if field == 6 else 1))
        found[(i, field)][part] = held
    if len(found) != 4 * layers or any(p is None for parts in found.values() for p in parts):
        return None
    if as_blocks:      # one product at a time: the unstacked parts freed as it goes
        return {key: native_blocks.stack(found.pop(key)) for key in list(found)}
    return {key: from_int4_blocks(torch.cat([p[0] for p in parts]),
                                  torch.cat([p[1] for p in parts]),
                                  torch.cat([p[2] for p in parts]), BLOCK)
            for key, parts in found.items()}


def head_blocks(path: str):
    """The LM head (output.weight, else the tied token_embd.weight) as the file's own blocks
    (backends/lean/blocks.py), or None: another type, or no native kernel."""
    if not native_blocks.available():
        return None
    tensors = {t.name: t for t in gguf_index.read(path)}
    t = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if t is None or t.tensor_type.name not in native_blocks.FILE_TYPES:
        return None
    return native_blocks.from_file_blocks(np.asarray(t.data), t.tensor_type.name)


def matches(held, dense: torch.Tensor, rows: int | None = None) -> bool:
    """The blocks' values are the weights transformers loaded (its dequantization of the same
    file), row for row: the row order and the nibble layout are right. `rows`: the first rows
    only, read from the tiles (the native kernel's lookup): a 49152-row head's check untiled
    the whole head, ~70 MB for a moment, and that moment was the load's peak."""
    if rows is None:
        values = held.dequantize()
    else:
        values, dense = held.rows(torch.arange(rows)), dense[:rows]
    return bool(torch.allclose(values, dense.float(), rtol=1e-3, atol=1e-4))
