"""A prototype's measurement, not part of specflow: two hand-written int4 products over
GGUF-style Q4 blocks (q4_product.c) against ATen's `_weight_int4pack_mm_for_cpu` (what
`dtype=int4` runs), on SmolLM2's product shapes at 1, 2, 5 and 8 rows. Needs a CPU with
AVX-512 VNNI and gcc. Run: python bench/prototypes/q4_product.py (2 threads: OMP_NUM_THREADS=2).
Findings are in docs/decisions.md ("An int4 product of our own")."""
from __future__ import annotations

import ctypes
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from specflow.backends.lean.quantized import quantize_weight  # noqa: E402

P, I64 = ctypes.c_void_p, ctypes.c_int64


def build() -> ctypes.CDLL:
    out = pathlib.Path(tempfile.mkdtemp()) / "libq4_product.so"
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                    str(HERE / "q4_product.c"), "-o", str(out)], check=True)
    return ctypes.CDLL(str(out))


def median_ms(f, reps: int = 30) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def one_shape(lib: ctypes.CDLL, N: int, K: int) -> None:
    G = K // 32
    q = torch.randint(0, 16, (N, G, 32), dtype=torch.uint8)
    d = torch.rand(N, G) * 0.01
    m = -8 * d
    w = (q.float() * d[..., None] + m[..., None]).reshape(N, K)                      # [N, K]
    qs = (q[..., :16] | (q[..., 16:] << 4)).contiguous()                             # [N, G, 16]
    aten = quantize_weight(w, 4, 32)
    for M in (1, 2, 5, 8):
        one_size(lib, N, K, M, qs, d, m, w, aten)


def one_size(lib, N, K, M, qs, d, m, w, aten) -> None:
    G = K // 32
    x, y, y2 = torch.randn(M, K), torch.empty(M, N), torch.empty(M, N)
    xq = torch.empty(M, K, dtype=torch.int8)
    sx, xs = torch.empty(M, G), torch.empty(M, G)

    def decode():
        lib.q4_gemm(P(qs.data_ptr()), P(d.data_ptr()), P(m.data_ptr()), P(x.data_ptr()),
                    P(y.data_ptr()), I64(N), I64(K), I64(M))

    def vnni():
        lib.q4_quantize_x(P(x.data_ptr()), P(xq.data_ptr()), P(sx.data_ptr()),
                          P(xs.data_ptr()), I64(K), I64(M))
        lib.q4_gemm_vnni(P(qs.data_ptr()), P(d.data_ptr()), P(m.data_ptr()), P(xq.data_ptr()),
                         P(sx.data_ptr()), P(xs.data_ptr()), P(y2.data_ptr()), I64(N), I64(K),
                         I64(M))

    decode()
    vnni()
    ref = x @ w.T
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4)
    rel = ((y2 - ref).norm() / ref.norm()).item()
    xb = x.bfloat16()
    print(f"| {N} x {K} | {M} | {median_ms(decode):.3f} | {median_ms(vnni):.3f} | "
          f"{median_ms(lambda: aten.matmul(xb)):.3f} | {rel:.1e} |")


def main() -> None:
    lib = build()
    torch.manual_seed(0)
    print("| N x K | rows | float decode ms | VNNI ms | ATen int4 ms | VNNI rel. error |")
    print("|---|---:|---:|---:|---:|---:|")
    for N, K in [(576, 576), (1536, 576), (576, 1536), (49152, 576)]:
        one_shape(lib, N, K)


if __name__ == "__main__":
    main()
