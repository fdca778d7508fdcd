"""`dtype=bfloat16` on a CPU where specflow's native kernel builds (backends/lean/bf16_weights.py):
bfloat16 weights multiplied by the CPU's bfloat16 products where it has them (AVX512-BF16:
the inputs rounded to bfloat16, float32 sums; Bf16Tiles), or read against float32 inputs
(`activations=float32`, or a CPU without them: float32 arithmetic; Bf16Weight). Either way a
row's bits do not depend on the rows beside it, the whole pass runs as the native call, and
speculation over it is exact: greedy speculative output equals greedy plain output."""
from __future__ import annotations

import math

import pytest
import torch

from specflow import Pipeline
from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean import blocks
from specflow.backends.lean.bf16_weights import Bf16Tiles, Bf16Weight, hardware_dot, hold_bf16

pytestmark = pytest.mark.skipif(not blocks.available(),
                                reason="no C compiler: specflow's native kernel is not built")


def test_the_product_reads_bfloat16_weights_against_float32_inputs():
    torch.manual_seed(0)
    w, x = torch.randn(50, 72), torch.randn(7, 72)
    held = Bf16Weight(w)
    assert held.nbytes() == 50 * 72 * 2 and held.dequantize().dtype == torch.float32
    want = x.double() @ w.bfloat16().double().T
    got = held.matmul(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for rows in (1, 3, 6):
        assert torch.equal(held.matmul(x[:rows]), got[:rows])


needs_dot = pytest.mark.skipif(not blocks.available() or not hardware_dot(),
                               reason="this CPU has no bfloat16 products (AVX512-BF16)")


@needs_dot
@pytest.mark.parametrize("N, K", [(50, 64), (7, 32), (960, 576)])
def test_the_cpus_bfloat16_products_round_the_inputs_and_sum_in_float32(N, K):
    torch.manual_seed(0)
    w, x = torch.randn(N, K), torch.randn(11, K)
    held = Bf16Tiles(w)
    assert held.nbytes() == N * K * 2 and torch.equal(held.dequantize(), w.bfloat16().float())
    want = x.bfloat16().double() @ w.bfloat16().double().T
    got = held.matmul(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)
    # not the widening product's float32 arithmetic
    assert not torch.equal(got, Bf16Weight(w).matmul(x))
    # a row's bits whatever rows are beside it (walks of 1-8 rows) and however many threads
    for rows in (1, 2, 5, 8, 9):
        assert torch.equal(held.matmul(x[:rows]), got[:rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(held.matmul(x), got)
    finally:
        torch.set_num_threads(threads)


def test_a_width_the_tiles_cannot_hold_reads_against_float32_inputs():
    w = torch.randn(8, 48)
    assert type(hold_bf16(w)) is Bf16Weight and type(hold_bf16(torch.randn(8, 64), dot=False)) \
        is Bf16Weight
    if hardware_dot():
        assert type(hold_bf16(torch.randn(8, 64))) is Bf16Tiles
        with pytest.raises(ValueError, match="multiple of 32, not 48"):
            Bf16Tiles(w)


def test_bfloat16_on_a_cpu_is_weight_only_and_runs_the_native_pass():
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="bfloat16"),
                        torch.device("cpu"), 1)
    layout = Bf16Tiles if hardware_dot() else Bf16Weight
    assert backend.dtype == torch.float32 and type(backend.lean.layers[0][1]) is layout
    assert backend.describe()["weights"] == (
        "bfloat16 weights by bfloat16-rounded inputs (AVX512-BF16), float32 activations"
        if hardware_dot() else "bfloat16 weights, float32 activations")
    assert backend.lean.native_pass_rows() == "1-128 queries"
    # activations=float32: float32 arithmetic, wherever the CPU multiplies bfloat16
    wide = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="bfloat16",
                                   activations="float32"), torch.device("cpu"), 1)
    assert type(wide.lean.layers[0][1]) is Bf16Weight
    assert wide.describe()["weights"] == "bfloat16 weights, float32 activations"
    assert wide.lean.native_pass_rows() == "1-128 queries"
    whole = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="bfloat16",
                                    activations="bfloat16"), torch.device("cpu"), 1)
    assert whole.dtype == torch.bfloat16 and whole.lean.quantized is None   # a bfloat16 model


@pytest.mark.parametrize("activations", ["auto", "float32"])
def test_greedy_speculation_over_bfloat16_weights_equals_plain_decoding(activations):
    base = ["model=demo", "dtype=bfloat16", "max_new_tokens=24", "max_batch_size=2",
            "show_progress=false", "threads=1", f"model.activations={activations}"]
    prompts = ["def parse(text):\n", "import os\n\n"]
    plain = Pipeline.from_config([*base, "proposer=none", "draft=none"]).generate(prompts)
    spec = Pipeline.from_config([*base, "proposer=ngram", "draft=none"]).generate(prompts)
    drafted = Pipeline.from_config([*base, "proposer=draft"]).generate(prompts)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]


LONG = ("import os\nimport sys\n\n\ndef walk(root):\n    \"\"\"Every file under root, sorted.\"\"\"\n"
        "    out = []\n    for folder, _, names in os.walk(root):\n        for name in names:\n"
        "            out.append(os.path.join(folder, name))\n    return sorted(out)\n\n\ndef main():\n")


@pytest.fixture
def counted_library(monkeypatch):
    """bf16_weights' oneDNN products counted; hardware_bf16() as the test sets it."""
    from specflow.backends.lean import bf16_weights

    calls = []
    real = torch.nn.functional.linear

    class Counted:
        def __getattr__(self, name):
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(bf16_weights, "F", Counted())
    return calls, lambda on: monkeypatch.setattr(bf16_weights, "hardware_bf16", lambda: on)


def test_a_long_prefill_takes_onednns_bfloat16_products_where_the_cpu_has_them(counted_library):
    """The widening layout's prefill (activations=float32); the tiles' own products serve a
    prefill as any other pass (the test after the next)."""
    from specflow.backends.lean.bf16_weights import LIBRARY_ROWS

    calls, hardware = counted_library
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="bfloat16",
                                      activations="float32"), torch.device("cpu"), 1)
    ids = backend.tokenizer.encode(LONG)
    assert len(ids) > LIBRARY_ROWS
    keys = {}
    for on in (False, True):
        hardware(on)
        calls.clear()
        backend.reset(0)
        backend.prefill_many([0], [ids])
        keys[on] = [k[0, :, :len(ids)].clone() for k in backend.cache.keys]
        # every layer's products (qkv, o, gate-up, down) at the prompt's rows, or none
        assert len(calls) == (4 * backend.num_layers if on else 0)
        assert all(math.prod(shape[:-1]) == len(ids) for shape in calls)
    for native, library in zip(keys[False], keys[True]):    # bfloat16's rounding, no more
        torch.testing.assert_close(library, native, rtol=0.02, atol=0.02 * float(native.abs().max()))
        assert not torch.equal(library, native)
    # a pass that scores positions never does, however many rows: its logits are the same bits
    hardware(True)
    calls.clear()
    backend.reset(0)
    scored = backend.forward(torch.tensor([0]), torch.tensor([ids]), torch.tensor([len(ids)]))
    hardware(False)
    backend.reset(0)
    assert torch.equal(scored, backend.forward(torch.tensor([0]), torch.tensor([ids]),
                                               torch.tensor([len(ids)])))
    assert calls == []
    # short prompts keep the native product
    hardware(True)
    backend.reset(0)
    backend.prefill_many([0], [ids[:LIBRARY_ROWS - 1]])
    assert calls == []


def test_greedy_speculation_after_a_long_bfloat16_prefill_equals_plain_decoding(counted_library):
    calls, hardware = counted_library
    hardware(True)
    base = ["model=demo", "dtype=bfloat16", "max_new_tokens=24", "max_batch_size=2",
            "show_progress=false", "threads=1", "chat=off", "model.activations=float32"]
    prompts = [LONG, LONG.replace("walk", "files")]
    plain = Pipeline.from_config([*base, "proposer=none", "draft=none"]).generate(prompts)
    assert calls                                     # the prompts went through oneDNN's products
    for arm in (["proposer=ngram", "draft=none"], ["proposer=draft"]):
        got = Pipeline.from_config([*base, *arm]).generate(prompts)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]


@needs_dot
def test_a_long_prefill_over_the_cpus_bfloat16_products_stays_native(counted_library):
    calls, hardware = counted_library
    hardware(True)
    base = ["model=demo", "dtype=bfloat16", "max_new_tokens=24", "max_batch_size=2",
            "show_progress=false", "threads=1", "chat=off"]
    prompts = [LONG, LONG.replace("walk", "files")]
    plain = Pipeline.from_config([*base, "proposer=none", "draft=none"]).generate(prompts)
    assert calls == []                               # no oneDNN product: the tiles' own
    for arm in (["proposer=ngram", "draft=none"], ["proposer=draft"]):
        got = Pipeline.from_config([*base, *arm]).generate(prompts)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
