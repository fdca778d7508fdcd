"""bfloat16 weights read against float32 activations (`dtype=bfloat16` on a CPU, where specflow's
native kernel builds): half the bytes a decoding pass reads, the arithmetic float32's.

A decoding pass streams its weights, so holding them in 16 bits halves its time where the
products read 16-bit weights at the memory's speed. torch's CPU products of bfloat16 inputs do
not (oneDNN's one-row bfloat16 product of SmolLM2's weights ran at 0.98x float32's). Here the
native product widens each bfloat16 weight to float32 as it reads it (exact: bfloat16 is
float32's upper half) and multiplies float32 inputs in float32, so the embedding, norms,
attention and KV cache stay float32 and the pass runs as the one native call. The weights are
rounded to bfloat16 once, at load; nothing else is.

A prompt's prefill is the exception, where the CPU multiplies bfloat16 in hardware (AVX512-BF16
or AMX-BF16) and torch has oneDNN: a prefill is compute-bound, and there oneDNN's bfloat16
product (inputs rounded to bfloat16, bfloat16 results) runs 2.2-2.5x the native float32
arithmetic (SmolLM2's matrices at 64-128 rows, 2-core Zen 4). Only a prefill's passes of
LIBRARY_ROWS queries or more take it (`prefill_layers`), so every pass that scores a position
(plain or speculative, any batch) runs the float32 arithmetic as before and speculation stays
exact; the prompt's keys and values carry bfloat16's rounding, as llama.cpp's bf16 path does.
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

    def describe(self) -> str:
        return "bfloat16 weights"


F16_WEIGHTS, F32 = 8, 0                # gemv.c's kinds


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
