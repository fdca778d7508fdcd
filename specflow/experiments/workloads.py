"""Workloads: where prompts come from (`workload=demo`, `workload=file workload.path=...`)."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from specflow.errors import ConfigError, InputError
from specflow.io import json_type


@dataclass
class DemoWorkloadConfig:
    name: str = "demo"
    prompts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ConfigError("workload.prompts is empty; give at least one prompt")


@dataclass
class FileWorkloadConfig:
    name: str = "file"
    path: str = "???"
    field: str = "prompt"          # JSONL: the key holding the prompt (a list takes its first item)
    limit: int | None = None       # read at most this many prompts
    where: dict[str, str] | None = None   # JSONL: keep rows whose fields equal these, e.g. {category: qa}
    chat: str = "auto"             # wrap prompts in the tokenizer's chat template: auto | on | off

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"workload.limit={self.limit} must be >= 1 or null")
        if self.chat not in ("auto", "on", "off"):
            raise ConfigError(f"workload.chat={self.chat!r}; use auto, on or off")


class DemoWorkload:
    def __init__(self, cfg: DemoWorkloadConfig, ctx=None):
        self.cfg = cfg

    def prompts(self) -> list[str]:
        return list(self.cfg.prompts)


class FileWorkload:
    def __init__(self, cfg: FileWorkloadConfig, ctx=None):
        self.cfg = cfg

    def prompts(self) -> list[str]:
        return read_prompt_file(self.cfg.path, self.cfg.field, self.cfg.limit, self.cfg.where)


def chat_mode(cfg) -> str:
    """Whether prompts are wrapped in the tokenizer's chat template (auto | on | off): `chat` for
    an explicit prompt (`prompt=...`, `prompt=-`; auto by default, so an instruct model gets a
    user turn, as it expects), else the workload's own setting (off where it has none)."""
    if cfg.get("prompt") is not None:
        return str(cfg.get("chat", "auto"))
    if cfg.get("workload") is None:
        return "off"
    return str(cfg.workload.get("chat", "off"))


def apply_chat_template(prompts: list[str], tokenizer, mode: str) -> list[str]:
    """Wrap each prompt as one user turn with the tokenizer's chat template (`workload.chat`)."""
    tok = getattr(tokenizer, "tok", None)
    has = tok is not None and getattr(tok, "chat_template", None)
    if mode == "off" or (mode == "auto" and not has):
        return prompts
    if not has:
        raise ConfigError("workload.chat=on but this tokenizer has no chat template; use "
                          "workload.chat=auto or off")
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                    add_generation_prompt=True) for p in prompts]


def _shown(value, width: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[:width - 3] + "..."


def _prompt_of(obj, key: str, where: str) -> str:
    """The prompt in one JSONL row: a string, or the first item of a list of strings (turns)."""
    if not isinstance(obj, dict):
        shown = "" if obj is None else f" ({_shown(obj)})"
        raise InputError(f"{where}: a JSON {json_type(obj)}{shown}, not an object; "
                         f"give one JSON object a line with a string field {key!r} "
                         f"(workload.field)")
    if key not in obj:
        raise InputError(f"{where}: no field {key!r} (fields: {', '.join(obj) or 'none'}); "
                         f"set workload.field")
    value = obj[key]
    if isinstance(value, list):
        if not value:
            raise InputError(f"{where}: field {key!r} is an empty array; give a string (or an "
                             f"array whose first item is the prompt string)")
        value = value[0]
        key = f"{key}[0]"
    if not isinstance(value, str):
        shown = "" if value is None else f" ({_shown(value)})"
        raise InputError(f"{where}: field {key!r} is a JSON {json_type(value)}{shown}, not a "
                         f"string; every prompt must be a string")
    return value


def _matches(obj, where: dict) -> bool:
    """A row's fields equal the `where` values (compared as text; a missing field never does)."""
    return all(k in obj and str(obj[k]) == str(v) for k, v in where.items())


def read_prompt_file(path: str, key: str = "prompt", limit: int | None = None,
                     where: dict | None = None) -> list[str]:
    """Prompts from JSONL (`key` of each object) or from plain text (one prompt a line)."""
    p = pathlib.Path(path).expanduser()
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read prompt file {str(p)!r}: {exc.strerror}; check workload.path") from None
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0   # a byte-order mark is not part of a prompt
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"prompt file {str(p)!r} is not UTF-8 (bad byte at offset "
                         f"{exc.start + bom}); re-encode it as UTF-8") from None
    jsonl = p.suffix in (".jsonl", ".json")
    if where and not jsonl:
        raise InputError(f"workload.where={dict(where)} needs a JSONL file, but {str(p)!r} is "
                         f"plain text (one prompt a line); drop workload.where or give a .jsonl "
                         f"file")
    prompts: list[str] = []
    seen_keys: set = set()            # the fields of the rows (to say which `where` key is absent)
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{p}:{n}: not valid JSON ({exc.msg}); one JSON object a line") from None
            if where:
                if not isinstance(obj, dict):
                    _prompt_of(obj, key, f"{p}:{n}")          # refuses a row that is no object
                seen_keys |= set(obj)
                if not _matches(obj, where):
                    continue
            prompts.append(_prompt_of(obj, key, f"{p}:{n}"))
        else:
            prompts.append(line)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        absent = [k for k in (where or {}) if k not in seen_keys]
        if absent:
            raise InputError(f"prompt file {str(p)!r}: no row has the field {absent[0]!r} that "
                             f"workload.where filters on (fields: {', '.join(sorted(seen_keys))}); "
                             f"fix workload.where")
        raise InputError(f"prompt file {str(p)!r} has no prompts"
                         + (f" matching {dict(where)}" if where else "")
                         + "; give a file with one prompt per line or JSONL rows with a "
                           "prompt field (workload.field)")
    return prompts
