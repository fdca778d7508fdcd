"""`policy=schedule`: k from the number of running sequences, as vLLM / TensorRT-LLM configure it.

`ranges` lists upper batch-size bounds with their k, in increasing order; the last bound may be
null (no limit). k = 0 switches speculation off in that range. `specflow calibrate` writes one
(`policy=calibrated`) from a load sweep on the actual model pair and machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl


@dataclass
class BatchRange:
    up_to: int | None = None   # running sequences <= up_to (null: any number)
    k: int = 0


@dataclass
class SchedulePolicyConfig:
    name: str = "schedule"
    ranges: list[BatchRange] = field(default_factory=lambda: [BatchRange(4, 4), BatchRange(16, 2),
                                                              BatchRange(None, 0)])

    def __post_init__(self) -> None:
        if not self.ranges:
            raise ConfigError("policy.ranges is empty; give [{up_to: N, k: K}, ...]")
        bounds = [r.up_to for r in self.ranges]
        if any(b is None for b in bounds[:-1]):
            raise ConfigError("policy.ranges: only the last range may have up_to: null")
        finite = [b for b in bounds if b is not None]
        if any(b < 1 for b in finite) or finite != sorted(set(finite)):
            raise ConfigError(f"policy.ranges up_to bounds {bounds} must be >= 1 and strictly "
                              f"increasing; order the ranges by batch size")
        for r in self.ranges:
            if r.k < 0:
                raise ConfigError(f"policy.ranges has k={r.k}; k must be >= 0 (0 = off)")


def k_for_batch(ranges: list[BatchRange], running: int) -> int:
    for r in ranges:
        if r.up_to is None or running <= r.up_to:
            return r.k
    return 0          # above the last bound: off


class SchedulePolicy:
    def __init__(self, cfg: SchedulePolicyConfig, ctx=None):
        self.ranges = [r if isinstance(r, BatchRange) else BatchRange(**r) for r in cfg.ranges]

    @hookimpl
    def specflow_draft_length(self, batch):
        return torch.full((batch.size,), k_for_batch(self.ranges, batch.size), dtype=torch.long)
