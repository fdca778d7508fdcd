"""`policy=heuristic`: HF assisted generation's schedule, per sequence.

After a round where every draft was accepted, k grows by 2; after any rejection it shrinks by 1
(never below 1). HF applies this to one sequence; here each sequence keeps its own k.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl


@dataclass
class HeuristicPolicyConfig:
    name: str = "heuristic"
    k_start: int = 4           # ${proposer.k}
    k_max: int = 16

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ConfigError(f"policy.k_max={self.k_max} must be >= 0")
        if not 0 <= self.k_start <= self.k_max:
            raise ConfigError(f"policy.k_start={self.k_start} must be in [0, policy.k_max="
                              f"{self.k_max}]")


class HeuristicPolicy:
    def __init__(self, cfg: HeuristicPolicyConfig, ctx=None):
        self.cfg = cfg
        self.k: dict[int, int] = {}

    @hookimpl
    def specflow_draft_length(self, batch):
        return torch.tensor([self.k.get(r, self.cfg.k_start) for r in batch.request_ids],
                            dtype=torch.long)

    @hookimpl
    def specflow_observe(self, result):
        for rid, k, acc in zip(result.request_ids, result.draft_lengths(), result.num_accepted):
            if k == 0:
                continue
            step = 2 if acc == k else -1
            self.k[rid] = max(1, min(self.cfg.k_max, self.k.get(rid, self.cfg.k_start) + step))

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.k.pop(request.request_id, None)      # a fresh request never inherits state

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.k.pop(request.request_id, None)
