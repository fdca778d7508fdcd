"""What the choices timed at start measured, kept on disk per machine, model and settings, so
that a second run on the same machine starts without timing anything again.

The choices a pipeline makes when it is built (`kernels.pick()`'s product forms and the
one-query attention, `threads=auto`, `native=auto`, `pack=auto`, a draft model's layouts,
`policy=goodput`'s costs) time their alternatives, mostly in turns (backends/turns.py), on the
model's own weights: tens of seconds for SmolLM2 on a 2-core CPU, every run, for the same
outcome. Each of them goes through `recall()` (a `Choice` through `in_turns(key=...)`:
backends/choice.py): the measured times are kept in `<cache_root>/choices/` (`$SPECFLOW_CACHE`, default
~/.cache/specflow, beside the native kernel and the GGUF conversions), one small JSON file per
(choice, key), and read back while the key is the same. What is kept is the measurement, not
the decision: the chooser decides from the times read back as it does from fresh ones, so the
decision is the same one.

The key is the chooser's own (its settings: shapes, rows and positions, thread count, the
state the passes are timed in) plus the machine's (`machine()`: the CPU model and flags, the
cores this process may use, torch's and specflow's versions, the native kernel's source and
compiler) and, for passes of a model, the model's files (names, sizes, modification times:
`files()`). A change of any of them times again. A file that cannot be read, is not JSON,
holds another key or a value the chooser does not accept is ignored and rewritten, never an
error; files are written to a temporary name and renamed, so two processes writing the same
entry at once leave one whole file.

`retime` in the config (or `SPECFLOW_RETIME=1`) times every choice again and rewrites what is
kept: the first run after the machine was busy keeps what it measured then (a neighbour's load
turns a timing, backends/turns.py); the benchmarks (bench/*.py) time every choice again unless
SPECFLOW_RETIME is set. `SPECFLOW_CHOICE_CACHE=0` neither reads nor writes;
`SPECFLOW_CHOICE_DIR` keeps the times in a folder of its own (the test suite keeps a run's in a
temporary one). Only times read from the real clock are kept (a test's fake clock times afresh:
backends/choice.py). Where each choice's times came from is
recorded (`recording()`): a backend's `describe()` and metrics.json say `cache` or `timed`.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import pathlib
from typing import Any, Callable, Iterator, Mapping

RETIME_ENV = "SPECFLOW_RETIME"        # 1: time every choice again and rewrite what is kept
ENABLE_ENV = "SPECFLOW_CHOICE_CACHE"  # 0: neither read nor write
FOLDER_ENV = "SPECFLOW_CHOICE_DIR"    # where the times are kept, if not <cache_root>/choices
FOLDER = "choices"
FORMAT = 1                            # bumped when what an entry holds changes

_retime: contextvars.ContextVar[bool] = contextvars.ContextVar("specflow_retime", default=False)
_records: contextvars.ContextVar[tuple[dict, ...]] = contextvars.ContextVar("specflow_choices",
                                                                            default=())


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def retime_unless_told() -> None:
    """Time every choice again in this process, unless SPECFLOW_RETIME is set: a benchmark
    compares arms, and a choice kept from a busy machine slows one of them (a demo target's
    one-position pass kept from a loaded run decoded at 172 tokens/s, timed again at 270)."""
    os.environ.setdefault(RETIME_ENV, "1")


def forced() -> bool:
    """Whether choices are timed again now (the config's `retime`, or SPECFLOW_RETIME=1)."""
    return _retime.get() or os.environ.get(RETIME_ENV, "0") not in ("", "0")


@contextlib.contextmanager
def retiming(on: bool = True) -> Iterator[None]:
    """Within: every recall() times again (and rewrites its entry) when `on`."""
    token = _retime.set(bool(on) or _retime.get())
    try:
        yield
    finally:
        _retime.reset(token)


@contextlib.contextmanager
def recording(seen: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Within: each recall() notes its choice -> "cache" (every lookup read back) or "timed"
    (any of them measured) in `seen` (a new dict unless given; yielded), and in any recording()
    around this one."""
    seen = {} if seen is None else seen
    token = _records.set((*_records.get(), seen))
    try:
        yield seen
    finally:
        _records.reset(token)


def note(choice: str, source: str) -> None:
    """Record where `choice`'s times came from in the recordings open now ("cache": read back,
    here or from a chooser's own memo of this process; "timed")."""
    for seen in _records.get():
        if seen.get(choice) != "timed":
            seen[choice] = source


@functools.cache
def machine() -> dict:
    """What a timing depends on besides the choice's own settings: the CPU, the cores this
    process may use, the versions of torch and specflow, the native kernel's source and
    compiler."""
    import torch

    from specflow.backends.lean import native
    from specflow.version import __version__

    cpu = native._cpu_key()
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("model name")), "")
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        kernel = hashlib.sha256(native.SOURCE.read_bytes()).hexdigest()[:16]
    except OSError:
        kernel = None
    return {"cpu": model, "cpu_key": hashlib.sha256(cpu.encode()).hexdigest()[:16],
            "cores": cores, "torch": torch.__version__, "specflow": __version__,
            "kernel": kernel, "compiler": native._compiler(),
            "native": os.environ.get(native.ENV, "1") != "0"}


def files(folder: str | os.PathLike) -> list | str:
    """A model folder's identity for a key: each file's name, size and modification time (its
    content changes them), or the path itself where it is not a folder."""
    path = pathlib.Path(folder).expanduser()
    try:
        entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        return [str(path.resolve())] + [[p.name, (s := p.stat()).st_size, s.st_mtime_ns]
                                        for p in entries if p.is_file()]
    except OSError:
        return str(folder)


def _canonical(value: Any) -> Any:
    """`value` as JSON reads it back (tuples as lists, anything else as its str)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def folder() -> pathlib.Path:
    """$SPECFLOW_CHOICE_DIR where set (a test run keeps its own), else `<cache_root>/choices`."""
    from specflow.paths import cache_root

    own = os.environ.get(FOLDER_ENV)
    return pathlib.Path(own) if own else cache_root() / FOLDER


def entry(choice: str, key: Mapping) -> tuple[pathlib.Path, dict]:
    """The file that keeps `choice` under `key`, and the whole key it must hold."""
    full = _canonical({"format": FORMAT, "choice": choice, "machine": machine(), "key": key})
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in choice)
    return folder() / f"{name}-{digest}.json", full


def _read(path: pathlib.Path, full: dict, check: Callable[[Any], bool] | None) -> tuple[bool, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False, None                       # absent, torn or not JSON: time again
    if not isinstance(data, dict) or data.get("key") != full or "value" not in data:
        return False, None                       # another key (a hash collision) or another form
    value = data["value"]
    try:
        usable = check is None or bool(check(value))
    except Exception:                            # a value of the wrong shape: time again
        usable = False
    return usable, value


def _write(path: pathlib.Path, full: dict, value: Any) -> None:
    """Write the entry under a temporary name and rename it into place (specflow.io: a
    concurrent reader finds the old file or the new one, and of two writers one wins whole),
    with the permissions the umask gives. A cache that cannot be written leaves the run as it
    is."""
    from specflow.io import atomic_write_text

    try:
        atomic_write_text(path, json.dumps({"key": full, "value": value}, sort_keys=True))
    except (OSError, TypeError, ValueError):
        pass


def recall(choice: str, key: Mapping, measure: Callable[[], Any],
           check: Callable[[Any], bool] | None = None) -> Any:
    """What `measure()` returned when `choice` was last timed under `key` on this machine, or
    measure() now (kept for the next run) where nothing usable is kept, where `check` refuses
    what is, or where choices are timed again (`forced()`). measure() must return JSON (numbers,
    lists, dicts, strings): JSON's floats read back bit for bit, so a decision made from them is
    the one made from the fresh times."""
    if not enabled():
        note(choice, "timed")
        return measure()
    path, full = entry(choice, key)
    if not forced():
        found, value = _read(path, full, check)
        if found:
            note(choice, "cache")
            return value
    value = _canonical(measure())
    _write(path, full, value)
    note(choice, "timed")
    return value

