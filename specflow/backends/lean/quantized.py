"""Weight-only int8 and int4 layouts for the lean forward's products: `model.dtype=int8 | int4`.

A decoding pass on a CPU is bound by the bytes of weights it reads, so a weight held in 8 or 4
bits is read two or four times faster than the float32 one a user's file was widened to
(SmolLM2-135M: 540 MB a token in float32). The products stay ATen's own weight-only operators,
the ones torchao and gpt-fast call on a CPU, with activations in float32 (or the model's float
dtype):

- int8: one scale per output row (symmetric, q in [-128, 127]),
  `torch.ops.aten._weight_int8pack_mm(x, q [N, K] int8, scale [N])`;
- int4: a scale and an offset per group of `group_size` inputs of each row (asymmetric, q in
  [0, 15], value = (q - 8) x scale + zero), `aten._weight_int4pack_mm_for_cpu(x, packed,
  group_size, scales_and_zeros [K / group_size, N, 2])` over the weight packed once by
  `aten._convert_weight_to_int4pack_for_cpu`.

A GGUF block of 32 weights stored as q x d + m (Q4_1) or (q - 8) x d (Q4_0) is the int4 layout
with group 32, scale d and zero m + 8d (or 0): `from_int4_blocks` takes them as they are.

The int4 operator needs K to be a multiple of the group size and of 2, and N a multiple of 16
(its packed layout's tile); a weight that does not fit stays dense (`quantize_weight` returns
None) and the caller says so.
"""
from __future__ import annotations

import functools

import torch

INT4_TILE_N = 16        # the int4 packed layout's rows per tile (N must be a multiple)


class QuantizedWeight:
    """W [N, K] held in `bits` (8 or 4) bits a weight; `matmul(x)` is x [..., K] @ W^T -> [..., N]
    in x's dtype."""

    def __init__(self, bits: int, shape: tuple[int, int], data: torch.Tensor,
                 scales: torch.Tensor, group_size: int | None = None):
        self.bits = bits
        self.shape = torch.Size(shape)
        self.data = data              # int8: q [N, K] int8; int4: the packed uint8 layout
        self.scales = scales          # int8: [N] float32; int4: [K / g, N, 2] float32
        self.group_size = group_size
        self._cast: dict[torch.dtype, torch.Tensor] = {torch.float32: scales}

    is_mkldnn = False                 # (a weight the lean forward's layouts treat as their own)

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + \
            self.scales.numel() * self.scales.element_size()

    def _scales(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._cast:
            self._cast[dtype] = self.scales.to(dtype)
        return self._cast[dtype]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (x's dtype)."""
        flat = x.reshape(-1, x.shape[-1])                                              # [M, K]
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if self.bits == 8:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.data, self._scales(x.dtype))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.data, self.group_size,
                                                             self._scales(x.dtype))
        return out.reshape(*x.shape[:-1], self.shape[0])                               # [..., N]

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32, as the operator reads it."""
        N, K = self.shape
        if self.bits == 8:
            return self.data.float() * self.scales[:, None]
        eye = torch.eye(K, dtype=torch.float32)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.data, self.group_size, self.scales).T.contiguous()              # [N, K]

    def describe(self) -> str:
        return "int8 weights (a scale per row)" if self.bits == 8 else \
            f"int4 weights (a scale and zero per {self.group_size})"


def bf16_weight_only(dtype: str, activations: str, device: torch.device, device_map) -> bool:
    """`dtype=bfloat16` as bfloat16 weights read against float32 activations
    (backends/lean/bf16_weights.py): on a CPU where the native kernel builds, with
    `activations=auto` or `float32`; `activations=bfloat16` (or a GPU) keeps a bfloat16 model."""
    from specflow.backends.lean import blocks

    return dtype == "bfloat16" and device.type == "cpu" and not device_map \
        and activations != "bfloat16" and blocks.available()


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-row int8: scale = max |w| / 127 over the row."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(1) / 127).clamp(min=1e-12)                                 # [N]
    q = torch.round(w32 / scale[:, None]).clamp_(-128, 127).to(torch.int8)             # [N, K]
    return QuantizedWeight(8, tuple(w.shape), q.contiguous(), scale.contiguous())


def int4_fits(shape, group_size: int) -> bool:
    N, K = shape
    return K % group_size == 0 and K % 2 == 0 and N % INT4_TILE_N == 0 and group_size % 2 == 0


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` inputs: scale = (max - min) / 15, q = round((w -
    min) / scale) in [0, 15], zero = min + 8 x scale (the operator reads (q - 8) x scale + zero)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // group_size, group_size)                  # [N, G, g]
    lo, hi = g.amin(-1), g.amax(-1)                                                     # [N, G]
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15)
    return from_int4_blocks(q.to(torch.uint8).reshape(N, K), scale, lo + 8 * scale, group_size)


def from_int4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     group_size: int) -> QuantizedWeight:
    """The int4 layout from its parts: q [N, K] in [0, 15], scale and zero [N, K / group_size]
    (value = (q - 8) x scale + zero)."""
    N, K = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales = torch.stack([scale.float().T, zero.float().T], -1).contiguous()          # [G, N, 2]
    return QuantizedWeight(4, (N, K), packed, scales, group_size)


def quantize_weight(w: torch.Tensor, bits: int, group_size: int, bf16_dot: bool = False,
                    half: torch.dtype = torch.bfloat16):
    """W in `bits` bits, or None where no layout can hold its shape: GGUF blocks multiplied by
    specflow's native kernel where it builds (backends/lean/blocks.py: Q8_0 for int8, Q4_1 for
    int4; a width that is a multiple of 32), else ATen's layouts; 16: `half` (bfloat16 or
    float16) weights for the native kernel (bf16_weights.py: bfloat16 with `bf16_dot`, the
    CPU's bfloat16 products where it has them; float16 read against float32 inputs), None
    without it."""
    from specflow.backends.lean import blocks

    if bits == 16:                    # 16-bit weights (native only)
        from specflow.backends.lean.bf16_weights import hold, hold_bf16

        if not blocks.available():
            return None
        return hold(w.to(torch.float16)) if half == torch.float16 else hold_bf16(w, bf16_dot)
    if blocks.available() and blocks.fits(w.shape) and group_size % blocks.QK == 0 \
            and w.shape[1] % group_size == 0:
        return blocks.quantize_q8(w) if bits == 8 else blocks.quantize_q4(w, group_size)
    if bits == 8:
        return quantize_int8(w)
    if not int4_fits(w.shape, group_size):
        return None
    return quantize_int4(w, group_size)


def activation_dtype(setting: str) -> torch.dtype:
    """`activations=auto | float32 | bfloat16` as a dtype: auto is float32 where the native
    block product runs (its products and its one-call pass read float32) and bfloat16 on
    ATen's weight-only operators (4-10x slower with float32 there)."""
    from specflow.backends.lean import blocks

    if setting == "auto":
        return torch.float32 if blocks.available() else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[setting]


@functools.cache
def available(bits: int) -> bool:
    """This machine multiplies weights held in `bits` bits: specflow's native block product, or
    this torch build's CPU weight-only operator."""
    from specflow.backends.lean import blocks

    if blocks.available():
        return True
    try:
        w = torch.randn(16, 64)
        got = quantize_weight(w, bits, 32).matmul(torch.ones(1, 64))
        return bool(torch.isfinite(got).all())
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class QuantizedLinear(torch.nn.Module):
    """nn.Linear's place in transformers' own forward (`model.forward=hf`, or an architecture
    the lean forward does not cover), multiplying through a QuantizedWeight."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.weight_q = weight
        self.bias = bias
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_q.matmul(x)
        return out if self.bias is None else out + self.bias


def quantize_linears(model: torch.nn.Module, bits: int, group_size: int) -> list[str]:
    """Replace every nn.Linear of `model` with a QuantizedLinear (its weight in `bits` bits);
    returns the names of those left dense (a shape int4 cannot tile)."""
    left = []
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)]
    with torch.no_grad():
        for name, module in targets:
            held = quantize_weight(module.weight, bits, group_size)
            if held is None:
                left.append(name)
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantizedLinear(held, module.bias))
    return left
