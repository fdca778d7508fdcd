"""Workloads: where prompts come from (`workload=demo`, `workload=file workload.path=...`)."""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field

from specflow.errors import ConfigError, InputError


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


def read_prompt_file(path: str, key: str = "prompt", limit: int | None = None,
                     where: dict | None = None) -> list[str]:
    """Prompts from JSONL (`key` of each object) or from plain text (one prompt a line)."""
    p = pathlib.Path(path).expanduser()
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read prompt file {str(p)!r}: {exc.strerror}; check workload.path") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"prompt file {str(p)!r} is not UTF-8 (bad byte at offset {exc.start}); "
                         f"re-encode it as UTF-8") from None
    prompts: list[str] = []
    jsonl = p.suffix in (".jsonl", ".json")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"{p}:{n}: not valid JSON ({exc.msg}); one JSON object a line") from None
            if where and any(str(obj.get(k)) != str(v) for k, v in where.items()):
                continue
            if key not in obj:
                raise InputError(f"{p}:{n}: no field {key!r} (fields: {', '.join(obj)}); "
                                 f"set workload.field") from None
            value = obj[key]
            prompts.append(value[0] if isinstance(value, list) else str(value))
        else:
            prompts.append(line)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise InputError(f"prompt file {str(p)!r} has no prompts"
                         + (f" matching {dict(where)}" if where else "")
                         + "; give a file with one prompt per line or JSONL rows with a "
                           "prompt field (workload.field)")
    return prompts
