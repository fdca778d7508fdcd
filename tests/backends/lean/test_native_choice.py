"""`native`: whether passes run through the decoder layers as one native call. auto follows the
product pick where the native product won it, and otherwise times whole passes at the pipeline's
two ends, the native pass and the eager layers in turns; true and false are applied; other values
are refused. A pass runs natively with native=true even where a library form won the products."""
from __future__ import annotations

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.backends.lean import native
from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean.kernels import Kernels
from specflow.backends.choice import decide
from specflow.backends.lean.native_choice import plan
from specflow.backends.lean.native_pass import NativePass

# what the choices at build time measure is replaced here: nothing is read back or kept
pytestmark = [pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP here"),
              pytest.mark.times_choices]

DEMO = ["model=demo", "threads=2", "max_new_tokens=6", "show_progress=false", "max_batch_size=1",
        "pack=false"]


def choose_native(setting, backend, positions: int, rows: int = 1):
    """`native` planned and decided for `backend`, as HFBackend.tune does."""
    return decide(plan(backend, setting, positions, rows))


def demo_backend(one_row: str = "weight_left_padded", few_rows: str = "weight_left") -> HFBackend:
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target")), torch.device("cpu"), 2)
    backend.lean.kernels = Kernels(one_row, few_rows, "linear")
    backend.lean.mm = backend.lean.kernels.matmul
    return backend


def passes_natively(backend, positions: int) -> bool:
    called = []
    real = NativePass.__call__

    def spy(pass_, *args, **kwargs):
        out = real(pass_, *args, **kwargs)
        called.append(out is not None)
        return out

    NativePass.__call__ = spy
    try:
        backend.time_pass(rows=1, positions=positions, reps=1)
    finally:
        NativePass.__call__ = real
    return any(called)


def test_a_library_product_pick_no_longer_leaves_the_pass_eager_with_native_true():
    backend = demo_backend()
    assert not passes_natively(backend, 1)                # None: the product pick decides
    assert choose_native(True, backend, positions=5) is True
    assert passes_natively(backend, 1) and passes_natively(backend, 5)
    assert backend.lean.native_pass_rows() == f"1-{native.MAX_ROWS} queries"
    assert choose_native(False, backend, positions=5) is False
    assert not passes_natively(backend, 1) and backend.lean.native_pass_rows() is None


@pytest.mark.parametrize("native_faster", [True, False])
def test_auto_times_whole_passes_at_both_ends_in_turns(monkeypatch, native_faster):
    backend = demo_backend()
    timed = []

    def fake(self, rows=1, positions=1, reps=5, context=32):
        timed.append((self.lean.native_layers, positions, rows))
        fast = self.lean.native_layers is native_faster
        return (0.020 if fast else 0.030) * (1 + positions * rows / 10)

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    assert choose_native("auto", backend, positions=5, rows=4) is native_faster
    assert backend.lean.native_layers is native_faster
    assert {(p, r) for _, p, r in timed} == {(1, 1), (5, 4)}            # the two ends
    ways = [on for on, _, _ in timed]
    assert ways[:6] == [True, True, False, False, False, False] and len(ways) == 12   # turns


def test_auto_times_nothing_where_the_native_product_won_the_pick(monkeypatch):
    backend = demo_backend("native", "native")
    monkeypatch.setattr(HFBackend, "time_pass", lambda *a, **k: pytest.fail("timed"))
    assert choose_native("auto", backend, positions=5) is None
    monkeypatch.undo()
    assert backend.lean.native_layers is None and passes_natively(backend, 1)


def test_a_pipeline_applies_native_and_refuses_other_values():
    pipe = Pipeline.from_config(DEMO + ["native=false"])
    assert pipe.target.lean.native_layers is False
    pipe = Pipeline.from_config(DEMO + ["native=true"])
    assert pipe.target.lean.native_layers is True
    with pytest.raises(ConfigError, match="native='sometimes'; use auto"):
        Pipeline.from_config(DEMO + ["native=sometimes"])
