"""Matrix products for the shapes decoding has (a few rows, wide weights), picked by measurement.

A decoding pass multiplies 1 to ~128 rows by every weight matrix once, so it should cost about the
time to read the weights. How close a library gets depends on the form of the call, the weight
layout, the dtype and the machine:

- MKL's `F.linear(x, W)` reads the weights well below the memory's bandwidth for a few rows where
  its AVX-512 paths are not taken (AMD CPUs); `(W @ x.T).T` reads them several times faster for
  one or two rows (one row padded to two) but turns compute-bound at a few more.
- oneDNN with the weight *packed* once into its blocked layout (`packed`: the kernels inductor uses
  for frozen CPU linears) streams well from a few rows up, and gives every row the same bits
  whatever the number of rows beside it.

- specflow's own product (`native`, `specflow.backends.lean.native`: a short C loop compiled for the CPU
  on first use) reads each thread's block of weight rows as one stream and reaches the memory's
  bandwidth for 1-4 rows where the libraries do not; float32, bfloat16 and float16, only where
  a C compiler is found; compute-bound from ~8 rows, where oneDNN's packed layout and MKL are
  about as fast (`pick()` measures how far it serves: 32, 64 or 128 rows).

So neither the form nor the layout is fixed: `pick()` times the dense forms on the model's own
weights (all of them, so the reads stream from memory as in a real pass) for one row, a few rows
and a batch's worth, once per model load, and the lean forward calls the winners. Whether to pack
is a trade (one-row passes get slower: each oneDNN call has more fixed cost than MKL's, and it
streams one row slower; passes of 4+ rows get much faster), decided on whole passes by
`specflow.backends.lean.packing`. A packed weight *replaces* the dense one (the lean forward frees it),
so packing costs no memory (but for a head tied to the embedding table, packed as a copy).

Every form computes the same products from the same weights: they differ only in float rounding
(fp32: ~1e-6 relative), like any change of BLAS kernel. On CUDA, cuBLAS handles these shapes well
and `F.linear` is used without measuring.

The read bandwidths of each form on the machines this was built on: docs/decisions.md, "Measured
on this project's machines".
"""
from __future__ import annotations

import collections
import functools
import json
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from specflow.backends import choice_cache
from specflow.backends.choice import Choice, Clock, fastest, first_of_lasting_wins, times
from specflow.backends.lean import native

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # x [M, K], W [N, K] -> [M, N]

SMALL_ROWS = 32          # 2..SMALL_ROWS rows: a decoding step of a few rows, k+1 positions or a
                         # token tree of up to 31 drafts (the native product may serve more:
                         # Kernels.few_upto, measured)
BATCH_ROWS = 128         # up to BATCH_ROWS: a batch's decoding step; above: prefill
WIDER = (64, 128)        # the row counts at which pick() times the native product further
PACK_HINT = 16           # the row count oneDNN's packed layout is tuned for (1-33 rows measured)
PACK_MIN_ROWS = 4        # packed products of fewer rows are padded to this many


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


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor; `.to_dense()` gives W back)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_HINT)


def packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] times a packed W [N, K]^T -> [..., N] through oneDNN. Fewer than PACK_MIN_ROWS
    rows are padded to it: oneDNN streams the weights faster for a few rows than for one or two
    (docs/decisions.md), and each row's result does not depend on the rows beside it."""
    rows = x.numel() // x.shape[-1]
    if rows >= PACK_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])                                          # [r, K]
    padded = torch.cat([flat, flat.new_zeros(PACK_MIN_ROWS - rows, x.shape[-1])])  # [4, K]
    out = torch.ops.mkldnn._linear_pointwise(padded, w, None, "none", [], "")    # [4, N]
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def native_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """specflow's own product (`specflow.backends.lean.native`): one stream of the weight per thread;
    F.linear where it cannot run (no C compiler, more than native.MAX_ROWS rows). Inside a traced
    graph (torch.compile) it is called as the operator `specflow::gemv`: the same bits."""
    if torch.compiler.is_compiling():
        return F.linear(x, w) if native.gemv_op is None else native.gemv_op(x, w)
    return native.gemv(x, w)


FORMS: dict[str, Matmul] = {"linear": linear, "weight_left": weight_left,
                            "weight_left_padded": weight_left_padded, "native": native_gemv}
ONE_ROW = ("linear", "weight_left_padded", "native")
FEW_ROWS = ("linear", "weight_left", "native")
LIBRARY = ("linear", "weight_left")


def candidates(forms: tuple[str, ...], dtype: torch.dtype, rows: int) -> tuple[str, ...]:
    """The forms worth timing for `rows` rows of `dtype`: the native product only where it runs."""
    return tuple(f for f in forms if f != "native" or (native.available(dtype)
                                                        and rows <= native.MAX_ROWS))


@functools.cache
def can_pack(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear runs in this torch build for `dtype` (x86 and aarch64 wheels ship
    it; a build without mkldnn does not)."""
    try:
        w = torch.randn(8, 4).to(dtype)
        return torch.allclose(packed(torch.ones(2, 4, dtype=dtype), pack(w)).float(),
                              F.linear(torch.ones(2, 4), w.float()), atol=1e-2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@dataclass(frozen=True)
class Kernels:
    """The forms a model's dense products use: for 1 row, 2..few_upto rows, up to BATCH_ROWS
    rows, and more (prefill-sized products: F.linear, or `wide`); `pack` says the lean forward
    packs its weights for oneDNN, and a packed weight always takes oneDNN."""

    one_row: str = "linear"
    few_rows: str = "linear"
    many_rows: str = "linear"
    pack: bool = False
    timings_ms: tuple[tuple[str, int, float], ...] = ()     # (form, rows, ms over all weights)
    few_upto: int = native.MAX_ROWS     # pick(): SMALL_ROWS, or as far as the native form wins
    # past BATCH_ROWS rows (prefill, an EAGLE head's catch-up): "linear", or "native" in chunks
    # of native.MAX_ROWS rows where it beat F.linear at MAX_ROWS in a 16-bit dtype (torch's CPU
    # float16 products without AVX512-FP16 ran 2.7x slower than the native one at 128 rows)
    wide: str = "linear"

    def form(self, rows: int) -> str:
        """The dense form picked for a product of `rows` rows (up to BATCH_ROWS)."""
        return self.one_row if rows == 1 else self.few_rows if rows <= self.few_upto \
            else self.many_rows

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., K] times W [N, K]^T -> [..., N] (W dense, packed, or an int8/int4
        QuantizedWeight, which multiplies itself: backends/lean/quantized.py)."""
        if not isinstance(w, torch.Tensor):
            return w.matmul(x)
        if w.is_mkldnn:
            return packed(x, w)
        rows = x.numel() // x.shape[-1]
        if rows > BATCH_ROWS:
            flat = x.reshape(rows, x.shape[-1])                                         # [M, K]
            if self.wide != "native" or not native.runs(flat[:native.MAX_ROWS], w):
                return F.linear(x, w)
            out = torch.cat([native.gemv(flat[i:i + native.MAX_ROWS], w)                # [M, N]
                             for i in range(0, rows, native.MAX_ROWS)])
            return out.reshape(*x.shape[:-1], w.shape[0])
        name = self.form(rows)
        if name == "linear":
            return F.linear(x, w)
        return FORMS[name](x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])

    def normed_matmul(self, x: torch.Tensor, norm: torch.Tensor, eps: float,
                      w: torch.Tensor) -> torch.Tensor | None:
        """RMSNorm(x) * norm times W [N, K]^T -> [..., N] in one call, where the product for x's
        rows is the native one (which norms the rows as it reads them), a held weight's among
        them (float32 x on a CPU: the norm as the native pass's LM head takes it); None
        elsewhere: the caller norms, then multiplies."""
        rows = x.numel() // x.shape[-1]
        if isinstance(w, native.HeldWeight):    # its own product, normed in the same call
            if x.device.type != "cpu" or self.fused_kind(w, norm, rows, x.dtype) is None:
                return None
            return native.held(w, x, norm.contiguous(), eps)
        if not isinstance(w, torch.Tensor) or w.is_mkldnn or self.form(rows) != "native":
            return None
        flat = x.reshape(rows, x.shape[-1])                                             # [M, K]
        if torch.compiler.is_compiling():
            if native.gemv_op is None:
                return None
            out = native.gemv_op(flat, w, norm, eps)
        elif native.runs(flat, w):
            out = native.gemv(flat, w, norm, eps)
        else:
            return None                        # the caller's own norm (LeanLlama._rms), then F.linear
        return out.reshape(*x.shape[:-1], w.shape[0])

    def fused_kind(self, w, norm: torch.Tensor, rows: int,
                   dtype: torch.dtype = torch.float32) -> int | None:
        """The kind (gemv.c's product()) by which normed_matmul multiplies `rows` CPU rows of
        `dtype` by w natively, norming them in the same call: a held weight's own kind, 0 for
        a dense float32 w where the native form serves those rows; None elsewhere. The native
        pass's LM head (specflow_layers_head) asks here too, so both compute the same bits."""
        if dtype != torch.float32 or norm.dtype != torch.float32 or norm.device.type != "cpu" \
                or torch.compiler.is_compiling():
            return None
        from specflow.backends.lean.native_chain import head_kind    # the layouts it reads

        kind = head_kind(w)
        # a dense float32 w goes the native way only where the pick chose it for these rows
        return kind if kind != 0 or self.form(rows) == "native" else None

    def describe(self) -> str:
        dense = f"1 row: {self.one_row}, 2-{self.few_upto} rows: {self.few_rows}"
        if self.few_upto < BATCH_ROWS:
            dense += f", {self.few_upto + 1}-{BATCH_ROWS} rows: {self.many_rows}"
        if self.wide != "linear":
            dense += f", more: {self.wide} in chunks of {native.MAX_ROWS}"
        return f"packed (oneDNN) weights; dense ones {dense}" if self.pack else dense


_PICKED: dict[str, Kernels] = {}


def forget_picks() -> None:
    """Forget this process's memo of picked product forms and one-query attention lengths, as
    a new process starts (the times kept on disk stay: backends/choice_cache.py)."""
    _PICKED.clear()
    _GROUPED_FROM.clear()


def pick(weights: list[torch.Tensor], repeats: int = 3, budget_s: float = 2.0,
         clock: Clock = time.perf_counter) -> Kernels:
    """Time each dense form over all `weights` for 1 row, 2 and 8 rows, and 32 rows; keep the
    fastest of each. Where the native form won 2-8 rows it serves up to SMALL_ROWS, and further
    (64, then 128 rows) while it beats the 32-row winner there: on a 2-core EPYC it does (its
    blocked walks against MKL's AVX2 paths), on a CPU whose BLAS has faster paths it may not.
    (Whether to pack is decided on whole passes: `specflow.backends.lean.packing`.)

    The forms competing for a row count are timed in turns, `repeats` rounds (at least two past
    the `budget_s` budget), and each keeps its least time (backends/turns.py: on a shared machine
    a form timed in a block of its own could lose to a burst of a neighbour's load).

    Cached per (device, dtype, threads, shapes), so a second backend of the same model measures
    nothing, and the times on disk per machine (backends/choice_cache.py), so a second run does
    not either. CUDA (and any non-CPU device) takes F.linear without measuring. Each competition
    is a Choice (backends/choice.py) read from `clock`.
    """
    w0 = weights[0]
    if w0.device.type != "cpu":
        return Kernels()
    shapes = collections.Counter(tuple(w.shape) for w in weights)
    kept = {"dtype": str(w0.dtype), "threads": torch.get_num_threads(),     # choice_cache's key
            "native": native.available(w0.dtype), "repeats": repeats,
            "weights": sorted([*shape, n] for shape, n in shapes.items())}
    key = json.dumps(kept, sort_keys=True)                 # and this process's memo's
    if key in _PICKED:
        choice_cache.note("kernels.pick", "cache")          # timed earlier in this process
        return _PICKED[key]
    timings = []
    deadline = clock() + budget_s

    def once(form: str, x: dict[int, torch.Tensor]) -> float:
        """Seconds of one product of each weight by x[K]."""
        fn = FORMS[form]
        start = clock()
        for w in weights:
            fn(x[w.shape[1]], w)
        return clock() - start

    def winner(forms: tuple[str, ...], rows: tuple[int, ...]) -> str:
        """The form of least summed time over `rows`, the forms timed in turns."""
        xs = [{w.shape[1]: torch.randn(r, w.shape[1], dtype=w.dtype) for w in weights}
              for r in rows]
        choice = Choice("kernels.pick", forms, lambda f, _clock: [once(f, x) for x in xs],
                        fastest, key={**kept, "forms": forms, "rows": rows}, rounds=repeats,
                        budget_s=max(0.0, deadline - clock()),
                        warm_up=True)           # first calls pick and allocate
        with torch.inference_mode():
            best = times(choice, clock)
        for form, got in best.items():
            timings.extend((form, r, round(t * 1e3, 3)) for r, t in zip(rows, got))
        return fastest(best)

    dtype = w0.dtype
    one = winner(candidates(ONE_ROW, dtype, 1), (1,))
    few = winner(candidates(FEW_ROWS, dtype, SMALL_ROWS), (2, 8))
    many = winner(LIBRARY, (32,))                         # torch's, past the native form
    upto = SMALL_ROWS
    if few == "native":
        for rows in WIDER:
            if rows > native.MAX_ROWS or winner(("native", many), (rows,)) != "native":
                break
            upto = rows
    # a 16-bit product the native form beat F.linear at MAX_ROWS rows: past BATCH_ROWS too, in
    # chunks (each row's result the same whatever the chunk; float32 keeps MKL, whose big
    # products block better than the native walks)
    wide = "native" if dtype != torch.float32 and upto == native.MAX_ROWS == WIDER[-1] \
        else "linear"
    picked = Kernels(one, few, many, False, tuple(timings), upto, wide)
    _PICKED[key] = picked
    return picked


# --- attention of one query per row --------------------------------------------------------------

def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query per row as two batched products, each key/value head's query
    heads grouped into one product (no copies of the keys): q [B, H, 1, D], k/v [B, Hkv, L, D]
    (H a multiple of Hkv; query head h reads key head h // (H / Hkv), as `enable_gqa`), mask
    [B, 1, 1, L] bool (True: attend) or additive, or None -> [B, H, 1, D]. Scores and softmax in
    float32; the same result as scaled_dot_product_attention up to rounding."""
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    scores = torch.matmul(q.reshape(B, Hkv, H // Hkv, D), k.transpose(-1, -2)).float()  # [B, Hkv, G, L]
    scores.mul_(D ** -0.5)
    if mask is not None:                                 # [B, 1, 1, L]: over every head and group
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    weights = torch.softmax(scores, -1).to(v.dtype)                                 # [B, Hkv, G, L]
    return torch.matmul(weights, v).view(B, H, 1, D)


ATTENTION_LENGTHS = (128, 256, 1024)  # cached lengths at which the two attention forms are timed
ROUNDS = 3                            # in turns (backends/turns.py), reps // ROUNDS calls each
_GROUPED_FROM: dict[tuple, int | None] = {}


def pick_one_query_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                             device: torch.device, reps: int = 15,
                             clock: Clock = time.perf_counter) -> int | None:
    """The number of keys (rows x cached length) from which a one-query pass attends with
    `grouped_attention` instead of scaled_dot_product_attention, or None (never): timed for one
    row at ATTENTION_LENGTHS, and chosen from the shortest length at which grouped wins there
    and at every longer one.

    On CPUs, torch's fused attention for float16/bfloat16 costs about the same per key in every
    row, where the grouped products cost little more for more rows or keys: on a 2-core AMD
    EPYC, bfloat16, 9 query and 3 key heads of 64, fused against grouped: 149 against 176 us for
    one row of 128 keys, 209 against 87 at 256, 1010 against 214 at 1000; 146 against 118 for 2
    rows of 64, 2608 against 296 for 16 rows of 256 (float16 alike, about half the gap; in
    float32 the fused kernel wins). So the rows x length at which one row turns over is the
    threshold. The two forms are timed in turns (backends/turns.py). Cached per (shape, dtype,
    threads), the times on disk too (backends/choice_cache.py); a GPU and float32 keep the fused
    kernel, unmeasured."""
    if device.type != "cpu" or dtype == torch.float32:
        return None
    key = (heads, kv_heads, head_dim, dtype, torch.get_num_threads())
    if key in _GROUPED_FROM:
        choice_cache.note("kernels.attention", "cache")
        return _GROUPED_FROM[key]
    gqa = {"enable_gqa": True} if kv_heads != heads else {}

    def fused(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **gqa)

    def grouped(q, k, v):
        return grouped_attention(q, k, v, None)

    forms = {"fused": fused, "grouped": grouped}
    wins = []
    with torch.inference_mode():
        for length in ATTENTION_LENGTHS:
            args = (torch.randn(1, heads, 1, head_dim, dtype=dtype),
                    *(torch.randn(1, kv_heads, length, head_dim, dtype=dtype) for _ in range(2)))
            choice = Choice(
                "kernels.attention", tuple(forms),
                lambda form, clk, a=args: [_median_seconds(forms[form], a, reps // ROUNDS, clk)],
                fastest, rounds=ROUNDS, warm_up=True,
                key={"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                     "dtype": str(dtype), "threads": torch.get_num_threads(), "length": length,
                     "reps": reps, "gqa": bool(gqa)})
            best = times(choice, clock)
            wins.append(best["grouped"][0] < best["fused"][0])
    start = first_of_lasting_wins(wins)
    _GROUPED_FROM[key] = None if start is None else ATTENTION_LENGTHS[start]
    return _GROUPED_FROM[key]


def _median_seconds(fn, args: tuple, reps: int, clock: Clock = time.perf_counter) -> float:
    runs = []
    for _ in range(reps):
        start = clock()
        fn(*args)
        runs.append(clock() - start)
    return sorted(runs)[reps // 2]
