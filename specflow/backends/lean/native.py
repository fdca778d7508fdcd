"""A product of a few rows by a wide float32, bfloat16 or float16 weight that streams the
weight at memory speed (`gemv.c`), compiled for this CPU on first use.

torch's CPU products for 1-8 rows read a wide weight well below the memory's bandwidth on some
CPUs (MKL's AVX-512 paths are not taken on AMD; oneDNN's packed product has a fixed cost per call
and streams one row slower than it could), and a decoding pass is that product, once per weight
matrix. `gemv.c` is one short loop: each thread reads a contiguous block of the weight's rows in
order, against up to six rows of the input at once, and can apply the RMSNorm in front of the
product as it reads the input (`LeanLlama._normed_mm`). `kernels.pick()` times it beside torch's
forms on the model's own weights and takes it where it is faster; nothing else depends on it.

It is compiled with the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`) with
`-O3 -march=native -ffp-contract=off -fopenmp` into specflow's cache (`$SPECFLOW_CACHE`, default ~/.cache/specflow,
under `kernels/`, keyed by the source, the flags and the CPU), once per machine, in about a second,
and loaded after torch so that it shares torch's OpenMP runtime. Without a compiler, or with
`SPECFLOW_NATIVE=0`, it is simply not offered (`available()` is False) and torch's forms are used.

Every row of the result is computed by the same operations whatever the number of rows beside it
and the thread count, so a row's logits do not depend on the batch (tests/backends/lean/test_native.py):
every multiply-add in `gemv.c` is written out (fused where the CPU has an FMA), and the compiler
is told not to fuse any on its own, which it would otherwise do in some loops and not in others.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

SOURCE = pathlib.Path(__file__).with_name("gemv.c")
SOURCES = (SOURCE, SOURCE.with_name("blocks.c"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm")
ENV = "SPECFLOW_NATIVE"        # 0: never offer the native product
MAX_ROWS = 128                 # the most rows the native product and pass take: a batch's k+1
                               # positions (16 rows at k = 7), a token tree of up to 127 drafts;
                               # kernels.pick() measures how far it stays the fastest form


def _compiler() -> str | None:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if found := shutil.which(name):
            return found
    return None


def _cpu_key() -> str:
    """What the compiled code depends on besides its source: the CPU model and its flags."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text()
        wanted = [line for line in info.splitlines() if line.startswith(("model name", "flags",
                                                                         "Features", "CPU part"))]
        return "\n".join(sorted(set(wanted)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built once per machine into the cache; None without a compiler."""
    if os.environ.get(ENV, "1") == "0" or not all(f.exists() for f in SOURCES):
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    from specflow.paths import cache_root

    source = b"".join(f.read_bytes() for f in SOURCES)      # gemv.c includes blocks.c
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_key().encode()
                         + compiler.encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"gemv-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = pathlib.Path(tmp) / target.name
            try:
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                               capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return None                    # no usable compiler or no OpenMP: torch's forms
            os.replace(built, target)          # atomic: a concurrent build finds a whole file
    try:
        lib = ctypes.CDLL(str(target))        # after torch: its libgomp is the one linked
    except OSError:
        return None
    lib.specflow_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float]
    lib.specflow_gemv.restype = ctypes.c_int
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.specflow_layers.argtypes = [P] + [I64] * 7 + [P, P, P, ctypes.c_float, P, P, I64, P, P,
                                                      P, P, I64, P, P, P, P, ctypes.c_int]
    lib.specflow_layers.restype = ctypes.c_int
    lib.specflow_layers_head.argtypes = lib.specflow_layers.argtypes[:-1] + [
        P, P, ctypes.c_int, I64, P, ctypes.c_int]
    lib.specflow_layers_head.restype = ctypes.c_int
    lib.specflow_held.argtypes = [P, ctypes.c_int, P, P, I64, I64, I64, ctypes.c_int, P,
                                  ctypes.c_float]
    lib.specflow_held.restype = ctypes.c_int
    lib.specflow_side_layer.argtypes = [P, P, P] + [I64] * 6 + [P, P, P, ctypes.c_float, P, P,
                                                              I64, P, P, P, P, I64, P, P,
                                                              ctypes.c_int]
    lib.specflow_side_layer.restype = ctypes.c_int
    lib.specflow_chain.argtypes = [P, ctypes.c_int, I64, I64, P, P, P] + [I64] * 7 + [P, P, P, ctypes.c_float,
                                                                    P, P, I64, P, P, P, P, I64,
                                                                    P, P, ctypes.c_int, I64, I64,
                                                                    P, ctypes.c_float, ctypes.c_int]
    lib.specflow_chain.restype = ctypes.c_int
    lib.specflow_head_chain.argtypes = [P, P, I64, P, I64, P] + [I64] * 6 + [
        P, P, P, ctypes.c_float, P, P, I64, P, P, P, P, I64, P, P, ctypes.c_int, I64, P, P,
        ctypes.c_float, ctypes.c_int]
    lib.specflow_head_chain.restype = ctypes.c_int
    lib.specflow_block_rows.argtypes = [P, ctypes.c_int, P, I64, I64, I64, P]
    lib.specflow_block_rows.restype = ctypes.c_int
    lib.specflow_argmax.argtypes = [P, I64, I64, P]
    lib.specflow_argmax.restype = ctypes.c_int
    lib.specflow_row_max.argtypes = [P, I64, I64, P]
    lib.specflow_row_max.restype = ctypes.c_int
    lib.has_f16 = bool(lib.specflow_has_f16())
    lib.vnni = bool(lib.specflow_blocks_vnni())
    lib.bf16_dot = bool(lib.specflow_bf16_dot())
    return lib


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """The native product runs here for weights of `dtype` (float32, bfloat16, and float16 where
    the compiler has _Float16)."""
    lib = _library()
    return dtype in DTYPES and lib is not None and (dtype != torch.float16 or lib.has_f16)


CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The native product takes x [M, K] and W [N, K]: CPU tensors of one dtype it has, W
    contiguous, M <= MAX_ROWS, and nothing for autograd to record (a model's parameters require
    gradients; under no_grad / inference_mode nothing is recorded)."""
    return (x.shape[0] <= MAX_ROWS and x.dtype == w.dtype and available(w.dtype)
            and x.device.type == "cpu" and w.device.type == "cpu" and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def gemv(x: torch.Tensor, w: torch.Tensor, norm: torch.Tensor | None = None,
         eps: float = 0.0) -> torch.Tensor:
    """x [M, K] times W [N, K]^T -> [M, N], products and sums in float32 (16-bit results rounded
    to nearest even). With `norm` [K]: RMSNorm(x) (x / sqrt(mean(x^2) + eps) * norm, in float32)
    times W^T, one call instead of two. Where `runs(x, w)` is False: F.linear (after the norm)."""
    if not runs(x, w):
        if norm is not None:
            x32 = x.float()
            x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * norm.float()).to(x.dtype)
        return torch.nn.functional.linear(x, w)
    rows, k = x.shape
    x = x.contiguous()
    out = torch.empty(rows, w.shape[0], dtype=w.dtype)                             # [M, N]
    if norm is not None:
        norm = norm.to(w.dtype).contiguous()
    failed = _library().specflow_gemv(w.data_ptr(), x.data_ptr(), out.data_ptr(), w.shape[0], k,
                                      rows, torch.get_num_threads(), CODES[w.dtype],
                                      None if norm is None else norm.data_ptr(), eps)
    if failed == 1:
        raise MemoryError(f"specflow's native product could not allocate {rows} x {k} floats")
    if failed:
        raise RuntimeError(f"specflow's native product was built without {w.dtype}: rebuild it "
                           f"with a compiler that has it, or set {ENV}=0")
    return out


def _rows_native(x: torch.Tensor) -> bool:
    """x [..., V] is rows the native reductions read: contiguous float32 on a CPU, V > 0."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and x.dim() > 0 and x.shape[-1] > 0 and available(torch.float32))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...] long: torch.argmax(x, -1) (the first index of the largest value, the
    first NaN where there is one), by one native call for a contiguous float32 CPU tensor, whose
    rows torch's argmax reads ~10x slower than their max; torch's argmax elsewhere."""
    if not _rows_native(x):
        return x.argmax(-1)
    out = x.new_empty(x.shape[:-1], dtype=torch.long)                            # [...]
    _library().specflow_argmax(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


def row_max(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...]: torch.amax(x, -1) (NaN where a row has one), by one native call on
    one thread for a contiguous float32 CPU tensor (torch's opens a parallel region per call:
    ~45 us for a row of logits just written, ~20 here); torch's amax elsewhere."""
    if not _rows_native(x):
        return x.amax(-1)
    out = x.new_empty(x.shape[:-1])                                                # [...]
    _library().specflow_row_max(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


class HeldWeight:
    """A weight only the native kernel multiplies (`data` as the kernel reads it; `kind_code`,
    `shape`): GGUF blocks (blocks.py) or bfloat16 weights against float32 inputs
    (bf16_weights.py). The lean forward treats it as its own layout (not a tensor)."""

    is_mkldnn = False
    data: torch.Tensor
    kind_code: int
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] (x's dtype)."""
        return held(self, x)

    def first_rows(self, n: int):
        """The first n rows as this layout holds them, sharing its memory, or None where it
        cannot cut there (a layout's own override; none by default)."""
        return None


def held(w, x: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """x [..., K] times a held weight W [N, K]^T (`w`: GGUF blocks, backends/lean/blocks.py, or
    16- or 32-bit weights read against float32 inputs, bf16_weights.py: its `kind_code`,
    `shape`, `data_ptr()`) -> [..., N] in x's dtype, computed in float32. norm [K] float32:
    RMSNorm(x) x norm first (eps), in the same call."""
    N, K = w.shape
    flat = x.reshape(-1, K)                                                              # [M, K]
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.float().contiguous()
    out = torch.empty(flat.shape[0], N, dtype=torch.float32)                             # [M, N]
    if flat.shape[0]:
        failed = _library().specflow_held(w.data_ptr(), w.kind_code, flat.data_ptr(),
                                          out.data_ptr(), N, K, flat.shape[0],
                                          torch.get_num_threads(),
                                          None if norm is None else norm.data_ptr(), eps)
        if failed:
            raise MemoryError(f"specflow's native product could not allocate its buffers for "
                              f"{flat.shape[0]} rows of {K}")
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


def _register_operator():
    """`gemv` as the torch operator specflow::gemv, for traced graphs (torch.compile): a ctypes
    call is opaque to dynamo, an operator is not; the same computation, so the same bits. None
    where this torch has no `torch.library.custom_op` (before 2.4): traced graphs then take
    F.linear. The schema is spelled out (annotations are strings under `from __future__`)."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None

    def run(x, w, norm=None, eps=0.0):
        return gemv(x, w, norm, eps)

    def shape(x, w, norm=None, eps=0.0):
        return x.new_empty(x.shape[0], w.shape[0])                                  # [M, N]

    try:
        op = custom_op("specflow::gemv", run, mutates_args=(),
                       schema="(Tensor x, Tensor w, Tensor? norm=None, float eps=0.0) -> Tensor")
        op.register_fake(shape)
    except (RuntimeError, TypeError, ValueError):
        return None
    return op


gemv_op = _register_operator()
