"""`policy=static`: the same k for every row, every round."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl


@dataclass
class StaticPolicyConfig:
    name: str = "static"
    k: int = 4          # defaults to ${proposer.k} in conf/policy/static.yaml

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"policy.k={self.k} must be >= 0 (0 = plain decoding)")


class StaticPolicy:
    def __init__(self, cfg: StaticPolicyConfig, ctx=None):
        self.k = cfg.k

    @hookimpl
    def specflow_draft_length(self, batch):
        return torch.full((batch.size,), self.k, dtype=torch.long)
