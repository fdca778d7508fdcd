"""Compiling constraints: JSON Schema / regex / choice -> an outlines_core Index over a tokenizer.

An Index (a DFA over token ids) is built once per (regex, tokenizer) and cached in the process;
building the vocabulary view of a tokenizer is cached the same way. Errors are one line: an invalid
schema, an invalid regex, or a regex the tokenizer's tokens cannot spell.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import re

from specflow.errors import ConfigError


def tokenizer_vocabulary(tok, eos_id: int):
    """outlines_core Vocabulary: each token's decoded string -> its ids (EOS kept apart)."""
    from outlines_core import Vocabulary

    vocab: dict[str, list[int]] = {}
    special = set(getattr(tok, "all_special_ids", []) or [])
    for token, i in tok.get_vocab().items():
        if i in special:
            continue
        vocab.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
    return Vocabulary(eos_id, vocab)


_VOCABS: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_MAX_VOCABS = 8       # tokenizers whose vocabularies stay cached (least recently used dropped)


def vocab_key(tokenizer, eos_id: int) -> tuple:
    """What the vocabulary depends on: the token -> id table and EOS (never `id(tokenizer)`,
    which Python reuses for a new object once the old one is freed)."""
    tok = getattr(tokenizer, "tok", tokenizer)
    special = tuple(sorted(getattr(tok, "all_special_ids", []) or []))
    return (type(tok).__name__, eos_id, len(tok), special,
            hash(tuple(sorted(tok.get_vocab().items()))))


def vocabulary_for(tokenizer, eos_id: int, key: tuple | None = None):
    key = key or vocab_key(tokenizer, eos_id)
    if key not in _VOCABS:
        _VOCABS[key] = tokenizer_vocabulary(tokenizer, eos_id)
        if len(_VOCABS) > _MAX_VOCABS:
            _VOCABS.popitem(last=False)
            _compile.cache_clear()           # indexes over the dropped vocabulary go too
    _VOCABS.move_to_end(key)
    return _VOCABS[key]


@functools.lru_cache(maxsize=64)
def _compile(regex: str, vocab_key: tuple):
    from outlines_core import Index

    return Index(regex, _VOCABS[vocab_key])


def compile_index(regex: str, tokenizer, eos_id: int, what: str):
    """The Index for `regex` over `tokenizer` (cached); `what` names the config value in errors."""
    key = vocab_key(tokenizer, eos_id)
    vocabulary_for(tokenizer, eos_id, key)
    try:
        index = _compile(regex, key)
    except ValueError as exc:
        text = str(exc).splitlines()[0]
        if "incompatible with the regex" in text:
            raise ConfigError(f"{what} can only be written with characters this tokenizer's tokens "
                              f"do not spell ({text.split('. ')[1] if '. ' in text else text}); "
                              f"change the pattern") from None
        raise ConfigError(f"{what} is not a regex the constraint engine accepts ({text}); "
                          f"fix the pattern") from None
    if not index.get_allowed_tokens(index.get_initial_state()):
        raise ConfigError(f"{what} cannot match anything this tokenizer can produce; change it")
    return index


def choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def load_schema(schema: str | None, model: str | None) -> str:
    """A JSON Schema as text, from inline JSON, a .json file path, or a pydantic model path."""
    if model:
        from specflow.stages.hf_processor import import_object

        cls = import_object(model)
        if not hasattr(cls, "model_json_schema"):
            raise ConfigError(f"constraint.model={model!r} is not a pydantic model class")
        return json.dumps(cls.model_json_schema())
    if not schema:
        raise ConfigError("constraint=json_schema needs constraint.schema (inline JSON or a .json "
                          "path) or constraint.model (a pydantic model's import path)")
    text = schema
    if not schema.lstrip().startswith("{"):
        path = os.path.expanduser(schema)
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(f"constraint.schema={schema!r} is neither inline JSON nor a readable "
                              f"file ({exc.strerror})") from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"constraint.schema is not valid JSON ({exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno})") from None
    import jsonschema

    try:
        jsonschema.validators.validator_for(parsed).check_schema(parsed)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ConfigError(f"constraint.schema is not a valid JSON Schema at {where}: "
                          f"{exc.message.splitlines()[0]}; fix the schema there") from None
    return json.dumps(parsed)


def schema_regex(schema_text: str, whitespace_pattern: str | None) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(schema_text, whitespace_pattern)
    except Exception as exc:  # outlines_core raises several types for unsupported schemas
        raise ConfigError(f"constraint.schema cannot be turned into a grammar: "
                          f"{str(exc).splitlines()[0]}") from None
