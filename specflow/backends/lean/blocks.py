"""Weights held in GGUF's own blocks, multiplied by specflow's native kernel (`blocks.c`):
`dtype=int4` and `dtype=int8` where the kernel builds, and a GGUF file's Q4_0 / Q4_1 / Q8_0
tensors at `dtype=auto` as the file holds them.

A block is 32 weights of a row: Q4_1 (float16 scale d and minimum m, 4-bit q, weight = q x d +
m) or Q8_0 (float16 d, int8 q, weight = q x d), a file's own scales, minimums and quantized
weights, moved into tiles of 16 rows (blocks.c says why: one VNNI instruction then serves 16
rows); 5 and 9.5 bits a weight. A Q4_0 block ((q - 8) x d) is held as Q4_1 with m = -8d (exact
in float16). The product quantizes its input rows to int8 per block and sums each block's
products as integers (llama.cpp's arithmetic for these files), reading the weight once, and it
is also what the native pass (`native_pass.py`) runs inside its one call, so a model held in
blocks computes every product the same way whether its pass is native or eager.

specflow's own int4 (`quantize_q4`) writes Q4_1 blocks: each group of `group_size` weights (a
multiple of 32) shares d = (max - min) / 15 and m = min, both rounded to float16 first and q
rounded against them; int8 (`quantize_q8`) writes Q8_0 blocks, d = max |w| / 127.
"""
from __future__ import annotations

import numpy as np
import torch

from specflow.backends.lean import native

QK = 32
TR = 16                                # rows per tile
Q4_1, Q8_0 = 3, 4                      # blocks.c's kinds
TILE_BYTES = {Q4_1: 320, Q8_0: 608}    # a tile's bytes per block index (16 rows)
NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


def available() -> bool:
    """The native block product runs here (a C compiler built specflow's kernel)."""
    return native.available(torch.float32)


def fits(shape) -> bool:
    return shape[1] % QK == 0


def _tile(kind: int, d: np.ndarray, m: np.ndarray | None, q: np.ndarray) -> np.ndarray:
    """Blocks' parts -> blocks.c's tiles: d, m [N, G] float16, q [N, G, 32] (Q4_1: uint8 in
    0..15; Q8_0: int8) -> uint8 [tiles, G, TILE_BYTES] (rows past N zero)."""
    N, G = d.shape
    T = -(-N // TR)
    pad = T * TR - N
    if pad:
        d = np.concatenate([d, np.zeros((pad, G), d.dtype)])
        q = np.concatenate([q, np.zeros((pad, G, QK), q.dtype)])
        if m is not None:
            m = np.concatenate([m, np.zeros((pad, G), m.dtype)])
    ds = np.ascontiguousarray(d.reshape(T, TR, G).transpose(0, 2, 1), np.float16)  # [T, G, 16]
    if kind == Q4_1:
        q = q.reshape(T, TR, G, 2, 4, 4)                                # [T, i, G, half, c, u]
        packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)                   # [T, i, G, c, u]
        qs = packed.transpose(0, 2, 3, 1, 4).reshape(T, G, 256)         # [T, G, c, i, u]
        ms = np.ascontiguousarray(m.reshape(T, TR, G).transpose(0, 2, 1), np.float16)
        parts = [qs, ds.view(np.uint8), ms.view(np.uint8)]
    else:
        q8 = q.astype(np.int8).reshape(T, TR, G, 8, 4)                  # [T, i, G, k, u]
        qs = np.ascontiguousarray(q8.transpose(0, 2, 3, 1, 4)).reshape(T, G, 512).view(np.uint8)
        start = (-128 * q8.astype(np.int32).sum((3, 4))).astype(np.int32).transpose(0, 2, 1)
        parts = [qs, ds.view(np.uint8), np.ascontiguousarray(start).view(np.uint8)]
    return np.ascontiguousarray(np.concatenate(
        [np.ascontiguousarray(p).reshape(T, G, -1) for p in parts], -1))


def _untile(kind: int, data: np.ndarray, N: int, G: int):
    """_tile's inverse: (d [N, G] float16, m [N, G] float16 or None, q [N, G, 32])."""
    tiles = data.reshape(-1, G, TILE_BYTES[kind])
    T = tiles.shape[0]
    if kind == Q4_1:
        packed = tiles[..., :256].reshape(T, G, 4, TR, 4).transpose(0, 3, 1, 2, 4)  # [T, i, G, c, u]
        q = np.stack([packed & 0x0F, packed >> 4], 3).reshape(T * TR, G, QK)
        d = tiles[..., 256:288].copy().view(np.float16).transpose(0, 2, 1).reshape(T * TR, G)
        m = tiles[..., 288:320].copy().view(np.float16).transpose(0, 2, 1).reshape(T * TR, G)
        return d[:N], m[:N], q[:N]
    q = tiles[..., :512].copy().view(np.int8).reshape(T, G, 8, TR, 4).transpose(0, 3, 1, 2, 4)
    d = tiles[..., 512:544].copy().view(np.float16).transpose(0, 2, 1).reshape(T * TR, G)
    return d[:N], None, q.reshape(T * TR, G, QK)[:N]


class BlockWeight(native.HeldWeight):
    """W [N, K] as blocks of 32 weights, tiled for blocks.c (`data` uint8 [N / 16 tiles x
    K / 32 x TILE_BYTES]); `matmul(x)` is x [..., K] @ W^T -> [..., N] in x's dtype (computed
    in float32)."""

    def __init__(self, kind: int, d: np.ndarray, m: np.ndarray | None, q: np.ndarray,
                 group_size: int = QK):
        """d (and Q4_1's m) [N, G] float16, q [N, G, 32]: the blocks' parts."""
        self.kind_code = kind
        self.bits = 4 if kind == Q4_1 else 8
        N, G = d.shape
        self.shape = torch.Size((N, G * QK))
        self.data = torch.from_numpy(_tile(kind, d, m, q).reshape(-1))
        self.group_size = group_size

    def parts(self):
        """(d, m or None, q): the blocks' scales, minimums and quantized weights by row."""
        return _untile(self.kind_code, self.data.numpy(), self.shape[0], self.shape[1] // QK)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32: each block's values as the kernel reads them."""
        d, m, q = self.parts()
        N, K = self.shape
        values = q.astype(np.float32) * d.astype(np.float32)[..., None]
        if m is not None:
            values += m.astype(np.float32)[..., None]
        return torch.from_numpy(values.reshape(N, K))

    def describe(self) -> str:
        return ("int8 weights in Q8_0 blocks (a scale per 32)" if self.bits == 8 else
                f"int4 weights in Q4_1 blocks (a scale and minimum per {self.group_size})")


def file_parts(data: np.ndarray, type_name: str):
    """A GGUF tensor's rows as the file holds them (uint8 [N, blocks x bytes]) of type Q4_0,
    Q4_1 or Q8_0 -> (d [N, G] float16, m [N, G] float16 or None (Q8_0), q [N, G, 32]: Q4 in
    0..15, Q8_0 int8). A Q4_0 block, (q - 8) x d, comes as Q4_1 with m = -8d (exact in float16:
    a power of two); in a Q4 block byte j holds weight j low and weight j + 16 high."""
    rows = np.ascontiguousarray(data)
    N = rows.shape[0]
    if type_name == "Q8_0":
        blocks = rows.reshape(N, -1, 34)
        return blocks[..., 0:2].copy().view(np.float16)[..., 0], None, \
            blocks[..., 2:].copy().view(np.int8)
    if type_name not in ("Q4_0", "Q4_1"):
        raise ValueError(f"{type_name} blocks are not held as they are; Q4_0, Q4_1 and Q8_0 are")
    size = 18 if type_name == "Q4_0" else 20
    blocks = rows.reshape(N, -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = d * np.float16(-8) if type_name == "Q4_0" else \
        blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., size - 16:]
    return d, m, np.concatenate([nibbles & 0x0F, nibbles >> 4], -1)


def from_file_blocks(data: np.ndarray, type_name: str) -> BlockWeight:
    """A GGUF tensor's rows as the file holds them, of type Q4_0, Q4_1 or Q8_0: the same
    scales, minimums and quantized weights (file_parts), tiled."""
    return BlockWeight(Q8_0 if type_name == "Q8_0" else Q4_1, *file_parts(data, type_name))


def reorder_rows(w: BlockWeight, order: torch.Tensor) -> BlockWeight:
    """The same weight with its rows in `order` (a row's blocks move with it)."""
    d, m, q = w.parts()
    idx = order.numpy()
    return BlockWeight(w.kind_code, d[idx], None if m is None else m[idx], q[idx], w.group_size)


def stack(weights: list[BlockWeight]) -> BlockWeight:
    """Weights of one kind and width stacked along their rows (q/k/v, gate/up)."""
    parts = [w.parts() for w in weights]
    first = weights[0]
    return BlockWeight(first.kind_code, np.concatenate([p[0] for p in parts]),
                       None if parts[0][1] is None else np.concatenate([p[1] for p in parts]),
                       np.concatenate([p[2] for p in parts]), first.group_size)


def quantize_q4(w: torch.Tensor, group_size: int = QK) -> BlockWeight:
    """W [N, K] as Q4_1 blocks: each group of `group_size` weights (a multiple of 32) shares d =
    (max - min) / 15 and m = min, both in float16, and q = round((w - m) / d) in [0, 15]."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // group_size, group_size)                 # [N, Gg, g]
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16).float()
    d = torch.where(d > 0, d, torch.ones_like(d))          # a constant group: q = 0, value m
    m = lo.to(torch.float16).float()
    q = torch.round((g - m[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8)
    per = group_size // QK                                 # 32-blocks per group
    return BlockWeight(Q4_1, d.to(torch.float16).repeat_interleave(per, 1).numpy(),
                       m.to(torch.float16).repeat_interleave(per, 1).numpy(),
                       q.reshape(N, K // QK, QK).numpy(), group_size)


def quantize_q8(w: torch.Tensor) -> BlockWeight:
    """W [N, K] as Q8_0 blocks: d = max |w| / 127 over each 32 (float16), q = round(w / d)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // QK, QK)                                   # [N, G, 32]
    d = (g.abs().amax(-1) / 127).to(torch.float16).float()
    d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / d[..., None]).clamp_(-127, 127).to(torch.int8)
    return BlockWeight(Q8_0, d.to(torch.float16).numpy(), None, q.numpy())
