"""The lean forward: exact per position across pass widths, no memory for prepared weights,
kernel forms that agree, and Mistral's sliding window honoured by the explicit mask."""
from __future__ import annotations

import pytest
import torch

from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean import kernels
from specflow.backends.lean import native
from specflow.backends.lean.kernels import FORMS, Kernels, can_pack, grouped_attention, pack, packed, pick

# what the choices at build time measure is replaced here: nothing is read back or kept
pytestmark = pytest.mark.times_choices

# fp32: the bound; bf16 carries ~3 significant digits, so a different product shape
# may move a logit by a few units of its last place
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.15}


needs_onednn = pytest.mark.skipif(not can_pack(torch.float32),
                                  reason="this torch build has no oneDNN packed linear")


def demo_target(dtype: str = "float32", forward: str = "lean", path=DEMO_DIR / "target") -> HFBackend:
    return HFBackend(HFModelConfig(path=str(path), dtype=dtype, forward=forward),
                     torch.device("cpu"), slots=2)


@pytest.mark.parametrize("layout", ["dense", pytest.param("packed", marks=needs_onednn),
                                    "grouped attention"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_position_scored_inside_a_wide_pass_equals_it_scored_alone(dtype, layout):
    if layout == "packed" and not can_pack(getattr(torch, dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU (bf16 needs AVX512-BF16 or "
                    f"AVX-NE-CONVERT support)")
    backend = demo_target(dtype)
    if layout == "packed":
        backend.lean.pack()
    # one-query passes attend with grouped products whatever the context (where measured
    # faster they take them from some number of keys, rows x cached length, on)
    backend.lean.grouped_from = 1 if layout == "grouped attention" else None
    # causal passes of up to native.MAX_ROWS queries run as one native call
    # (test_native_pass.py) unless told
    backend.lean.native_layers = layout != "grouped attention"
    torch.manual_seed(0)
    prompt = torch.randint(1, 8000, (1, 150))
    fed = torch.randint(1, 8000, (1, 9))          # the last token plus 8 drafts
    slot = torch.tensor([0])
    backend.reset(0)
    backend.forward(slot, prompt, torch.tensor([150]), logits=False)
    for width in (2, 5, 9):
        backend.truncate(slot, [150])
        wide = backend.forward(slot, fed[:, :width], torch.tensor([width]))[0]      # [W, V]
        for p in range(width):    # position p alone, after the p tokens before it
            backend.truncate(slot, [150])
            if p:
                backend.forward(slot, fed[:, :p], torch.tensor([p]), logits=False)
            alone = backend.forward(slot, fed[:, p:p + 1], torch.tensor([1]))[0, 0]  # [V]
            gap = (wide[p] - alone).abs().max().item()
            assert gap <= TOLERANCE[dtype], (dtype, width, p, gap)


def test_prepared_weights_share_the_models_storage():
    backend = demo_target()
    lean = backend.lean
    assert lean.extra_bytes() == 0
    att = backend.model.model.layers[0].self_attn
    fused = lean.layers[0][1]
    assert att.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert att.v_proj.weight.data_ptr() != att.q_proj.weight.data_ptr()
    # the transformers forward still runs on the views and agrees with the lean one
    ids = torch.randint(1, 8000, (1, 12))
    hf = backend.model(input_ids=ids).logits[0]
    backend.reset(0)
    lean_logits = backend.forward(torch.tensor([0]), ids, torch.tensor([12]))[0]
    assert torch.allclose(hf, lean_logits, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("form", sorted(FORMS) + [pytest.param("packed", marks=needs_onednn)])
def test_every_kernel_form_computes_the_same_product(form, rows):
    torch.manual_seed(rows)
    w = torch.randn(300, 64)
    x = torch.randn(1, rows, 64)
    if form == "packed":
        w_used, kernels = pack(w), Kernels(pack=True)
    else:
        w_used, kernels = w, Kernels(form if form != "weight_left" else "linear", form, form)
    assert torch.allclose(kernels.matmul(x, w_used), torch.nn.functional.linear(x, w), atol=1e-5)


@needs_onednn
def test_packed_rows_do_not_depend_on_the_rows_beside_them():
    # oneDNN's packed product gives a row the same bits alone (padded) or among 2..33 rows
    torch.manual_seed(0)
    w = pack(torch.randn(1536, 512))
    x = torch.randn(33, 512)
    full = packed(x, w)
    for rows in (1, 2, 3, 5, 9, 16, 33):
        assert torch.equal(packed(x[:rows], w), full[:rows]), rows


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_packing_frees_the_dense_weights_and_unpacks_for_transformers(tmp_path, tied):
    import shutil

    import transformers as tf

    path = DEMO_DIR / "target"
    if not tied:      # a small untied Llama: its LM head is packed too
        torch.manual_seed(3)
        cfg = tf.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=160,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128, tie_word_embeddings=False)
        path = tmp_path / "untied"
        tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO_DIR / "target" / name, path / name)
    backend = demo_target(path=path)
    model, lean = backend.model, backend.lean
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(1, 8000, (1, 12))
    backend.reset(0)
    dense_logits = backend.forward(torch.tensor([0]), ids, torch.tensor([12]))[0]
    lean.pack()
    assert lean.packed and lean.kernels.pack
    # the dense copies are freed; a tied head is packed as a copy (the embedding lookup reads it)
    assert lean.extra_bytes() == (lean.embed.numel() * 4 if tied else 0)
    att = model.model.layers[0].self_attn
    assert att.q_proj.weight.shape == before["model.layers.0.self_attn.q_proj.weight"].shape
    assert att.q_proj.weight.untyped_storage().nbytes() == 4          # the dense copy is gone
    assert lean.lm_head.is_mkldnn
    backend.reset(0)
    packed_logits = backend.forward(torch.tensor([0]), ids, torch.tensor([12]))[0]
    assert torch.allclose(packed_logits, dense_logits, atol=1e-4)
    # anything that reads the weights unpacks first: transformers' forward, state_dict()
    hf = model(input_ids=ids).logits[0]
    assert not lean.packed and not lean.kernels.pack
    assert not lean.lm_head.is_mkldnn and lean.extra_bytes() == 0     # a tied copy dropped too
    assert torch.allclose(hf, dense_logits, atol=1e-4)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    lean.pack()
    sub = model.model.layers[1].mlp.down_proj.state_dict()          # a submodule's too
    assert torch.equal(sub["weight"], before["model.layers.1.mlp.down_proj.weight"])
    assert not lean.packed


def test_kernels_are_picked_once_per_weight_set_and_cuda_takes_linear():
    weights = [torch.randn(256, 64), torch.randn(64, 128)]
    first = pick(weights, repeats=1)
    assert first.one_row in FORMS and first.few_rows in FORMS
    assert {t[0] for t in first.timings_ms} == set(FORMS) - (set() if native.available() else {"native"})
    assert pick([w.clone() for w in weights], repeats=1) is first        # cached by shapes


class FakeClock:
    """A clock that moves only when a fake form runs: decisions by programmed costs, no sleeps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def form(self, fixed_ms: float, row_ms: float):
        def run(x, w):
            self.now += (fixed_ms + row_ms * x.shape[0]) / 1e3
            return x.new_zeros(x.shape[0], w.shape[0])
        return run


@pytest.mark.skipif(not native.available(), reason="no C compiler: no native product")
@pytest.mark.parametrize("per_row_ms, upto", [(0.12, 64), (0.2, kernels.SMALL_ROWS)])
def test_the_native_form_serves_as_many_rows_as_it_stays_the_fastest(monkeypatch, per_row_ms,
                                                                     upto):
    """Where the native form wins 2-8 rows it serves up to SMALL_ROWS, and 64 and 128 rows
    while it beats the library form that won 32 rows there (fake forms: a fixed cost and a cost
    per row, charged to a fake clock)."""
    clock = FakeClock()
    form = clock.form

    library = form(10.0, 0.02)               # the native one: 1 ms + per_row_ms a row
    monkeypatch.setattr(kernels, "FORMS", {"linear": library, "weight_left": form(10.0, 0.03),
                                           "weight_left_padded": form(10.0, 0.03),
                                           "native": form(1.0, per_row_ms)})
    kernels.forget_picks()
    picked = pick([torch.zeros(8, 4)], repeats=2, budget_s=60, clock=clock)
    assert picked.few_rows == "native" and picked.many_rows == "linear"
    assert picked.few_upto == upto
    assert picked.form(upto) == "native" and picked.form(upto + 1) == "linear"
    assert f"2-{upto} rows: native, {upto + 1}-{kernels.BATCH_ROWS} rows: linear" in \
        picked.describe()


@pytest.mark.skipif(not native.available(torch.float16), reason="no native float16 product")
def test_a_wide_16_bit_product_runs_natively_in_chunks_where_the_native_form_won_128_rows(
        monkeypatch):
    w = torch.randn(48, 40).to(torch.float16)
    x = torch.randn(300, 40).to(torch.float16)          # past BATCH_ROWS: prefill, a head's catch-up
    wide = Kernels("native", "native", "linear", wide="native")
    with monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "linear", lambda *a: pytest.fail("F.linear was called"))
        got = wide.matmul(x, w)
    assert torch.equal(got[250:251], native.gemv(x[250:251], w))    # a row's bits, alone or not
    torch.testing.assert_close(got.float(), Kernels().matmul(x, w).float(), atol=2e-2, rtol=2e-2)
    assert "more: native in chunks of 128" in wide.describe()
    assert Kernels().describe().count("native") == 0


@pytest.mark.skipif(not native.available(torch.float16), reason="no native float16 product")
@pytest.mark.parametrize("dtype, wide", [(torch.float16, "native"), (torch.float32, "linear")])
def test_pick_sends_wide_products_native_only_in_16_bits(monkeypatch, dtype, wide):
    """Fake forms: the native one wins every row count up to 128 (in float32 MKL's big
    products are kept past 128 rows: they block better than the native walks)."""
    clock = FakeClock()
    form = clock.form

    monkeypatch.setattr(kernels, "FORMS", {"linear": form(10.0, 0.05), "weight_left": form(10.0, 0.05),
                                           "weight_left_padded": form(10.0, 0.05),
                                           "native": form(1.0, 0.01)})
    kernels.forget_picks()
    picked = pick([torch.zeros(8, 4, dtype=dtype)], repeats=2, budget_s=60, clock=clock)
    assert picked.few_upto == 128 and picked.wide == wide


@pytest.mark.skipif(not native.available(), reason="no C compiler: no native product")
def test_pick_times_the_forms_competing_for_a_row_count_in_turns(monkeypatch):
    """Each form's repeats alternate with the others' (the first of a round rotating), so a
    neighbour's burst weighs on all of them (backends/turns.py)."""
    order = []

    def form(name: str):
        def run(x, w):
            order.append((name, x.shape[0]))
            return x.new_zeros(x.shape[0], w.shape[0])
        return run

    monkeypatch.setattr(kernels, "FORMS", {name: form(name) for name in kernels.FORMS})
    kernels.forget_picks()
    pick([torch.zeros(8, 4)], repeats=3, budget_s=60)
    one_row = [name for name, rows in order if rows == 1]
    a, b, c = kernels.ONE_ROW
    assert one_row == [a, b, c] + [a, b, c] + [b, c, a] + [c, a, b]      # warm-up, then turns


def test_mistral_sliding_window_is_masked(tmp_path):
    import shutil

    import transformers as tf

    torch.manual_seed(5)
    cfg = tf.MistralConfig(vocab_size=8192, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, sliding_window=4)
    reference = tf.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path / "mistral_w4"
    reference.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / name, path / name)
    ids = torch.randint(1, 8000, (1, 14))
    expected = reference(input_ids=ids).logits[0]                         # HF applies the window
    for forward in ("hf", "lean"):
        backend = HFBackend(HFModelConfig(path=str(path), forward=forward), torch.device("cpu"), 1)
        assert backend.window == 4
        backend.reset(0)
        backend.forward(torch.tensor([0]), ids[:, :10], torch.tensor([10]), logits=False)
        got = [backend.forward(torch.tensor([0]), ids[:, 10:12], torch.tensor([2]))[0]]
        got += [backend.forward(torch.tensor([0]), ids[:, t:t + 1], torch.tensor([1]))[0]
                for t in (12, 13)]
        assert torch.allclose(torch.cat(got), expected[10:], atol=1e-4), forward


def test_a_row_fed_nothing_next_to_a_long_one():
    # the Backend contract allows a zero-length row: it sits at its own length, which may be
    # the batch's kv_len, so the rotary table needs that row too
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target")), torch.device("cpu"), 2)
    backend.reset(0)
    backend.reset(1)
    backend.forward(torch.tensor([1]), torch.randint(1, 8000, (1, 256)), torch.tensor([256]),
                    logits=False)
    backend.forward(torch.tensor([0]), torch.randint(1, 8000, (1, 10)), torch.tensor([10]),
                    logits=False)
    out = backend.forward(torch.tensor([0, 1]), torch.tensor([[5], [-1]]), torch.tensor([1, 0]))
    assert out.shape[:2] == (2, 1) and backend.cache_length(1) == 256


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_grouped_attention_is_scaled_dot_product_attention_for_one_query(heads, kv_heads, mask):
    torch.manual_seed(0)
    B, L, D = 3, 37, 16
    q = torch.randn(B, heads, 1, D)
    k, v = torch.randn(B, kv_heads, L, D), torch.randn(B, kv_heads, L, D)
    allowed = torch.rand(B, 1, 1, L) > 0.3
    allowed[..., 0] = True
    m = None if mask is None else allowed if mask == "bool" else \
        torch.zeros(B, 1, 1, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                            enable_gqa=heads != kv_heads)
    torch.testing.assert_close(grouped_attention(q, k, v, m), want, atol=1e-5, rtol=1e-5)


def test_one_query_attention_is_timed_once_and_only_for_cpu_half_precision(monkeypatch):
    cpu = torch.device("cpu")
    pick_attention = kernels.pick_one_query_attention
    assert pick_attention(4, 2, 16, torch.float32, cpu) is None
    assert pick_attention(4, 2, 16, torch.bfloat16, torch.device("cuda")) is None
    kernels.forget_picks()
    calls = []

    def timed(grouped_wins):
        def fake(fn, args, reps, clock=None):
            calls.append(fn.__name__)
            length = args[1].shape[2]
            return 1.0 if fn.__name__ == "fused" else 0.5 if grouped_wins(length) else 2.0
        return fake

    monkeypatch.setattr(kernels, "_median_seconds", timed(lambda length: True))
    assert pick_attention(4, 2, 16, torch.bfloat16, cpu) == kernels.ATTENTION_LENGTHS[0]
    per_length = 2 + 2 * kernels.ROUNDS    # both forms at each length: a warm-up, then in turns
    assert calls[:per_length] == ["fused", "grouped",
                                  "fused", "grouped", "grouped", "fused", "fused", "grouped"]
    assert len(calls) == per_length * len(kernels.ATTENTION_LENGTHS)
    assert pick_attention(4, 2, 16, torch.bfloat16, cpu) == kernels.ATTENTION_LENGTHS[0]
    assert len(calls) == per_length * len(kernels.ATTENTION_LENGTHS)  # cached: nothing timed again
    # grouped wins at the longest length only: from there on; at none: never
    longest = kernels.ATTENTION_LENGTHS[-1]
    for grouped_wins, want in ((lambda length: length == longest, longest),
                               (lambda length: False, None)):
        kernels.forget_picks()
        monkeypatch.setattr(kernels, "_median_seconds", timed(grouped_wins))
        assert pick_attention(4, 2, 16, torch.float16, cpu) == want
    kernels.forget_picks()
