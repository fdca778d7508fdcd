"""Files that are either complete or absent (write to a temporary name, then rename), and run
folders that belong to one process at a time."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
from typing import Any, Iterator

from omegaconf import OmegaConf

try:
    import fcntl
except ImportError:       # pragma: no cover - Windows: run folders are not locked
    fcntl = None


def _umask() -> int:
    try:                        # Linux says it without changing it (no window for other threads)
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)      # elsewhere reading it means setting it: put it straight back
    os.umask(mask)
    return mask


def permit_as_opened(folder: str | os.PathLike) -> None:
    """Give a folder written under mkdtemp (0700) and its files (safetensors writes 0600) the
    permissions mkdir and open() would have: a shared cache others may read, as the umask says."""
    mask = _umask()
    folder = pathlib.Path(folder)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    os.chmod(folder, 0o777 & ~mask)


def atomic_write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    """Write `path` whole or not at all (a temporary file renamed over it), with the permissions
    an ordinary open() would give (mkstemp's own are 0600)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
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
        try:
            self.fh.close()
        except OSError:           # a full disk fails the flush again: keep the first error
            if exc[0] is None:
                raise


# --- run folders ----------------------------------------------------------------------------------
# A run folder (`hydra.run.dir`, an ab job's folder) belongs to one process at a time: it holds an
# exclusive flock on LOCK_NAME for the whole run, and the kernel drops it when the process dies.
# Default folders are unique (conf/config.yaml: `${now:%H-%M-%S}-${specflow_unique:}`), so two runs
# started in the same second get two folders.

LOCK_NAME = ".specflow.lock"


def _unique() -> str:
    """A suffix no other run shares: this process's id and a random part (the random part tells
    two runs of one process, or processes of two machines on a shared disk, apart)."""
    import secrets

    return f"{os.getpid()}-{secrets.token_hex(2)}"


# cached per config, like Hydra's own `now`, so every read of hydra.run.dir gives one folder (and
# Hydra copies the cache into each multirun job's config)
if not OmegaConf.has_resolver("specflow_unique"):
    OmegaConf.register_new_resolver("specflow_unique", _unique, use_cache=True)


def _os_reason(exc: OSError, path: pathlib.Path) -> str:
    if path.exists() and not path.is_dir():
        return "it is a file, not a folder"
    if isinstance(exc, NotADirectoryError):
        return "a part of that path is a file, not a folder"
    return exc.strerror or str(exc)


def writable_folder(folder: str | os.PathLike, setting: str = "hydra.run.dir") -> pathlib.Path:
    """Create `folder` (and its parents) and check a file can be written in it; an InputError
    naming the folder and `setting` (the option to change) when not."""
    from specflow.errors import InputError

    path = pathlib.Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".specflow-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"cannot write to {setting}={folder}: {_os_reason(exc, path)}; "
                         f"choose a folder you can write with {setting}=...") from None
    return path


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, what: str = "specflow run",
                setting: str = "hydra.run.dir") -> Iterator[pathlib.Path]:
    """Hold `folder` for this process (an exclusive flock on folder/.specflow.lock); an InputError
    naming the folder, the process that holds it and the fix when another process does.
    Released on exit, and by the kernel when the process dies (no stale lock after a crash)."""
    from specflow.errors import InputError

    path = writable_folder(folder, setting)
    if fcntl is None:                 # no flock (Windows): run unlocked
        yield path
        return
    lock = path / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise InputError(f"cannot write to {setting}={folder}: {_os_reason(exc, lock)}; "
                         f"choose a folder you can write with {setting}=...") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
            by = f" (pid {holder})" if holder.isdigit() else ""
            raise InputError(f"{folder} is in use by another {what}{by}; wait for it to finish, "
                             f"or choose another {setting}=...") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)                  # closing the descriptor releases the lock


def check_folder_free(folder: str | os.PathLike, what: str = "specflow run",
                      setting: str = "hydra.run.dir") -> None:
    """Fail now, with folder_lock's line, when `folder` cannot be written or another process
    holds it (before Hydra writes its .hydra/ files there); does not keep the lock."""
    with folder_lock(folder, what, setting):
        pass


def json_type(value) -> str:
    """The JSON name of a parsed value's type (for messages: `a JSON array`, not `list`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def read_json(path: str | os.PathLike, name: str, fix: str, error: type = None) -> Any:
    """A JSON file's value, or one line naming `name`, what is wrong and `fix` (raised as `error`,
    default InputError): unreadable, not UTF-8, or not JSON."""
    from specflow.errors import InputError

    error = error or InputError
    try:
        return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"cannot read {name}: {exc.strerror}; {fix}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{name} is not UTF-8 text (bad byte at offset {exc.start}); {fix}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{name} is not valid JSON ({exc.msg}: line {exc.lineno} column "
                    f"{exc.colno}); {fix}") from None


def write_or_explain(path: pathlib.Path, writer, content, rerun: str, kept: int | None = None) -> None:
    """writer(path, content), or one line when the disk refuses it: what was kept, and how to
    finish (`rerun`)."""
    from specflow.errors import InputError

    try:
        writer(path, content)
    except OSError as exc:              # a full disk: the finished requests stay where they are
        kept_text = (f"all {kept} requests are kept" if kept is not None
                     else "the requests finished so far are kept")
        raise InputError(f"cannot write {path} ({exc.strerror or exc}); {kept_text} in "
                         f"{path.parent}/requests.jsonl: free some space, then {rerun} to "
                         f"finish") from None
