"""The transformers backend: any attention-based AutoModelForCausalLM, batched over ragged rows.

Each forward feeds every row its own new tokens at its own positions (explicit position ids and a
4-D mask), into a SlotKVCache that rolls back per row by length. Models whose cache cannot roll
back token by token (recurrent and hybrid state-space models) are refused with a clear message.
"""
from __future__ import annotations

import inspect
import os
import pathlib
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.models.base import Backend
from specflow.models.slot_cache import SlotKVCache

DEMO_DIR = pathlib.Path(__file__).parent / "demo"

# model types whose per-sequence state is recurrent: a rejected draft cannot be un-read
RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2",
    "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "lfm2", "qwen3_next", "xlstm",
    "minimax", "plamo2", "kimi_linear",
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class HFModelConfig:
    name: str = "hf"
    path: str = "???"                 # a directory from_pretrained loads, or a hub id in the local cache
    dtype: str = "float32"            # float32 | float16 | bfloat16 | auto (the checkpoint's)
    device_map: str | None = None     # "auto": spread a large target over the GPUs (accelerate)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    forward: str = "auto"             # hf | lean | auto (lean where the architecture allows)

    def __post_init__(self) -> None:
        if self.forward not in ("hf", "lean", "auto"):
            raise ConfigError(f"forward={self.forward!r}; use hf, lean or auto")
        if self.dtype not in (*DTYPES, "auto"):
            raise ConfigError(f"model.dtype={self.dtype!r}; use float32, float16, bfloat16 or auto")
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"model.attn_implementation={self.attn_implementation!r}; use sdpa "
                              f"or eager")


class HFTokenizer:
    """The few calls the pipeline makes, over a transformers tokenizer."""

    def __init__(self, tok, eos_ids: frozenset[int]):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.eos_token_ids = eos_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def __len__(self) -> int:
        return len(self.tok)


def resolve_path(path: str) -> str:
    """A local directory stays as is; anything else must be a hub id already in the local cache."""
    if os.path.isdir(os.path.expanduser(path)):
        return os.path.expanduser(path)
    if path.startswith(("/", ".", "~")) or path.count("/") > 1 or path in ("", "???"):
        raise ConfigError(f"model path {path!r} is not a directory; set model.path (or draft.path) "
                          f"to a folder that AutoModelForCausalLM.from_pretrained can load")
    return path


def load_model(cfg: HFModelConfig, device: torch.device, role: str = "model"):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # specflow shows its own progress

    path = resolve_path(cfg.path)
    kwargs = dict(trust_remote_code=cfg.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise ConfigError(f"cannot load {role} {path!r}: {str(exc).splitlines()[0]} (no network "
                          f"here: give a local directory or a model already in the HF cache)") from None
    refuse_recurrent(config, path)
    dtype = "auto" if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    load = dict(kwargs, attn_implementation=cfg.attn_implementation, dtype=dtype)
    if cfg.device_map:
        load["device_map"] = cfg.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **load)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"cannot load {role} {path!r}: {str(exc).splitlines()[0]}") from None
    if not cfg.device_map:
        model.to(device)
    model.eval()
    return model, tokenizer, path


def refuse_recurrent(config, path: str) -> None:
    layer_types = set(getattr(config, "layer_types", None) or [])
    recurrent = (config.model_type in RECURRENT_MODEL_TYPES
                 or layer_types & {"mamba", "linear_attention", "conv", "recurrent", "mamba2"})
    if recurrent:
        raise ConfigError(f"{path!r} (model_type={config.model_type}) keeps a recurrent state that "
                          f"cannot be rolled back token by token, so rejected drafts cannot be "
                          f"undone; specflow needs an attention model with a KV cache")


class HFBackend(Backend):
    name = "hf"

    def __init__(self, cfg: HFModelConfig, device: torch.device, slots: int, role: str = "model"):
        self.model, tok, self.path = load_model(cfg, device, role)
        config = self.model.config
        self.device = self.model.device
        eos = getattr(self.model.generation_config, "eos_token_id", None) or tok.eos_token_id
        eos_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.tokenizer = HFTokenizer(tok, eos_ids)
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else next(iter(eos_ids), None)
        self.eos_token_ids = eos_ids
        self.vocab_size = config.vocab_size
        self.max_length = getattr(config, "max_position_embeddings", None)
        num_layers = config.num_hidden_layers
        # a little headroom past the context for the k+1 positions a last round may write
        self.cache = SlotKVCache(num_layers, slots, (self.max_length or 1 << 16) + 64)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self._bool_mask = cfg.attn_implementation == "sdpa"
        self.lean = self._lean_forward(cfg.forward, role)

    def _lean_forward(self, choice: str, role: str):
        from specflow.models.lean_llama import LeanLlama, unsupported_reason

        if choice == "hf":
            return None
        reason = unsupported_reason(self.model.config)
        if reason is None:
            self._bool_mask = True
            return LeanLlama(self.model)
        if choice == "lean":
            raise ConfigError(f"{role}.forward=lean does not support {self.path!r}: {reason}; "
                              f"use {role}.forward=hf")
        self.forward_note = f"transformers forward ({reason})"
        return None

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)

    def cache_length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    @torch.inference_mode()
    def forward(self, slots: torch.Tensor, input_ids: torch.Tensor,
                input_lens: torch.Tensor, logits: bool = True) -> torch.Tensor | None:
        B, T = input_ids.shape
        slot_list = slots.tolist()
        lens = input_lens.tolist()
        positions, kv_len = self.cache.begin(slot_list, lens, T, self.device)    # [B, T]
        keys = torch.arange(kv_len, device=self.device)                              # [L]
        allowed = keys[None, None, :] <= positions[:, :, None]                       # [B, T, L]
        mask = allowed[:, None] if self._bool_mask else torch.zeros(
            B, 1, T, kv_len, dtype=self.model.dtype, device=self.device).masked_fill(
            ~allowed[:, None], torch.finfo(self.model.dtype).min)
        if B == 1 and T == 1:
            mask = None          # one query attends to the whole cached row
        ids = input_ids.clamp(min=0).to(self.device)
        if self.lean is not None:
            out = self.lean(ids, positions, mask, self.cache, logits_to_keep=0 if logits else 1)
            self.cache.commit(slot_list, lens)
            return out.float() if logits else None
        extra = {self._cache_kw: self.cache}
        if not logits and self._keeps_logits:
            extra["logits_to_keep"] = 1      # prefill: skip the LM head over the whole prompt
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         use_cache=True, **extra)
        self.cache.commit(slot_list, lens)
        return out.logits.float() if logits else None                                # [B, T, V]

    def prefill(self, slot: int, ids: list[int]) -> None:
        if ids:
            self.forward(torch.tensor([slot]), torch.tensor([ids]), torch.tensor([len(ids)]),
                         logits=False)

    def truncate(self, slots: torch.Tensor, lengths: list[int]) -> None:
        self.cache.truncate(slots.tolist(), lengths)


def check_same_tokenizer(target: HFBackend, draft: HFBackend) -> None:
    """A draft must share the target's tokenizer: vocabulary, special tokens, encodings."""
    a, b = target.tokenizer.tok, draft.tokenizer.tok
    problems = []
    if len(a) != len(b):
        problems.append(f"vocabulary {len(a)} vs {len(b)}")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(a, attr, None) != getattr(b, attr, None):
            problems.append(f"{attr} {getattr(a, attr, None)} vs {getattr(b, attr, None)}")
    for sample in ("def fib(n):\n    return n", "Hello, world! 123", "  über   café\t"):
        if a(sample)["input_ids"] != b(sample)["input_ids"]:
            problems.append(f"encodings of {sample!r} differ")
            break
    if problems:
        raise ConfigError(f"draft {draft.path!r} does not share the tokenizer of target "
                          f"{target.path!r} ({'; '.join(problems)}); pick a draft from the "
                          f"target's family")
