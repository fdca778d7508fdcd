"""`logits=[hf]`: run any transformers LogitsProcessor class (by import path) as a specflow stage.

`class_path` imports a module, so a config is code: never build one from untrusted input. Only a
subclass of transformers.LogitsProcessor is called; any other object is refused.

The processor is called once per shaped position with that position's own prefix as `input_ids`
[1, L] (so HF processors that read the prefix stay exact under speculation); slower than the
vectorised built-ins, and the way to bring a processor specflow does not have.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl


@dataclass
class HFProcessorConfig:
    name: str = "hf"
    class_path: str = "???"                 # e.g. transformers.RepetitionPenaltyLogitsProcessor
    kwargs: dict[str, Any] = field(default_factory=dict)
    samples: bool = False                   # true: it only reshapes sampling (skipped under greedy)


def import_object(path: str):
    module, _, name = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot import {path!r}: {exc}; give module.Class") from None


def processor_class(path: str):
    """The class at `path`, which must subclass transformers.LogitsProcessor: any other object
    (a function such as os.system, a builtin, another class) is refused before it is called."""
    from transformers import LogitsProcessor

    obj = import_object(path)
    if not isinstance(obj, type) or not issubclass(obj, LogitsProcessor):
        if isinstance(obj, type):
            what = f"the class {obj.__module__}.{obj.__qualname__}"
        elif inspect.ismodule(obj):
            what = "a module"
        elif callable(obj):
            what = f"the function {getattr(obj, '__qualname__', type(obj).__name__)}"
        else:
            what = f"a {type(obj).__name__} value"
        raise ConfigError(f"logits.hf.class_path={path!r} is {what}, not a subclass of "
                          f"transformers.LogitsProcessor; give a LogitsProcessor class, e.g. "
                          f"transformers.RepetitionPenaltyLogitsProcessor")
    return obj


class HFLogitsProcessor:
    def __init__(self, cfg: HFProcessorConfig, ctx=None):
        cls = processor_class(cfg.class_path)
        try:
            self.processor = cls(**dict(cfg.kwargs))
        except (TypeError, ValueError) as exc:   # a missing or unknown argument, a bad value
            message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"{cfg.class_path}({dict(cfg.kwargs)}) failed: {message}; fix "
                              f"logits.hf.kwargs") from None
        self.samples = cfg.samples

    @hookimpl
    def specflow_process_logits(self, shaping):
        logits = shaping.logits.clone()                                     # [B, P, V]
        B, P, _ = logits.shape
        for b in range(B):
            for p in range(P):
                ids = torch.tensor([shaping.prefix(b, p)], device=logits.device)       # [1, L]
                logits[b, p] = self.processor(ids, logits[b, p][None])[0]
        shaping.logits = logits
