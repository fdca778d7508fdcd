"""Matrix products for the shapes decoding has (a few rows, wide weights), picked by measurement.

A decoding pass multiplies 1 to ~16 rows by every weight matrix once, so it should cost about the
time to read the weights. How close a library gets depends on the form of the call, the dtype and
the machine: on a 2-core AMD EPYC with MKL (fp32), `F.linear(x, W)` of 1-9 rows reads the weights
at 10-12 GB/s while `(W @ x.T).T` of 2-9 rows reaches ~30 GB/s, and one row is fastest padded to
two; in bf16 `F.linear` is the faster form. So the form is not fixed: `pick()` times each candidate
on the model's own weights (all of them, so the reads stream from memory as in a real pass) for
one row, a few rows and a batch's worth, once per model load, and the lean forward calls the
winners.

Every form computes the same products from the same weights, in place (no prepared copies): they
differ only in float rounding (fp32: ~1e-6 relative), like any change of BLAS kernel.
On CUDA, cuBLAS handles these shapes well and `F.linear` is used without measuring.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # x [M, K], W [N, K] -> [M, N]

SMALL_ROWS = 16          # 2..SMALL_ROWS rows: a decoding step of a few rows (or k+1 positions)
BATCH_ROWS = 128         # SMALL_ROWS+1..BATCH_ROWS: a batch's decoding step; above: prefill


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def weight_left(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(W @ x.T).T: the weight as the left operand, streamed once for all rows. The result is
    made row-major again (a few rows: cheap), since later ops and products are slower on the
    transposed layout."""
    return (w @ x.T).T.contiguous()


def weight_left_padded(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """weight_left for one row, padded to two (MKL's one-column product is the slow path)."""
    if x.shape[0] != 1:
        return weight_left(x, w)
    return (w @ torch.cat([x, x]).T)[:, :1].T.contiguous()


FORMS: dict[str, Matmul] = {"linear": linear, "weight_left": weight_left,
                            "weight_left_padded": weight_left_padded}
ONE_ROW = ("linear", "weight_left_padded")
FEW_ROWS = ("linear", "weight_left")


@dataclass(frozen=True)
class Kernels:
    """The forms a model's products use: for 1 row, 2..SMALL_ROWS rows, up to BATCH_ROWS rows
    (prefill-sized products always take F.linear)."""

    one_row: str = "linear"
    few_rows: str = "linear"
    many_rows: str = "linear"
    timings_ms: tuple[tuple[str, int, float], ...] = ()     # (form, rows, ms over all weights)

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., K] times W [N, K]^T -> [..., N]."""
        rows = x.numel() // x.shape[-1]
        if rows > BATCH_ROWS:
            return F.linear(x, w)
        name = self.one_row if rows == 1 else self.few_rows if rows <= SMALL_ROWS else self.many_rows
        if name == "linear":
            return F.linear(x, w)
        return FORMS[name](x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])

    def describe(self) -> str:
        return (f"1 row: {self.one_row}, 2-{SMALL_ROWS} rows: {self.few_rows}, "
                f"{SMALL_ROWS + 1}-{BATCH_ROWS} rows: {self.many_rows}")


_PICKED: dict[tuple, Kernels] = {}


def pick(weights: list[torch.Tensor], repeats: int = 3, budget_s: float = 2.0) -> Kernels:
    """Time each candidate form over all `weights` for 1 row, 2 and 8 rows, and 32 rows; keep the
    fastest of each.

    Cached per (device, dtype, threads, shapes), so a second backend of the same model measures
    nothing. CUDA (and any non-CPU device) takes F.linear without measuring.
    """
    w0 = weights[0]
    if w0.device.type != "cpu":
        return Kernels()
    key = (str(w0.device), w0.dtype, torch.get_num_threads(),
           tuple(tuple(w.shape) for w in weights))
    if key in _PICKED:
        return _PICKED[key]
    timings = []
    deadline = time.perf_counter() + budget_s

    def cost(form: str, rows: int) -> float:
        fn = FORMS[form]
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
        best = float("inf")
        with torch.inference_mode():
            for w in weights:                     # warm-up: first calls pick and allocate
                fn(xs[w.shape[1]], w)
            for _ in range(repeats):
                start = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                best = min(best, time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
        timings.append((form, rows, round(best * 1e3, 3)))
        return best

    one = min(ONE_ROW, key=lambda f: cost(f, 1))
    few = min(FEW_ROWS, key=lambda f: cost(f, 2) + cost(f, 8))
    many = min(FEW_ROWS, key=lambda f: cost(f, 32))
    picked = Kernels(one, few, many, tuple(timings))
    _PICKED[key] = picked
    return picked
