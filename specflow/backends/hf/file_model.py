"""The model of a converted GGUF folder whose layer products will be the file's blocks, built
without transformers' model classes (`dtype=auto` on a CPU: backends/hf/file_products.py).

The lean forward reads a model's tensors by their names (model.layers.N.self_attn.q_proj, ...)
and its config; it never calls the model's own forward. transformers' Llama module costs ~95 MB
of a process's memory and ~2.5 s to import (its config class alone pulls in
torch.distributed.tensor, torch._dynamo and sympy), about a fifth of a SmolLM2 Q4_1 run. Here the
module tree is made of plain holders named as transformers names them, filled from the folder's
safetensors header: each layer product a one-element placeholder of its shape, every other
tensor read (a tied embedding mapped), the rotary frequencies computed as transformers computes
them for the default rope. The config is transformers' generic PretrainedConfig over
config.json, whose every key is an attribute.

Only for the Llama-family types the lean forward covers, with the default rope, a folder holding
every tensor the forward reads and a tokenizer of transformers' generic class
(backends/hf/tokenizers.py); anything else is loaded by transformers as before (`load` returns
None).
"""
from __future__ import annotations

import pathlib

import torch
from torch import nn

from specflow.backends.lean.forward import SUPPORTED, placeholder

PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}.weight" for p in PRODUCTS[:4]),
                 *(f"mlp.{p}.weight" for p in PRODUCTS[4:]))


class Holder(nn.Module):
    """A module that holds the tensors set on it (a product's `bias` is None until one is)."""

    def __init__(self):
        super().__init__()
        self.register_parameter("bias", None)


class Rotary(nn.Module):
    """Llama's default rotary frequencies, computed as transformers' rotary embedding does."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
        self.register_buffer("inv_freq", 1.0 / (base ** exponents), persistent=False)   # [D/2]
        self.attention_scaling = 1.0


class FileModel(nn.Module):
    """model.embed_tokens / layers / norm / rotary_emb and lm_head, with the config, generation
    config and folder a transformers model carries."""

    def __init__(self, config, generation_config, name_or_path: str):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.name_or_path = name_or_path
        self.model = Holder()
        self.model.layers = nn.ModuleList(Holder() for _ in range(config.num_hidden_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, logits_to_keep=0,
                **kwargs):
        raise RuntimeError("this model's layer products are a GGUF file's blocks: it runs "
                           "through specflow's lean forward only (model.forward=hf loads it "
                           "with transformers)")

    def set(self, name: str, value: torch.Tensor) -> None:
        """Set the tensor at a dotted name, making the holders on the way."""
        *path, leaf = name.split(".")
        module = self
        for part in path:
            child = getattr(module, part, None) if not part.isdigit() else module[int(part)]
            if child is None:
                child = Holder()
                setattr(module, part, child)
            module = child
        setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def rope_base(config: dict) -> float | None:
    """The default rope's base, or None for a rope this shell does not compute (scaled,
    partial). `config`: config.json's keys (a missing key and None alike)."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kinds = {rope.get("rope_type") or "default",
             scaling.get("rope_type") or scaling.get("type") or "default"}
    if kinds != {"default"} or (config.get("partial_rotary_factor") or 1.0) != 1.0 \
            or (rope.get("partial_rotary_factor") or 1.0) != 1.0:
        return None
    base = rope.get("rope_theta") or config.get("rope_theta")
    return float(base) if isinstance(base, (int, float)) else None


def light_config(folder: str):
    """transformers' generic config over the folder's config.json (the tokenizer's view of it,
    tokenizers.config_view), or None where this shell does not build the model."""
    from specflow.backends.hf.tokenizers import config_view

    config = config_view(folder)
    if config is None or config.model_type not in SUPPORTED or rope_base(config.to_dict()) is None:
        return None
    needed = ("hidden_size", "num_attention_heads", "num_hidden_layers", "rms_norm_eps",
              "vocab_size")
    if any(not isinstance(getattr(config, k, None), (int, float)) for k in needed):
        return None
    return config              # what the lean forward covers: file_products.wanted checks


def load(folder: str, config) -> FileModel | None:
    """The shell of `folder` (config: light_config's) with each layer product a placeholder of
    its shape and every other tensor read (a tied embedding mapped), or None where the folder
    lacks a tensor the lean forward reads."""
    from transformers import GenerationConfig

    from specflow.backends.hf.file_products import header, mapped_tensor, read_tensors, tensor_files

    where = tensor_files(pathlib.Path(folder))
    shapes = {}
    for file in sorted(set(where.values()), key=str):
        _, info = header(file)
        shapes.update({name: tuple(t["shape"]) for name, t in info.items() if name in where})
    layers = config.num_hidden_layers
    wanted = ["model.embed_tokens.weight", "model.norm.weight",
              *(f"model.layers.{i}.{t}" for i in range(layers) for t in LAYER_TENSORS)]
    if any(name not in shapes for name in wanted) or any(
            name.startswith("model.layers.") and int(name.split(".")[2]) >= layers
            for name in shapes):
        return None
    tied = "lm_head.weight" not in shapes
    products = {n for n in shapes if n.endswith(".weight") and n.split(".")[-2] in PRODUCTS}
    embedding = "model.embed_tokens.weight"
    mapped = {}
    if tied and (table := mapped_tensor(folder, embedding)) is not None:
        mapped[embedding] = table
    read = read_tensors(folder, [n for n in shapes if n not in products and n not in mapped])
    if (pathlib.Path(folder) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(folder)
    else:
        generation = GenerationConfig.from_model_config(config)
    model = FileModel(config, generation, folder)
    for name in shapes:
        value = placeholder(shapes[name], torch.float32) if name in products else \
            mapped.get(name, read.get(name))
        model.set(name, value)
    if tied:
        model.lm_head = Holder()
        model.lm_head.weight = model.model.embed_tokens.weight
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    model.model.rotary_emb = Rotary(head_dim, rope_base(config.to_dict()))
    return model.eval()


def load_light(cfg, folder: str, device: torch.device):
    """(model, tokenizer) of a converted GGUF folder whose every layer product will be the
    file's blocks, built without transformers' model classes, or None where this shell does not
    serve it (then transformers loads it: file_products.load)."""
    from specflow.backends.hf.file_products import wanted
    from specflow.backends.hf.tokenizers import open_tokenizer, take_tokenizer

    if cfg.trust_remote_code:
        return None
    config = light_config(folder)
    if config is None or not wanted(cfg, folder, config, device):
        return None
    tokenizer = take_tokenizer(folder)
    try:
        if tokenizer is None:
            tokenizer = open_tokenizer(folder)
        model = load(folder, config)
    except Exception:   # (the tokenizers library raises plain Exception) transformers says why
        return None
    return (model, tokenizer) if model is not None else None
