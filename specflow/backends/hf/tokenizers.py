"""Tokenizers loaded ahead of their models (the checks before any weights load) and handed to the
model's load once, and the comparison that tells whether a draft shares its target's tokenizer."""
from __future__ import annotations

import json
import pathlib

_loaded: dict[str, object] = {}      # resolved folder -> tokenizer, until its model loads


def config_view(folder: str):
    """transformers' generic config over the folder's config.json (its model type and every key
    as attributes), or None where the folder's own config class must be loaded (remote code,
    no model type, unreadable). AutoTokenizer given it chooses the class from the same fields
    it reads of the model's config class (the model type, the tokenizer config's class), and
    does not load that class: a model's config class imports transformers' model-loading stack
    (torch.distributed.tensor, torch._dynamo, sympy: ~60 MB and ~2 s; file_model.py)."""
    from transformers import PretrainedConfig

    try:
        raw = json.loads((pathlib.Path(folder) / "config.json").read_text())
        tokenizer = json.loads((pathlib.Path(folder) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(tokenizer, dict) \
            or not isinstance(raw.get("model_type"), str) or "auto_map" in raw \
            or "auto_map" in tokenizer or not isinstance(tokenizer.get("tokenizer_class"), str):
        return None
    try:
        config = PretrainedConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    except (TypeError, ValueError):
        return None
    config.model_type = raw["model_type"]
    config._name_or_path = folder              # as from_pretrained sets it
    return config


def open_tokenizer(folder: str, trust_remote_code: bool = False):
    """AutoTokenizer's tokenizer of a resolved folder (raises what it raises)."""
    from transformers import AutoTokenizer

    kwargs = dict(trust_remote_code=trust_remote_code, local_files_only=True)
    view = None if trust_remote_code else config_view(folder)
    if view is not None:
        kwargs["config"] = view
    return AutoTokenizer.from_pretrained(folder, **kwargs)


def load_tokenizer(folder: str, trust_remote_code: bool = False):
    """The transformers tokenizer of a resolved model folder (kept for the model's load), or
    None when it cannot be loaded: the model's load then says why, in its own words."""
    if folder not in _loaded:
        try:
            _loaded[folder] = open_tokenizer(folder, trust_remote_code)
        except Exception:     # the tokenizers library raises plain Exception on bad files
            return None
    return _loaded[folder]


def take_tokenizer(folder: str):
    """The tokenizer a check loaded for this folder, once (None when none did)."""
    return _loaded.pop(folder, None)


def compare_tokenizers(a, b) -> list[str]:
    """How two tokenizers differ: vocabulary, special tokens, encodings ([] when they agree)."""
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
    return problems
