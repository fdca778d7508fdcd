"""bfloat16 weights for the native kernel (`dtype=bfloat16` on a CPU, where specflow's native
kernel builds): half the bytes a decoding pass reads. Two layouts.

Where the CPU multiplies bfloat16 itself (AVX512-BF16: the build's `vdpbf16ps`) and
`activations=auto`: Bf16Tiles. Each product rounds its input rows to bfloat16 (to nearest
even) and sums pairs of products in float32, 32 an instruction (blocks.c's BF16 tiles): the
arithmetic of llama.cpp's bf16 files. The products read it whatever their rows, the pass's
and a prefill's alike, so a row's bits never depend on how many rows a pass has, and
speculation over it is exact. A decoding pass is memory-bound and reads the same bytes either
way; a pass of a few rows (verification's k + 1 positions) was compute-bound with float32
arithmetic (SmolLM2's 5-position pass 1.31-1.37x a one-position one, 1.17-1.23x here) and a
prefill of 40-120 rows runs 1.35-1.8x faster than oneDNN's bfloat16 product did.

Elsewhere, or with `activations=float32`: Bf16Weight, read against float32 activations: the
native product widens each bfloat16 weight to float32 as it reads it (exact: bfloat16 is
float32's upper half) and multiplies float32 inputs in float32 (torch's CPU products of
bfloat16 inputs do not stream 16-bit weights at the memory's speed: oneDNN's one-row bfloat16
product of SmolLM2's weights ran at 0.98x float32's). Either way the embedding, norms,
attention and KV cache stay float32 and the pass runs as the one native call; the weights are
rounded to bfloat16 once, at load.

A widening layout's prefill is the exception, where the CPU multiplies bfloat16 in hardware
and torch has oneDNN: a prefill is compute-bound, and there oneDNN's bfloat16 product (inputs
rounded to bfloat16, bfloat16 results) runs 2.2-2.5x the native float32 arithmetic (SmolLM2's
matrices at 64-128 rows, 2-core Zen 4). Only a prefill's passes of LIBRARY_ROWS queries or
more take it (`prefill_layers`), so every pass that scores a position (plain or speculative,
any batch) runs the float32 arithmetic as before and speculation stays exact; the prompt's keys
and values carry bfloat16's rounding, as llama.cpp's bf16 path does.
"""
from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F

from specflow.backends.lean import native

BF16_WEIGHTS = 5                       # gemv.c's kind
LIBRARY_ROWS = 32                      # a prefill's products from this many rows: oneDNN's

@functools.cache
def hardware_bf16() -> bool:
    """This CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16; Linux's flags) and
    torch has oneDNN to do it; elsewhere oneDNN's bfloat16 product is emulated and slower."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", flags) is not None


class Bf16Weight(native.HeldWeight):
    """W [N, K] held in bfloat16; `matmul(x)` is x [..., K] @ W^T -> [..., N] in x's dtype."""

    kind_code = BF16_WEIGHTS
    bits = 16
    group_size = None

    def __init__(self, w: torch.Tensor):
        self.data = w.detach().to(torch.bfloat16).contiguous()                         # [N, K]
        self.shape = self.data.shape

    def dequantize(self) -> torch.Tensor:
        return self.data.float()

    def first_rows(self, n: int):
        """The first n rows (a view of data): this class, float16's or float32's."""
        cut = type(self).__new__(type(self))
        cut.data, cut.shape = self.data[:n], torch.Size((n, self.shape[1]))
        return cut

    def describe(self) -> str:
        return "bfloat16 weights"


F16_WEIGHTS, F32 = 8, 0                # gemv.c's kinds
BF16_TILES = 9                         # blocks.c's BF16 tiles
TILE_ROWS, TILE_COLUMNS = 16, 32


def hardware_dot() -> bool:
    """This build of the native kernel multiplies bfloat16 pairs in hardware (`vdpbf16ps`:
    compiled for a CPU with AVX512-BF16)."""
    lib = native._library()
    return lib is not None and lib.bf16_dot


class Bf16Tiles(native.HeldWeight):
    """W [N, K] held in bfloat16, laid out for `vdpbf16ps` (blocks.c's BF16 tiles: each 64 bytes
    hold a pair of consecutive weights of 16 rows), multiplied by the inputs rounded to bfloat16
    with float32 sums: `dtype=bfloat16` where the CPU multiplies bfloat16 itself (AVX512-BF16).

    The widening product (Bf16Weight) keeps float32 arithmetic and turns compute-bound from a
    few rows on: the weight's every element widened and multiplied in float32, 8 lanes an
    instruction, against 32 products an instruction here. K a multiple of 32 (TILE_COLUMNS)."""

    kind_code = BF16_TILES
    bits = 16
    group_size = None

    def __init__(self, w: torch.Tensor):
        N, K = w.shape
        if K % TILE_COLUMNS:
            raise ValueError(f"bfloat16 tiles need a width that is a multiple of {TILE_COLUMNS}, "
                             f"not {K}")
        T, G = -(-N // TILE_ROWS), K // TILE_COLUMNS
        rows = torch.zeros(T * TILE_ROWS, K, dtype=torch.bfloat16)                  # [T*16, K]
        rows[:N] = w.detach().to(torch.bfloat16)
        # [T, 16 rows, G, 16 pairs, 2] -> [T, G, 16 pairs, 16 rows, 2]: a pair of each row a lane
        tiles = rows.view(T, TILE_ROWS, G, TILE_COLUMNS // 2, 2).permute(0, 2, 3, 1, 4)
        self.data = tiles.contiguous().view(-1)                                      # [T*G*512]
        self.shape = torch.Size((N, K))

    def dequantize(self) -> torch.Tensor:
        N, K = self.shape
        T, G = -(-N // TILE_ROWS), K // TILE_COLUMNS
        tiles = self.data.view(T, G, TILE_COLUMNS // 2, TILE_ROWS, 2).permute(0, 3, 1, 2, 4)
        return tiles.reshape(T * TILE_ROWS, K)[:N].float()                            # [N, K]

    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 2          # the padding rows are not the weight's

    def first_rows(self, n: int):
        """The first n rows (n a multiple of 16: whole tiles, a view of data), or None."""
        if n % TILE_ROWS:
            return None
        cut = Bf16Tiles.__new__(Bf16Tiles)
        cut.data, cut.shape = self.data[:n * self.shape[1]], torch.Size((n, self.shape[1]))
        return cut

    def describe(self) -> str:
        return "bfloat16 weights by bfloat16-rounded inputs (AVX512-BF16)"


def hold_bf16(w: torch.Tensor, dot: bool = True):
    """W in bfloat16 for the native product: tiles for `vdpbf16ps` where `dot` and the build has
    it and the width suits them, else read against float32 inputs (Bf16Weight)."""
    if dot and hardware_dot() and w.shape[1] % TILE_COLUMNS == 0:
        return Bf16Tiles(w)
    return Bf16Weight(w)


class F16Weight(Bf16Weight):
    """W [N, K] held in float16 as it is (an EAGLE head saved so), widened exactly as it is read
    against float32 inputs (where the compiler has _Float16: native.available(float16))."""

    kind_code = F16_WEIGHTS

    def __init__(self, w: torch.Tensor):
        self.data = w.detach().to(torch.float16).contiguous()                          # [N, K]
        self.shape = self.data.shape

    def describe(self) -> str:
        return "float16 weights"


class F32Weight(Bf16Weight):
    """W [N, K] float32, for the native calls that take held weights."""

    kind_code = F32
    bits = 32

    def __init__(self, w: torch.Tensor):
        self.data = w.detach().float().contiguous()                                    # [N, K]
        self.shape = self.data.shape

    def describe(self) -> str:
        return "float32 weights"


def hold(w: torch.Tensor):
    """A float weight as it is, for the native calls: float16 and bfloat16 read against float32
    inputs, float32 as float32; None where this build has no float16 products."""
    if w.dtype == torch.float16:
        return F16Weight(w) if native.available(torch.float16) else None
    return Bf16Weight(w) if w.dtype == torch.bfloat16 else F32Weight(w)


class PrefillProduct:
    """A Bf16Weight's bytes read by oneDNN's bfloat16 product (inputs and results rounded to
    bfloat16): the layers of a prefill pass (prefill_layers)."""

    def __init__(self, held: Bf16Weight):
        self.data, self.shape = held.data, held.shape                                 # [N, K]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        return F.linear(x.to(torch.bfloat16), self.data).to(x.dtype)


def prefill_layers(layers: list[tuple]) -> list[tuple] | None:
    """A lean forward's layers with each Bf16Weight read by PrefillProduct, where every held
    product is a Bf16Weight (dtype=bfloat16's native layout) and the CPU multiplies bfloat16 in
    hardware; None elsewhere (the prefill keeps the layers as they are)."""
    held = [w for weights in layers for w in weights
            if w is not None and not isinstance(w, torch.Tensor)]
    if not held or any(type(w) is not Bf16Weight for w in held) or not hardware_bf16():
        return None
    return [tuple(PrefillProduct(w) if type(w) is Bf16Weight else w for w in weights)
            for weights in layers]
