"""Weight-only int8 and int4 (`dtype=int8 | int4`): the layouts hold what they say (values within
half a step of the weights; GGUF-style blocks exactly up to float rounding), the products equal
the dequantized weights' products (each row's the same whatever rows sit beside it), and a
pipeline over a quantized target speculates exactly: greedy speculative output equals greedy
plain decoding of the same quantized model."""
from __future__ import annotations

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean import blocks
from specflow.backends.lean.blocks import BlockWeight
from specflow.backends.lean.forward import is_placeholder
from specflow.backends.lean.quantized import (QuantizedWeight, available, from_int4_blocks,
                                              quantize_int4, quantize_int8, quantize_weight)

pytestmark = pytest.mark.skipif(not (available(8) and available(4)),
                                reason="this torch build has no CPU weight-only int8/int4 ops")


@pytest.mark.parametrize("bits", [8, 4])
def test_atens_layouts_are_within_half_a_step_and_multiply_as_their_values(bits):
    """ATen's weight-only layouts (where specflow's native kernel does not build)."""
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    held = quantize_int8(w) if bits == 8 else quantize_int4(w, 32)
    values = held.dequantize()                                                     # [N, K]
    if bits == 8:
        step = (w.abs().amax(1) / 127)[:, None]                                    # per row
    else:
        g = w.view(48, 3, 32)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, 1)           # per group
    assert ((values - w).abs() <= step / 2 + 1e-5).all()
    x = torch.randn(5, 96)
    torch.testing.assert_close(held.matmul(x), x @ values.T, rtol=1e-4, atol=1e-4)
    assert held.matmul(x.bfloat16()).dtype == torch.bfloat16
    for rows in (x, x.bfloat16()):                     # a row's bits do not depend on the batch
        assert torch.equal(held.matmul(rows)[2:3], held.matmul(rows[2:3]))
    # int8: 8 bits and a float32 scale a row; int4: 4 bits and a float32 scale and zero per 32
    assert held.nbytes() == w.numel() * bits // 8 + (48 * 4 if bits == 8 else 48 * 3 * 8)


def test_gguf_style_int4_blocks_are_held_as_they_are():
    """A Q4_1 block (value = q x d + m over 32 weights) is the int4 layout with scale d and
    zero m + 8d; the values read back are the block's up to float32 rounding."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    d = torch.rand(32, 2).half().float() / 10                                      # fp16 scales
    m = -torch.rand(32, 2).half().float()
    held = from_int4_blocks(q, d, m + 8 * d, 32)
    want = q.float().view(32, 2, 32) * d[..., None] + m[..., None]
    torch.testing.assert_close(held.dequantize(), want.view(32, 64), rtol=0, atol=1e-6)


def test_int4_leaves_a_shape_no_layout_holds_dense():
    """GGUF blocks hold any N for K a multiple of 32; ATen's int4 layout also needs N a
    multiple of 16; int8 falls back to ATen's per-row layout."""
    held = quantize_weight(torch.randn(20, 64), 4, 32)                # N not a multiple of 16
    assert isinstance(held, BlockWeight) if blocks.available() else held is None
    assert quantize_weight(torch.randn(32, 48), 4, 32) is None        # K not a multiple of 32
    assert isinstance(quantize_weight(torch.randn(20, 48), 8, 32), QuantizedWeight)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_greedy_speculation_on_a_quantized_target_equals_its_plain_decoding(dtype):
    """With float32 activations, as for a float32 model (bfloat16 activations round a position
    scored among k+1 differently from one scored alone, so greedy outputs may part at a
    near-tie, as with dtype=bfloat16)."""
    base = ["model=demo", f"dtype={dtype}", "max_new_tokens=24", "max_batch_size=2",
            "show_progress=false", "threads=1", "model.activations=float32"]
    prompts = ["def parse(text):\n", "import os\n\n"]
    plain = Pipeline.from_config([*base, "proposer=none", "draft=none"]).generate(prompts)
    spec = Pipeline.from_config([*base, "proposer=ngram", "draft=none"]).generate(prompts)
    pipe = Pipeline.from_config([*base, "proposer=draft",                         # int draft too
                                 "draft.activations=float32"])
    drafted = pipe.generate(prompts)
    bits = int(dtype[3:])
    # nothing at start (pack=auto's timing, the choices) undid the layout
    assert pipe.target.lean.quantized == pipe.draft.lean.quantized == (bits, 32)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]


def test_a_quantized_backend_says_what_it_holds_and_frees_the_dense_weights():
    dense = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target")), torch.device("cpu"), 1)
    held = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="int4"),
                     torch.device("cpu"), 1)
    if blocks.available():      # activations=auto: float32 on the native block product
        assert held.describe()["weights"] == \
            "int4 weights in Q4_1 blocks (a scale and minimum per 32), float32 activations"
        assert held.dtype == torch.float32
    else:
        assert held.describe()["weights"] == \
            "int4 weights (a scale and zero per 32), bfloat16 activations"
        assert held.dtype == torch.bfloat16
    assert held.lean.quantized == (4, 32)

    def resident(backend) -> int:
        # each parameter's own bytes once (fused weights' views add up to the fused one; weights
        # in huge pages, model.huge_pages, share one storage with the blocks), placeholders none
        own = {p.data_ptr(): p.numel() * p.element_size()
               for p in backend.model.parameters() if not is_placeholder(p)}
        layers = [w for layer in backend.lean.layers for w in layer
                  if isinstance(w, (QuantizedWeight, BlockWeight))]
        return sum(own.values()) + sum(w.nbytes() for w in layers) + backend.lean.extra_bytes()

    # the embedding table stays in the activations' dtype for its lookup (float32 beside blocks)
    assert resident(held) < (0.45 if blocks.available() else 0.4) * resident(dense)


def test_the_transformers_forward_runs_quantized_linears_where_no_lean_forward_does():
    lean = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="int8",
                                   activations="float32"), torch.device("cpu"), 1)
    hf = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="int8",
                                 activations="float32", forward="hf"), torch.device("cpu"), 1)
    assert hf.lean is None and "int8 weights" in hf.describe()["weights"]
    ids = torch.tensor([[5, 17, 300, 42, 7, 99]])
    got = [b.forward(torch.tensor([0]), ids, torch.tensor([6])) for b in (lean, hf)]
    torch.testing.assert_close(got[0], got[1], rtol=1e-3, atol=1e-3)   # the same quantized model


def test_a_state_dict_of_a_quantized_model_reads_its_dequantized_weights():
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="int8",
                                      activations="float32"), torch.device("cpu"), 1)
    want = backend.lean.layers[0][7].dequantize()
    state = backend.model.state_dict()                   # unpacks: transformers' forward works
    torch.testing.assert_close(state["model.layers.0.mlp.down_proj.weight"], want)
    assert backend.lean.quantized is None


@pytest.mark.parametrize("override, message", [
    ("model.group_size=48", "model.group_size=48; use 32, 64, 128 or 256"),
    ("model.activations=float16", "model.activations='float16'; use auto, bfloat16 or float32"),
    ("dtype=int3", "model.dtype='int3'; use float32, float16, bfloat16, int8, int4 or auto"),
])
def test_bad_quantization_settings_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Pipeline.from_config(["model=demo", "proposer=none", "draft=none", override])
