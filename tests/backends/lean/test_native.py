"""specflow's native product (backends/lean/native.py, gemv.c): the same product as F.linear, a row's
bits independent of the rows beside it and of the thread count, and absent without a compiler."""
from __future__ import annotations

import pytest
import torch

from specflow.backends.lean import kernels
from specflow.backends.lean import native

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP here")


def skip_unless_native(dtype: torch.dtype) -> None:
    if not native.available(dtype):
        pytest.skip(f"no native {dtype} product here (float16 needs a compiler with _Float16)")


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 18])
@pytest.mark.parametrize("n,k", [(1, 16), (7, 24), (300, 64), (129, 577), (64, 1536), (37, 1601)])
def test_the_native_product_is_f_linear(rows, n, k):
    torch.manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k), torch.randn(rows, k)
    out = native.gemv(x, w)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert torch.allclose(out, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 5, 16, 18])
@pytest.mark.parametrize("n,k", [(7, 24), (129, 577), (64, 1536)])
@pytest.mark.parametrize("dtype,step", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)])
def test_a_16_bit_product_is_the_float32_one_rounded(rows, n, k, dtype, step):
    skip_unless_native(dtype)
    torch.manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k).to(dtype), torch.randn(rows, k).to(dtype)
    out = native.gemv(x, w)
    assert out.shape == (rows, n) and out.dtype == dtype
    exact = torch.nn.functional.linear(x.float(), w.float())        # the same inputs, float32
    # rounded once: within half a step (relative) of the float32 sums
    assert torch.allclose(out.float(), exact, rtol=step, atol=1e-3)
    assert (out.float() == exact.to(dtype).float()).float().mean() > 0.95


@needs_native
def test_bfloat16_rounds_to_nearest_even_and_keeps_nan_and_inf():
    # one-element products: the result is exactly x * w in float32, then rounded
    w = torch.tensor([[1.0], [1.0], [1.0], [1.0], [1.0]]).bfloat16()
    x = torch.tensor([[3.0]]).bfloat16()
    assert native.gemv(x, w).float().tolist() == [[3.0] * 5]
    big = torch.tensor([[float("inf")], [float("nan")], [-2.0], [2 ** -130], [1.0]]).bfloat16()
    out = native.gemv(torch.ones(1, 1, dtype=torch.bfloat16), big).float()[0]
    assert out[0] == float("inf") and torch.isnan(out[1]) and out[2] == -2.0
    assert out[3] == torch.tensor(2 ** -130).bfloat16().float()       # subnormal kept


@needs_native
@pytest.mark.parametrize("dtype", native.DTYPES)
@pytest.mark.parametrize("k", [577, 1601])
def test_a_row_does_not_depend_on_the_rows_beside_it_or_the_threads(dtype, k):
    skip_unless_native(dtype)
    torch.manual_seed(0)
    # 1001 weight rows: blocks of 16 and a partial one; k = 1601: with more rows of x than L1
    # holds, later groups walk the weight in column chunks (768, 768, 64, and one tail column)
    w, x = torch.randn(1001, k).to(dtype), torch.randn(native.MAX_ROWS, k).to(dtype)
    full = native.gemv(x, w)
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 17, 25):  # one group of up to 6 rows, or more
        assert torch.equal(native.gemv(x[:rows], w), full[:rows]), rows
        assert torch.equal(native.gemv(x[rows:rows + 1], w), full[rows:rows + 1]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.gemv(x, w), full)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_inputs_it_does_not_take_go_to_f_linear():
    torch.manual_seed(1)
    w = torch.randn(40, 32)
    strided = torch.randn(32, 3)[:, 0][None].expand(2, 32)           # not contiguous: copied
    assert torch.allclose(native.gemv(strided, w), strided @ w.T, atol=1e-5)
    wide = torch.randn(native.MAX_ROWS + 1, 32)
    assert torch.allclose(native.gemv(wide, w), wide @ w.T, atol=1e-5)
    grad = torch.randn(3, 32, requires_grad=True)
    native.gemv(grad, w).sum().backward()                             # F.linear: differentiable
    assert grad.grad is not None
    mixed = native.gemv(torch.randn(2, 32), w.to(torch.bfloat16).float())
    assert mixed.dtype == torch.float32


def test_without_a_compiler_it_is_not_offered(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native._library.cache_clear()
    try:
        assert not native.available()
        assert kernels.candidates(kernels.ONE_ROW, torch.float32, 1) == ("linear", "weight_left_padded")
        w, x = torch.randn(8, 16), torch.randn(1, 16)
        assert torch.allclose(kernels.native_gemv(x, w), x @ w.T)
    finally:
        native._library.cache_clear()


def test_switched_off_it_is_not_offered(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    native._library.cache_clear()
    try:
        assert not native.available()
    finally:
        native._library.cache_clear()


@needs_native
def test_it_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path))
    native._library.cache_clear()
    try:
        assert native.available()
        built = list((tmp_path / "kernels").glob("gemv-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        native._library.cache_clear()
        assert native.available() and built[0].stat().st_mtime_ns == stamp     # not rebuilt
        assert not any(p.is_dir() for p in (tmp_path / "kernels").iterdir())   # no temp left
    finally:
        native._library.cache_clear()


@needs_native
def test_a_parameter_without_autograd_takes_the_native_product(monkeypatch):
    # a model's weights are Parameters (requires_grad); a decoding pass runs in inference mode
    w = torch.nn.Parameter(torch.randn(24, 32))
    x = torch.randn(1, 32)
    monkeypatch.setattr(native.torch.nn.functional, "linear", None)     # any fallback fails
    with torch.inference_mode():
        assert torch.allclose(native.gemv(x, w), x @ w.detach().T, atol=1e-5)


@needs_native
def test_a_traced_graph_calls_it_as_an_operator_with_the_same_bits():
    torch.manual_seed(2)
    w, x = torch.randn(100, 48), torch.randn(3, 48)
    compiled = torch.compile(kernels.native_gemv, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        assert torch.equal(compiled(x, w), native.gemv(x, w))


@needs_native
@pytest.mark.parametrize("dtype", native.DTYPES)
def test_the_normed_product_is_rms_norm_then_the_product(dtype):
    skip_unless_native(dtype)
    torch.manual_seed(4)
    w, x, g = torch.randn(70, 577).to(dtype), torch.randn(5, 577).to(dtype), torch.rand(577).to(dtype)
    normed = torch.nn.functional.rms_norm(x.float(), (577,), g.float(), 1e-5)
    want = torch.nn.functional.linear(normed, w.float())
    got = native.gemv(x, w, g, 1e-5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.float(), want, rtol=tol, atol=tol)
    for rows in (1, 3):                                  # a row's bits: alone or among others
        assert torch.equal(native.gemv(x[:rows], w, g, 1e-5), got[:rows])
    # where it does not run (autograd records), the same through torch
    xg = x.float().requires_grad_()
    assert torch.allclose(native.gemv(xg, w.float(), g.float(), 1e-5), want, rtol=1e-4, atol=1e-4)


@needs_native
def test_the_lean_forward_norms_inside_the_native_product(monkeypatch):
    # a one-row pass with the native form calls rms_norm only where a state is captured
    from specflow.backends.lean.kernels import Kernels
    from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig

    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target")), torch.device("cpu"), slots=1)
    lean = backend.lean
    ids = torch.randint(1, 8000, (1, 6))
    backend.reset(0)
    backend.forward(torch.tensor([0]), ids[:, :5], torch.tensor([5]))
    reference = backend.forward(torch.tensor([0]), ids[:, 5:], torch.tensor([1]))[0]
    lean.kernels = Kernels("native", "native", "linear")
    lean.mm = lean.kernels.matmul
    lean.native_layers = False            # the eager layers (a whole native pass has no _rms)
    calls = []
    monkeypatch.setattr(lean, "_rms", lambda x, w: calls.append(1) or x)
    backend.truncate(torch.tensor([0]), [5])
    fused = backend.forward(torch.tensor([0]), ids[:, 5:], torch.tensor([1]))[0]
    assert calls == []
    assert torch.allclose(fused, reference, atol=1e-4)


def test_without_torch_operators_a_traced_graph_takes_torch_products(monkeypatch):
    # torch before 2.4 has no torch.library.custom_op: no operator, and tracing still works
    with monkeypatch.context() as m:        # only here: torch.compile itself registers operators
        m.setattr(native.torch.library, "custom_op", None, raising=False)
        assert native._register_operator() is None
    monkeypatch.setattr(native, "gemv_op", None)
    torch.manual_seed(3)
    w, x = torch.randn(20, 16), torch.randn(2, 16)
    compiled = torch.compile(kernels.native_gemv, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        assert torch.allclose(compiled(x, w), x @ w.T, atol=1e-5)
    assert kernels.Kernels("native", "native").normed_matmul(x, torch.ones(16), 1e-5, w) is not None


def _argmax_cases():
    """Rows torch.argmax has rules for: ties (the first), NaN (the first NaN), all -inf (0),
    +inf, signed zeros, widths that are not a multiple of the kernel's 8 or 32."""
    g = torch.Generator().manual_seed(7)
    for V in (1, 5, 8, 31, 32, 33, 100, 8192, 49152 + 3):
        x = torch.randn(3, V, generator=g)
        yield f"random {V}", x
        tied = x.clone()
        tied[:, ::3] = x.amax(-1, keepdim=True)
        yield f"ties {V}", tied
        nan = x.clone()
        nan[torch.rand(3, V, generator=g) < 0.05] = float("nan")
        nan[0, V - 1] = float("nan")                       # at least one, maybe only at the end
        yield f"nan {V}", nan
        yield f"-inf {V}", torch.full((2, V), float("-inf"))
        inf = x.clone()
        inf[:, V // 2] = float("inf")
        yield f"+inf {V}", inf
        zeros = torch.zeros(2, V)
        zeros[:, : V // 2] = -0.0
        yield f"signed zeros {V}", zeros
        yield f"rounded {V}", (x * 2).round()


@needs_native
def test_the_native_argmax_is_torch_argmax():
    for name, x in _argmax_cases():
        assert torch.equal(native.argmax(x), x.argmax(-1)), name
        three = x[None].expand(2, *x.shape).contiguous()                    # [2, R, V]
        assert torch.equal(native.argmax(three), three.argmax(-1)), name


def test_the_native_reductions_hand_other_inputs_to_torch(monkeypatch):
    called = []
    monkeypatch.setattr(native, "_library", lambda: called.append(1))       # must not be asked
    x = torch.randn(4, 50)
    for other in (x.double(), x.t(), x.half()):
        assert torch.equal(native.argmax(other), other.argmax(-1))
        assert torch.equal(native.row_max(other), other.amax(-1))
    assert not called


@needs_native
def test_the_native_row_max_is_torch_amax():
    for name, x in _argmax_cases():
        got, want = native.row_max(x), x.amax(-1)
        assert torch.equal(got.isnan(), want.isnan()), name
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), name
