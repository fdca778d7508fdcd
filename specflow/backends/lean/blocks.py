"""Weights held in GGUF's own blocks, multiplied by specflow's native kernel (`blocks.c`):
`dtype=int4` and `dtype=int8` where the kernel builds, and a GGUF file's Q4_0 / Q4_1 / Q8_0
tensors at `dtype=auto` as the file holds them.

A block is 32 weights of a row: Q4_1 (20 bytes: float16 scale d and minimum m, 16 bytes of
nibbles, weight = q x d + m) or Q8_0 (34 bytes: float16 d, 32 int8, weight = q x d), ggml's
layouts byte for byte. A Q4_0 block ((q - 8) x d) is held as Q4_1 with m = -8d (exact in
float16). The product quantizes its input rows to int8 per block and sums each block's
products as integers (llama.cpp's arithmetic for these files), reading the weight once in 4.5-5
or 8.5 bits a weight, and it is also what the native pass (`native_pass.py`) runs inside its one
call, so a model held in blocks computes every product the same way whether its pass is native
or eager: its results do not depend on which.

specflow's own int4 (`quantize_q4`) writes Q4_1 blocks: each group of `group_size` weights (a
multiple of 32) shares d = (max - min) / 15 and m = min, both rounded to float16 first and q
rounded against them; int8 (`quantize_q8`) writes Q8_0 blocks, d = max |w| / 127.
"""
from __future__ import annotations

import numpy as np
import torch

from specflow.backends.lean import native

QK = 32
Q4_1, Q8_0 = 3, 4                      # blocks.c's kinds
BYTES = {Q4_1: 20, Q8_0: 34}
NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


def available() -> bool:
    """The native block product runs here (a C compiler built specflow's kernel)."""
    return native.available(torch.float32)


def fits(shape) -> bool:
    return shape[1] % QK == 0


class BlockWeight:
    """W [N, K] as N rows of K / 32 blocks (`data` uint8 [N, K / 32 x bytes]); `matmul(x)` is
    x [..., K] @ W^T -> [..., N] in x's dtype (computed in float32)."""

    is_mkldnn = False

    def __init__(self, kind: int, shape: tuple[int, int], data: torch.Tensor,
                 group_size: int = QK):
        self.kind_code = kind
        self.bits = 4 if kind == Q4_1 else 8
        self.shape = torch.Size(shape)
        self.data = data.contiguous()
        self.group_size = group_size

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def device(self) -> torch.device:
        return self.data.device

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def nbytes(self) -> int:
        return self.data.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (x's dtype)."""
        N, K = self.shape
        flat = x.reshape(-1, K)                                                          # [M, K]
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        out = torch.empty(flat.shape[0], N, dtype=torch.float32)                         # [M, N]
        if flat.shape[0]:
            failed = native._library().specflow_blocks(
                self.data.data_ptr(), self.kind_code, flat.data_ptr(), out.data_ptr(), N, K,
                flat.shape[0], torch.get_num_threads(), None, 0.0)
            if failed:
                raise MemoryError(f"specflow's block product could not allocate its buffers for "
                                  f"{flat.shape[0]} rows of {K}")
        return out.to(x.dtype).reshape(*x.shape[:-1], N)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32: each block's values as the kernel reads them."""
        N, K = self.shape
        raw = self.data.numpy().reshape(N, K // QK, BYTES[self.kind_code])
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
        if self.kind_code == Q8_0:
            q = raw[..., 2:].copy().view(np.int8).astype(np.float32)                  # [N, G, 32]
            return torch.from_numpy((q * d).reshape(N, K))
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]
        qs = raw[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], -1).astype(np.float32)                # [N, G, 32]
        return torch.from_numpy((q * d + m).reshape(N, K))

    def describe(self) -> str:
        return self.kind(self.bits, self.group_size)

    @staticmethod
    def kind(bits: int, group_size: int | None) -> str:
        return ("int8 weights in Q8_0 blocks (a scale per 32)" if bits == 8 else
                f"int4 weights in Q4_1 blocks (a scale and minimum per {group_size})")


def from_file_blocks(data: np.ndarray, type_name: str) -> BlockWeight:
    """A GGUF tensor's rows as the file holds them (uint8 [N, blocks x bytes]) of type Q4_0,
    Q4_1 or Q8_0; Q4_0 rewritten as Q4_1 (m = -8d)."""
    rows = np.ascontiguousarray(data)
    N = rows.shape[0]
    if type_name == "Q8_0":
        G = rows.shape[1] // 34
        return BlockWeight(Q8_0, (N, G * QK), torch.from_numpy(rows.reshape(N, -1).copy()))
    if type_name == "Q4_1":
        G = rows.shape[1] // 20
        return BlockWeight(Q4_1, (N, G * QK), torch.from_numpy(rows.reshape(N, -1).copy()))
    if type_name != "Q4_0":
        raise ValueError(f"{type_name} blocks are not held as they are; Q4_0, Q4_1 and Q8_0 are")
    old = rows.reshape(N, -1, 18)
    G = old.shape[1]
    new = np.empty((N, G, 20), np.uint8)
    d = old[..., 0:2].copy().view(np.float16)                                         # [N, G, 1]
    new[..., 0:2] = old[..., 0:2]
    new[..., 2:4] = (d * np.float16(-8)).view(np.uint8)       # exact: a power of two
    new[..., 4:] = old[..., 2:]
    return BlockWeight(Q4_1, (N, G * QK), torch.from_numpy(new.reshape(N, -1)))


def reorder_rows(w: BlockWeight, order: torch.Tensor) -> BlockWeight:
    """The same weight with its rows in `order` (a row's blocks move with it)."""
    return BlockWeight(w.kind_code, (len(order), w.shape[1]), w.data[order], w.group_size)


def stack(weights: list[BlockWeight]) -> BlockWeight:
    """Weights of one kind and width stacked along their rows (q/k/v, gate/up)."""
    first = weights[0]
    return BlockWeight(first.kind_code, (sum(w.shape[0] for w in weights), first.shape[1]),
                       torch.cat([w.data for w in weights]), first.group_size)


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
    q = q.reshape(N, K // QK, QK).numpy()                                            # [N, G, 32]
    per = group_size // QK                                 # 32-blocks per group
    d16 = d.to(torch.float16).repeat_interleave(per, 1).numpy()                      # [N, G]
    m16 = m.to(torch.float16).repeat_interleave(per, 1).numpy()
    out = np.empty((N, K // QK, 20), np.uint8)
    out[..., 0:2] = d16[..., None].view(np.uint8)
    out[..., 2:4] = m16[..., None].view(np.uint8)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeight(Q4_1, (N, K), torch.from_numpy(out.reshape(N, -1)), group_size)


def quantize_q8(w: torch.Tensor) -> BlockWeight:
    """W [N, K] as Q8_0 blocks: d = max |w| / 127 over each 32 (float16), q = round(w / d)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // QK, QK)                                   # [N, G, 32]
    d = (g.abs().amax(-1) / 127).to(torch.float16).float()
    d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / d[..., None]).clamp_(-127, 127).to(torch.int8).numpy()
    out = np.empty((N, K // QK, 34), np.uint8)
    out[..., 0:2] = d.to(torch.float16).numpy()[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return BlockWeight(Q8_0, (N, K), torch.from_numpy(out.reshape(N, -1)))
