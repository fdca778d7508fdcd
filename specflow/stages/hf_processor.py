"""`logits=[hf]`: run any transformers LogitsProcessor class (by import path) as a specflow stage.

The processor is called once per shaped position with that position's own prefix as `input_ids`
[1, L] (so HF processors that read the prefix stay exact under speculation); slower than the
vectorised built-ins, and the way to bring a processor specflow does not have.
"""
from __future__ import annotations

import importlib
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


class HFLogitsProcessor:
    def __init__(self, cfg: HFProcessorConfig, ctx=None):
        cls = import_object(cfg.class_path)
        try:
            self.processor = cls(**dict(cfg.kwargs))
        except TypeError as exc:
            raise ConfigError(f"{cfg.class_path}({cfg.kwargs}) failed: {exc}; fix "
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
