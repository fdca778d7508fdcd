"""Weights in transparent huge pages (backends/lean/huge_pages.py, `model.huge_pages`): the same
bits, every reader pointed at the copies, nothing held twice."""
from __future__ import annotations

import torch
import pytest

from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean import huge_pages, native

needs_huge_pages = pytest.mark.skipif(not huge_pages.available(),
                                      reason="no transparent huge pages on this kernel")


def copied(tensors):
    rooms = huge_pages.reserve([t.numel() * t.element_size() for t in tensors])
    return None if rooms is None else [huge_pages.place(r, t) for r, t in zip(rooms, tensors)]


@needs_huge_pages
def test_copies_hold_the_same_bits_aligned():
    tensors = [torch.randn(700, 1000), torch.randint(0, 255, (3001,), dtype=torch.uint8),
               torch.randn(33, 17).to(torch.bfloat16)]
    copies = copied(tensors)
    assert copies is not None
    assert copies[0].data_ptr() % huge_pages.PAGE == 0
    for t, c in zip(tensors, copies):
        assert c.data_ptr() % huge_pages.ALIGN == 0 and c.dtype == t.dtype
        assert c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr()


def test_less_than_a_huge_page_or_none_available_is_not_copied(monkeypatch):
    assert copied([torch.randn(100, 100)]) is None                                # 40 KB
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    assert copied([torch.randn(1024, 1024)]) is None


def backend(huge: bool, dtype: str = "float32") -> HFBackend:
    cfg = HFModelConfig(path=str(DEMO_DIR / "target"), dtype=dtype, huge_pages=huge)
    return HFBackend(cfg, torch.device("cpu"), slots=1)


def logits(b: HFBackend, forward: str = "lean") -> torch.Tensor:
    ids = torch.tensor([[5, 90, 313, 7, 1200, 44]])
    b.reset(0)
    if forward == "hf":          # transformers' own forward over the model's parameters
        return b.model(input_ids=ids).logits
    b.forward(torch.tensor([0]), ids[:, :5], torch.tensor([5]), logits=False)
    return b.forward(torch.tensor([0]), ids[:, 5:], torch.tensor([1]))


@needs_huge_pages
@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_a_model_in_huge_pages_computes_the_same_bits(dtype):
    if dtype == "int4" and not native.available():
        pytest.skip("no native kernel here: int4 takes ATen's layout")
    plain, huge = backend(False, dtype), backend(True, dtype)
    assert plain.lean.huge_page_bytes == 0 and huge.lean.huge_page_bytes > 2 ** 20
    assert huge.describe()["huge_pages_mb"] > 1
    assert torch.equal(logits(plain), logits(huge))
    if dtype == "float32":       # the model's own forward reads the moved parameters
        assert torch.equal(logits(plain, "hf"), logits(huge, "hf"))


@needs_huge_pages
def test_every_reader_points_at_the_copies():
    b = backend(True)
    lean, model = b.lean, b.model
    start = lean.layers[0][1].untyped_storage().data_ptr()
    moved = {w.untyped_storage().data_ptr() for layer in lean.layers for w in layer[1::2]
             if w is not None and w.numel() > lean.embed.shape[1]}
    assert moved == {start}                       # every product: one mapping
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = lean.layers[0][1]
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == start       # a view of the copy
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()
    assert mlp.down_proj.weight.data_ptr() == lean.layers[0][7].data_ptr()
    # the tied head and embedding stay one tensor
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr() \
        == lean.lm_head.data_ptr() == lean.embed.data_ptr()
    assert model.lm_head.weight.untyped_storage().data_ptr() == start


@needs_huge_pages
def test_packing_and_unpacking_keep_the_weights_in_huge_pages():
    from specflow.backends.lean.kernels import can_pack

    if not can_pack(torch.float32):
        pytest.skip("no oneDNN packing here")
    plain, huge = backend(False), backend(True)
    arena = huge.lean.embed.untyped_storage().data_ptr()
    for b in (plain, huge):
        b.lean.pack()
    # the products packed; what stays dense (the embedding, the norms) in a fresh mapping
    assert huge.lean.layers[0][1].is_mkldnn and huge.lean.huge_page_bytes > 2 ** 20
    assert huge.lean.embed.untyped_storage().data_ptr() != arena
    assert torch.equal(logits(plain), logits(huge))
    for b in (plain, huge):
        b.lean.unpack()
    assert not huge.lean.layers[0][1].is_mkldnn
    start = huge.lean.layers[0][1].untyped_storage().data_ptr()
    assert huge.lean.layers[3][7].untyped_storage().data_ptr() == start    # one mapping again
    assert huge.model.model.layers[0].mlp.down_proj.weight.untyped_storage().data_ptr() == start
    assert torch.equal(logits(plain), logits(huge))
    assert torch.equal(logits(plain, "hf"), logits(huge, "hf"))


def test_weights_under_a_huge_page_stay_where_they_are(tmp_path):
    # a model smaller than one huge page (~1 MB): nothing to gain, nothing moved, and it runs
    import shutil

    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=8192, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64)
    path = tmp_path / "tiny"
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / f, path / f)
    b = HFBackend(HFModelConfig(path=str(path), huge_pages=True), torch.device("cpu"), slots=1)
    assert b.lean.huge_page_bytes == 0 and b.describe()["huge_pages_mb"] == 0
    b.forward(torch.tensor([0]), torch.tensor([[5, 6, 7]]), torch.tensor([3]))
