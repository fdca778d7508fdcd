"""Tokenizers loaded ahead of their models (the checks before any weights load) and handed to the
model's load once, and the comparison that tells whether a draft shares its target's tokenizer."""
from __future__ import annotations

_loaded: dict[str, object] = {}      # resolved folder -> tokenizer, until its model loads


def load_tokenizer(folder: str, trust_remote_code: bool = False):
    """The transformers tokenizer of a resolved model folder (kept for the model's load), or
    None when it cannot be loaded: the model's load then says why, in its own words."""
    if folder not in _loaded:
        from transformers import AutoTokenizer

        try:
            _loaded[folder] = AutoTokenizer.from_pretrained(
                folder, trust_remote_code=trust_remote_code, local_files_only=True)
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
