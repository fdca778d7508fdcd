"""Tiny transformers models, built offline with fixed seeds (no hub, no network)."""
from __future__ import annotations

import inspect
import json
import pathlib

import pytest
import torch


def train_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [inspect.getsource(m) for m in (json, pathlib, inspect)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_config(arch: str, vocab: int, eos: int, layers: int = 2, hidden: int = 64,
                max_positions: int = 256, **extra):
    import transformers as tf

    common = dict(vocab_size=vocab, num_hidden_layers=layers, num_attention_heads=4,
                  eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_positions,
                             vocab_size=vocab, eos_token_id=eos, bos_token_id=eos)
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                max_position_embeddings=max_positions, **common)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[arch]
    return cls(hidden_size=hidden, intermediate_size=2 * hidden, num_key_value_heads=2,
               max_position_embeddings=max_positions, **common, **extra)


def build_model(path: pathlib.Path, arch: str, tokenizer, seed: int, sharpen: float = 8.0,
                **kw) -> pathlib.Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, len(tokenizer), tokenizer.eos_token_id, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():   # random models are nearly uniform: sharpen so text has structure
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturbed_copy(src: pathlib.Path, dst: pathlib.Path, scale: float, seed: int) -> pathlib.Path:
    """A draft close to the target: the same weights plus noise (greedy acceptance well above 0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def resized_vocab_copy(src: pathlib.Path, dst: pathlib.Path, extra: int) -> pathlib.Path:
    """The same model with `extra` padding rows in its vocabulary (as Qwen drafts vs targets)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + extra)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{'tokenizer', 'llama', 'llama_draft', 'qwen2', ...}: directories of tiny models."""
    root = tmp_path_factory.mktemp("hf_models")
    tok = train_tokenizer()
    out = {"tokenizer": tok}
    for i, arch in enumerate(("llama", "qwen2", "mistral", "gpt2", "gpt_neox")):
        out[arch] = build_model(root / arch, arch, tok, seed=i)
    out["llama_draft"] = perturbed_copy(out["llama"], root / "llama_draft", 0.15, seed=7)
    out["llama_short"] = build_model(root / "llama_short", "llama", tok, seed=0, max_positions=48)
    out["llama_bias"] = build_model(root / "llama_bias", "llama", tok, seed=5, attention_bias=True)
    out["llama_wide_vocab"] = resized_vocab_copy(out["llama_draft"], root / "llama_wide", 64)
    other = train_tokenizer(vocab_size=300)
    out["other_tokenizer"] = build_model(root / "other_tok", "llama", other, seed=3)
    mamba = root / "mamba"
    mamba.mkdir()
    (mamba / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": len(tok),
                                                   "hidden_size": 32, "num_hidden_layers": 1}))
    tok.save_pretrained(mamba)
    out["mamba"] = mamba
    return out
