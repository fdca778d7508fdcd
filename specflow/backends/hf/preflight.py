"""Checks that need only config files, tokenizers and the prompts, made before any weights load:
a draft with another tokenizer (or the demo draft under another target), and a prompt longer
than the model's context, are one line in seconds instead of after minutes of loading.

The tokenizers loaded here are handed to the model load that follows (backends/hf/tokenizers.py), so
a run reads each one once.
"""
from __future__ import annotations

import os
import pathlib

from specflow.errors import ConfigError, InputError
from specflow.backends.hf.tokenizers import compare_tokenizers, load_tokenizer

def _same_path(a: str, b: pathlib.Path) -> bool:
    try:
        return pathlib.Path(os.path.expanduser(a)).resolve() == b.resolve()
    except (OSError, TypeError):
        return False


def _uses_transformers(node) -> bool:
    return node is not None and node.get("name") == "hf" and bool(node.get("path"))


def check_draft(cfg, prompts=None) -> None:
    """proposer=draft's draft model against the target, from their tokenizers alone."""
    from specflow.backends.hf.backend import resolve_path
    from specflow.paths import DEMO_DIR

    proposer, model, draft = cfg.get("proposer"), cfg.get("model"), cfg.get("draft")
    if proposer is None or proposer.get("name") != "draft" or not _uses_transformers(model) \
            or not _uses_transformers(draft):
        return
    target_path, draft_path = str(model.path), str(draft.path)
    if _same_path(draft_path, DEMO_DIR / "draft") and not _same_path(target_path,
                                                                      DEMO_DIR / "target"):
        raise ConfigError(no_draft_ships(target_path))
    a = load_tokenizer(resolve_path(target_path, "model"), bool(model.get("trust_remote_code")))
    b = load_tokenizer(resolve_path(draft_path, "draft"), bool(draft.get("trust_remote_code")))
    problems = compare_tokenizers(a, b) if a is not None and b is not None else []
    if problems:
        raise ConfigError(f"draft {draft_path!r} does not share the tokenizer of target "
                          f"{target_path!r} ({'; '.join(problems)}); pick a draft from the "
                          f"target's family")


def no_draft_ships(target_path: str) -> str:
    from specflow.backends.heads.eagle import demo_head_for

    class _Target:
        path = target_path

    head = ("proposer=eagle (its shipped EAGLE-3 head)" if demo_head_for(_Target) else
            "proposer=eagle with a head you train (specflow train-head)")
    return (f"proposer=draft (the default proposer) needs a draft model with the target's "
            f"tokenizer, and none ships for model.path={target_path!r} (draft=demo is the demo "
            f"target's own draft); use {head}, proposer=self (the target's own weights in int4), "
            f"proposer=ngram or proposer=none, or give a draft "
            f"of the target's family: draft=hf draft.path=<folder>")


def context_length(cfg, folder: str) -> int | None:
    """The target's context as its backend will serve it: config.json's
    max_position_embeddings, capped by model.max_model_len."""
    from specflow.io import read_json

    try:
        config = read_json(pathlib.Path(folder) / "config.json", "config.json", "", ConfigError)
    except ConfigError:
        return None          # the model's load says what is wrong with it
    limit = config.get("max_position_embeddings") if isinstance(config, dict) else None
    cap = cfg.model.get("max_model_len")
    if cap is not None:
        limit = min(limit or int(cap), int(cap))
    return limit


def check_prompts(cfg, prompts: list[str] | None) -> None:
    """A transformers target's prompts (as the run will send them: in the chat template where
    the config says so), each checked against the context before the weights load."""
    from specflow.experiments.workloads import apply_chat_template, chat_mode
    from specflow.backends.hf.backend import HFTokenizer, resolve_path

    model = cfg.get("model")
    if not prompts or not _uses_transformers(model):
        return
    folder = resolve_path(str(model.path), "model")
    tok = load_tokenizer(folder, bool(model.get("trust_remote_code")))
    limit = context_length(cfg, folder) if tok is not None else None
    if limit is None:
        return
    for i, prompt in enumerate(apply_chat_template(prompts, HFTokenizer(tok, frozenset()),
                                                   chat_mode(cfg))):
        n = len(tok(prompt)["input_ids"])
        if n >= limit:
            raise InputError(f"prompt {i} has {n} tokens but the model's context is {limit}; "
                             f"shorten the prompt")
