"""Where specflow's files are: the demo pair shipped inside the package, and the cache folder
(converted GGUF models, the built native kernel, the times of the choices made at start). A leaf:
it imports nothing of specflow's, so any module may ask it."""
from __future__ import annotations

import os
import pathlib

DEMO_DIR = pathlib.Path(__file__).resolve().parent / "models" / "demo"   # target/, draft/, eagle/
CACHE_ENV = "SPECFLOW_CACHE"            # where the cache goes (default ~/.cache/specflow)


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "specflow")
