"""Files that are either complete or absent: write to a temporary name, then rename."""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> pathlib.Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, default=_default) + "\n")


def _default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


class JsonlWriter:
    """Append one JSON object per line, flushed at once, so an interrupted run keeps every line
    it wrote; the file is created empty (a re-run starts it again)."""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.append = append     # resuming: keep the lines an earlier session wrote
        self.fh = None

    def __enter__(self) -> "JsonlWriter":
        self.fh = open(self.path, "a" if self.append else "w", encoding="utf-8")
        return self

    def write(self, obj: Any) -> None:
        self.fh.write(json.dumps(obj, default=_default) + "\n")
        self.fh.flush()

    def __exit__(self, *exc) -> None:
        self.fh.close()
