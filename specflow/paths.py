"""Where specflow's files are: the weights shipped inside the package (the demo pair, SmolLM2's
EAGLE head), and the cache folder
(converted GGUF models, the built native kernel, the times of the choices made at start). A leaf:
it imports nothing of specflow's, so any module may ask it."""
from __future__ import annotations

import os
import pathlib

WEIGHTS_DIR = pathlib.Path(__file__).resolve().parent / "weights"
DEMO_DIR = WEIGHTS_DIR / "demo"                       # target/, draft/, eagle/, prompts.jsonl
SMOLLM2_HEAD_DIR = WEIGHTS_DIR / "smollm2" / "eagle"  # the EAGLE-3 head for SmolLM2-135M-Instruct
CACHE_ENV = "SPECFLOW_CACHE"            # where the cache goes (default ~/.cache/specflow)


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "specflow")
