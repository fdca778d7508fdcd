"""A GGUF model whose layer products are the file's blocks is built without their float32
weights (backends/hf/file_products.py): the products are placeholders from the start, the
decoding is what the float32-loaded model holding the same blocks decodes, and a file whose
blocks do not match the folder's values loads the float32 weights after all."""
from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from specflow import Pipeline  # noqa: E402
from specflow.backends.hf import file_model, file_products  # noqa: E402
from specflow.backends.lean import blocks  # noqa: E402
from tests.backends.hf.test_gguf import PROMPTS, write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not blocks.available(),
                                reason="no C compiler: specflow's native kernel is not built")


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "specflow-cache"))


@pytest.fixture(scope="module")
def q4_0_file(hf_models, tmp_path_factory):
    return write_gguf(hf_models["llama"], tmp_path_factory.mktemp("gguf") / "tiny-Q4_0.gguf",
                      quant="Q4_0")


def decode(path, *overrides):
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none", "threads=1",
                                 "show_progress=false", "dtype=auto",
                                 "model.activations=float32", *overrides])
    out = [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=12)]
    return pipe.target, out


def test_the_products_are_never_read_and_decode_as_the_float_loaded_model_does(q4_0_file,
                                                                               monkeypatch):
    target, lean = decode(q4_0_file, "proposer=none")
    assert target.products_from_file
    mlp = target.model.model.layers[1].mlp
    assert file_products.is_placeholder(mlp.down_proj.weight)
    assert not file_products.is_placeholder(target.model.model.embed_tokens.weight)
    assert target.describe()["weights"].startswith("the file's blocks as they are")
    # the same blocks over the model loaded with its float32 products first
    monkeypatch.setattr(file_products, "wanted", lambda *a: False)
    dense_target, dense = decode(q4_0_file, "proposer=none")
    assert not dense_target.products_from_file
    assert dense == lean
    # a state_dict reads the blocks' values back into the placeholders' modules, as after
    # quantizing a loaded model
    torch.testing.assert_close(target.model.state_dict()["model.layers.1.mlp.down_proj.weight"],
                               dense_target.model.state_dict()[
                                   "model.layers.1.mlp.down_proj.weight"], rtol=0, atol=0)
    _, speculated = decode(q4_0_file, "proposer=ngram", "proposer.k=3")
    assert speculated == lean


def test_blocks_that_do_not_match_the_folder_load_the_float_weights_after_all(q4_0_file,
                                                                             monkeypatch):
    from specflow.backends.lean import gguf_blocks

    monkeypatch.setattr(gguf_blocks, "matches", lambda held, dense: False)
    target, got = decode(q4_0_file, "proposer=none")
    assert not target.products_from_file and target.lean.quantized is None
    assert not file_products.is_placeholder(target.model.model.layers[1].mlp.down_proj.weight)
    _, want = decode(q4_0_file, "proposer=none", "dtype=float32")
    assert got == want


def test_tensors_are_read_alone_from_one_file_or_shards(hf_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    names = ["model.norm.weight", "model.layers.1.mlp.down_proj.weight"]
    for folder in (hf_models["llama"], tmp_path / "shards"):
        got = file_products.read_tensors(str(folder), names)
        for n in names:
            assert torch.equal(got[n], model.get_parameter(n))


def test_a_tied_embedding_is_looked_up_in_the_files_head_blocks(hf_models, tmp_path, monkeypatch):
    """A file whose embedding is tied and in blocks (SmolLM2's Q8_0 token_embd): the lean
    forward looks its rows up in the head's blocks and frees the table; the tokens are those of
    the table kept, the table's values come back for a caller that wants it dense (an EAGLE
    head) and when the model is unpacked."""
    from specflow.backends.lean.forward import LeanLlama
    from tests.backends.conftest import build_model

    folder = build_model(tmp_path / "tied", "llama", hf_models["tokenizer"], seed=12,
                         tie_word_embeddings=True)
    path = write_gguf(folder, tmp_path / "tied-Q8_0.gguf",
                      quant={"token_embd": "Q8_0", **{n: "Q8_0" for n in (
                          "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                          "ffn_down")}})
    target, shared = decode(path, "proposer=none")
    lean = target.lean
    assert lean.embed_held is lean.lm_head and file_products.is_placeholder(lean.embed)
    table = target.input_embeddings()
    ids = torch.arange(table.shape[0])
    assert torch.equal(lean.embedding(ids), table)
    assert target.describe()["weights"].endswith("the LM head in the file's own blocks")
    monkeypatch.setattr(LeanLlama, "_share_embedding", lambda self, head: None)
    kept_target, kept = decode(path, "proposer=none")
    assert kept_target.lean.embed_held is None and shared == kept
    assert torch.equal(kept_target.input_embeddings(), table)
    lean.unpack()                                           # the table back, from the blocks
    assert lean.embed_held is None and torch.equal(lean.embed, table)


def test_a_tied_embedding_is_mapped_from_the_folder_not_read(tmp_path):
    """mapped_tensor: a float32 tensor of a safetensors file as a copy-on-write mapping (its
    values; a write stays in the process, the file keeps its bytes); None for another dtype or
    a name the folder lacks (the caller reads those)."""
    from safetensors.torch import save_file

    table = torch.randn(40, 24)
    save_file({"model.embed_tokens.weight": table, "model.norm.weight": torch.ones(24).half()},
              str(tmp_path / "model.safetensors"))
    mapped = file_products.mapped_tensor(str(tmp_path), "model.embed_tokens.weight")
    assert torch.equal(mapped, table) and mapped.dtype == torch.float32
    mapped[0] = 0.0
    again = file_products.mapped_tensor(str(tmp_path), "model.embed_tokens.weight")
    assert torch.equal(again, table)                           # the file kept its bytes
    assert file_products.mapped_tensor(str(tmp_path), "model.norm.weight") is None
    assert file_products.mapped_tensor(str(tmp_path), "lm_head.weight") is None


def test_the_shell_is_the_model_transformers_builds(q4_0_file, monkeypatch):
    """file_model.py: the model built without transformers' classes holds the same tensors under
    the same names, the same rotary frequencies and generation config, and decodes the same
    tokens as the transformers-built model holding the same blocks."""
    from specflow.backends.hf.file_model import FileModel

    target, got = decode(q4_0_file, "proposer=none")
    assert isinstance(target.model, FileModel)
    monkeypatch.setattr(file_model, "load_light", lambda *a: None)
    built, want = decode(q4_0_file, "proposer=none")
    assert not isinstance(built.model, FileModel) and built.products_from_file
    assert got == want
    mine, theirs = target.model.state_dict(), built.model.state_dict()
    assert set(mine) <= set(theirs) and "model.layers.1.mlp.down_proj.weight" in mine
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    assert torch.equal(target.lean.inv_freq, built.lean.inv_freq)
    assert target.model.generation_config.to_dict() == built.model.generation_config.to_dict()
    assert target.model.dtype == built.model.dtype and target.eos_token_ids == built.eos_token_ids
    with pytest.raises(RuntimeError, match="lean forward only"):
        target.model(input_ids=torch.zeros(1, 1, dtype=torch.long))


def test_a_blocks_run_never_imports_transformers_model_classes(q4_0_file, tmp_path):
    """The point of the shell: a run on a GGUF file's blocks imports neither transformers'
    Llama module nor the stack its config class pulls in (sympy, torch's dynamo: ~95 MB)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from specflow import Pipeline; "
            f"p = Pipeline.from_config(['model.path={q4_0_file}', 'model=hf', 'draft=none', "
            "'proposer=none', 'threads=1', 'show_progress=false', 'dtype=auto', "
            "'model.activations=float32']); "
            "print(type(p.target.model).__name__, p.generate(['hello'], max_new_tokens=3)[0].token_ids); "
            "print(sorted(m for m in ('transformers.models.llama.modeling_llama', "
            "'transformers.modeling_utils', 'sympy', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=os.environ.copy(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    kind, imported = out.stdout.strip().splitlines()[-2:]
    assert kind.startswith("FileModel") and imported == "[]"


def test_the_shell_serves_only_the_default_rope_and_llama_family_types():
    from specflow.backends.hf.file_model import rope_base

    assert rope_base({"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}) == 1e5
    assert rope_base({"rope_theta": 10000}) == 10000.0
    assert rope_base({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}) is None
    assert rope_base({"rope_scaling": {"type": "linear"}, "rope_theta": 1e4}) is None
    assert rope_base({"rope_theta": 1e4, "partial_rotary_factor": 0.5}) is None
    assert rope_base({}) is None


def test_the_rotary_frequencies_are_transformers_own(hf_models):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specflow.backends.hf.file_model import Rotary

    config = AutoConfig.from_pretrained(hf_models["llama"])
    theirs = LlamaRotaryEmbedding(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = (config.rope_parameters or {}).get("rope_theta", getattr(config, "rope_theta", None))
    mine = Rotary(head_dim, float(base))
    assert torch.equal(mine.inv_freq, theirs.inv_freq)
    assert mine.attention_scaling == theirs.attention_scaling
