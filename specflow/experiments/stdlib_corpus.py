"""The Python standard library as a code corpus: every machine has it, offline.

The demo pair was trained on it without test packages; about 2% of the files (a stable hash of
the path) are held out and never trained on: the benchmark prompts (`workload=code`) come from
those. `workload=stdlib` gives prompts from the training split, for training draft heads on the
demo target without touching the held-out files.
"""
from __future__ import annotations

import pathlib
import sysconfig
import zlib
from dataclasses import dataclass

from specflow.errors import ConfigError

EXCLUDED_PARTS = ("test", "tests", "idle_test", "site-packages", "lib2to3")


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
    """(path relative to the stdlib, path) of its .py files, test packages excluded, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p in EXCLUDED_PARTS or p.startswith("test_") for p in parts):
            continue
        out.append((rel, path))
    return out


def is_heldout(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % 50 == 0


@dataclass
class StdlibWorkloadConfig:
    name: str = "stdlib"
    limit: int = 512          # prompts, spread over the training files
    chars: int = 600          # each prompt: a run of whole lines of about this many characters

    def __post_init__(self) -> None:
        if self.limit < 1 or self.chars < 16:
            raise ConfigError(f"workload.limit={self.limit} must be >= 1 and workload.chars="
                              f"{self.chars} >= 16")


class StdlibWorkload:
    def __init__(self, cfg: StdlibWorkloadConfig, ctx=None):
        self.cfg = cfg

    def prompts(self) -> list[str]:
        """Chunks of whole lines from the training files, taken round-robin over the files
        (deterministic), so the prompts cover the corpus rather than its first files."""
        chunks: list[list[str]] = []
        for rel, path in stdlib_files():
            if is_heldout(rel):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            mine, cur = [], ""
            for line in text.splitlines(keepends=True):
                cur += line
                if len(cur) >= self.cfg.chars:
                    mine.append(cur)
                    cur = ""
            if mine:
                chunks.append(mine)
        out: list[str] = []
        depth = 0
        while len(out) < self.cfg.limit and any(depth < len(c) for c in chunks):
            out += [c[depth] for c in chunks if depth < len(c)]
            depth += 1
        if not out:
            raise ConfigError("workload=stdlib found no Python standard library files here")
        return out[:self.cfg.limit]
