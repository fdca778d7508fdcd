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


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in
    (GPT-2, Llama 3, Qwen, the demo pair): printable Latin-1 bytes stand for themselves, the other
    68 bytes for U+0100.. in byte order ("Ġ" is the space, "Ċ" the newline)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


_BYTE_LEVEL = {ord(c): b for b, c in _gpt2_bytes_to_unicode().items()}  # for str.translate
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_specs(tok) -> list[dict]:
    """The fast tokenizer's decoder, flattened out of any Sequence (JSON specs; [] if none)."""
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return []
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:     # an unknown decoder object: its type name is all there is to go on
        return [{"type": type(decoder).__name__}]
    out, todo = [], [spec]
    while todo:
        d = todo.pop(0)
        if isinstance(d, dict) and d.get("type") == "Sequence":
            todo[:0] = d.get("decoders", [])
        elif isinstance(d, dict):
            out.append(d)
    return out


def token_spelling(tok) -> tuple:
    """How a token's bytes are read off its vocabulary string (mirrors outlines-core's
    TokenProcessor in Vocabulary.from_pretrained): ("byte_level",) for GPT-2-style byte-level BPE;
    ("sentencepiece", byte_fallback, ((old, new), ...)) for '▁'-spaced vocabularies, with <0xNN>
    byte tokens when byte_fallback; ("plain",) otherwise (the token's decoded string). Hashable: it
    is part of vocab_key."""
    specs = _decoder_specs(tok)
    kinds = {d.get("type") for d in specs}
    if "ByteLevel" in kinds:
        return ("byte_level",)
    if specs and kinds & {"ByteFallback", "Metaspace", "Replace"}:
        subs = []
        for d in specs:
            if d.get("type") == "Metaspace":
                subs.append((d.get("replacement", "▁"), " "))
            elif d.get("type") == "Replace" and isinstance(d.get("pattern"), dict) \
                    and "String" in d["pattern"]:
                subs.append((d["pattern"]["String"], d.get("content", "")))
        return ("sentencepiece", "ByteFallback" in kinds, tuple(subs))
    if specs:
        return ("plain",)
    if getattr(tok, "byte_decoder", None):                 # a slow GPT-2-style tokenizer
        return ("byte_level",)
    if getattr(tok, "sp_model", None) is not None:         # a slow SentencePiece tokenizer
        return ("sentencepiece", True, (("▁", " "),))
    return ("plain",)


def token_bytes_reader(tok, spelling: tuple | None = None):
    """token string -> the bytes it stands for in generated text."""
    spelling = spelling or token_spelling(tok)
    decoded = lambda token: tok.convert_tokens_to_string([token]).encode("utf-8")  # noqa: E731
    if spelling[0] == "byte_level":
        table = _BYTE_LEVEL
        byte_decoder = getattr(tok, "byte_decoder", None)
        if byte_decoder and not getattr(tok, "backend_tokenizer", None):
            table = {ord(c): b for c, b in byte_decoder.items()}
        chars = frozenset(map(chr, table))

        def read(token: str) -> bytes:
            if set(token) <= chars:
                return token.translate(table).encode("latin-1")
            return decoded(token)       # not byte-level spelled (an added token, say)
        return read
    if spelling[0] == "sentencepiece":
        byte_fallback, subs = spelling[1], spelling[2]

        def read(token: str) -> bytes:
            if byte_fallback and (m := _HEX_BYTE.fullmatch(token)):
                return bytes([int(m.group(1), 16)])
            for old, new in subs:
                token = token.replace(old, new)
            return token.encode("utf-8")
        return read
    return decoded


def token_bytes(tok, eos_id: int) -> dict[bytes, list[int]]:
    """The bytes each token of a transformers tokenizer stands for -> its ids (EOS and special
    tokens kept apart). outlines-core matches the regex on UTF-8 bytes, so a token holding part of
    a multi-byte character (byte-level BPE, <0xNN> byte fallback) is a step through that character
    rather than an unusable U+FFFD. Added (non-special) tokens are spelled by their content."""
    read = token_bytes_reader(tok)
    added = {i: t.content for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()}
    vocab: dict[bytes, list[int]] = {}
    special = set(getattr(tok, "all_special_ids", []) or [])
    for token, i in tok.get_vocab().items():
        if i in special or i == eos_id:
            continue
        spelled = added[i].encode("utf-8") if i in added else read(token)
        if spelled:
            vocab.setdefault(spelled, []).append(i)
    return vocab


def tokenizer_vocabulary(tok, eos_id: int):
    """outlines_core Vocabulary of a transformers tokenizer (token_bytes)."""
    from outlines_core import Vocabulary

    return Vocabulary(eos_id, token_bytes(tok, eos_id))


_VOCABS: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_MAX_VOCABS = 8       # tokenizers whose vocabularies stay cached (least recently used dropped)


def vocab_key(tokenizer, eos_id: int) -> tuple:
    """What a transformers tokenizer's vocabulary depends on: the token -> id table and EOS
    (never `id(tokenizer)`, which Python reuses for a new object once the old one is freed)."""
    special = tuple(sorted(getattr(tokenizer, "all_special_ids", []) or []))
    return (type(tokenizer).__name__, eos_id, len(tokenizer), special, token_spelling(tokenizer),
            hash(tuple(sorted(tokenizer.get_vocab().items()))))


def grammar_vocabulary(tokenizer, eos_id: int):
    """The GrammarVocabulary a grammar compiles over: the one a backend's tokenizer declares
    (backends/contract.py), or a transformers tokenizer's own."""
    from specflow.backends.contract import GrammarVocabulary
    from specflow.backends.contract import grammar_vocabulary as declared

    if isinstance(tokenizer, GrammarVocabulary):
        return tokenizer
    found = declared(tokenizer, eos_id)
    if found is not None:
        return found
    return GrammarVocabulary(vocab_key(tokenizer, eos_id), lambda: token_bytes(tokenizer, eos_id))


def vocabulary_for(vocabulary, eos_id: int):
    """outlines_core's Vocabulary for a GrammarVocabulary (cached by its key); its key."""
    from outlines_core import Vocabulary

    key = (eos_id, vocabulary.key)
    if key not in _VOCABS:
        _VOCABS[key] = Vocabulary(eos_id, vocabulary.spell())
        if len(_VOCABS) > _MAX_VOCABS:
            _VOCABS.popitem(last=False)
            _compile.cache_clear()           # indexes over the dropped vocabulary go too
    _VOCABS.move_to_end(key)
    return key


@functools.lru_cache(maxsize=64)
def _compile(regex: str, vocab_key: tuple):
    from outlines_core import Index

    return Index(regex, _VOCABS[vocab_key])


def compile_index(regex: str, tokenizer, eos_id: int, what: str):
    """The Index for `regex` over `tokenizer`'s grammar vocabulary (a GrammarVocabulary, a
    backend's tokenizer, or a transformers tokenizer; cached); `what` names the config value in
    errors."""
    key = vocabulary_for(grammar_vocabulary(tokenizer, eos_id), eos_id)
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
        try:
            import pydantic
            is_model = isinstance(cls, type) and issubclass(cls, pydantic.BaseModel)
        except ImportError:
            raise ConfigError("constraint.model needs pydantic; pip install pydantic, or give "
                              "the JSON Schema as constraint.schema") from None
        if not is_model:
            raise ConfigError(f"constraint.model={model!r} is not a pydantic model class (a "
                              f"subclass of pydantic.BaseModel); give one, or the JSON Schema as "
                              f"constraint.schema")
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
