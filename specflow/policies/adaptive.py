"""`policy=adaptive`: the DraftLengthController of article A (docs/design.md §6), per sequence, with hysteresis on load.

Each request keeps an EWMA of its acceptance (accepted / examined drafts). Its k maximises the
expected speedup (1 - a^(k+1)) / ((1 - a)(k c + 1)) over 0..k_max, with c the draft cost relative
to a target step. Above `off_above_batch` running sequences speculation is off (k = 0) for every
row; it comes back only once the batch falls to `on_below_batch`, so it does not flap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.metrics import expected_tokens
from specflow.plugins import hookimpl


def expected_speedup(a: float, k: int, c: float) -> float:
    """Tokens per round over round cost, relative to plain decoding (article A's `speedup`, docs/design.md §6)."""
    return expected_tokens(a, k) / (k * c + 1)


def best_k(a: float, k_max: int, c: float) -> int:
    a = min(a, 0.95)   # as the seed: never trust an estimate of perfect acceptance
    return max(range(0, k_max + 1), key=lambda k: expected_speedup(a, k, c))


@dataclass
class AdaptivePolicyConfig:
    name: str = "adaptive"
    k_max: int = 6
    off_above_batch: int = 48      # k = 0 for every row at this many running sequences or more
    on_below_batch: int = 40       # back on when the batch falls to this many or fewer
    ewma: float = 0.1              # weight of the newest round in the acceptance estimate
    initial_acceptance: float = 0.7
    draft_cost: float = 0.1        # c, until measured costs feed the goodput policy

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ConfigError(f"policy.k_max={self.k_max} must be >= 0")
        if not 0 < self.ewma <= 1:
            raise ConfigError(f"policy.ewma={self.ewma} must be in (0, 1]")
        if not 0 <= self.initial_acceptance <= 1:
            raise ConfigError(f"policy.initial_acceptance={self.initial_acceptance} must be in [0, 1]")
        if self.on_below_batch > self.off_above_batch:
            raise ConfigError(f"policy.on_below_batch={self.on_below_batch} is above "
                              f"policy.off_above_batch={self.off_above_batch}; thresholds must be "
                              f"ordered on_below_batch <= off_above_batch")
        if self.draft_cost < 0:
            raise ConfigError(f"policy.draft_cost={self.draft_cost} must be >= 0")


class AdaptivePolicy:
    def __init__(self, cfg: AdaptivePolicyConfig, ctx=None):
        self.cfg = cfg
        self.acceptance: dict[int, float] = {}
        self.speculating = True

    def k_for(self, request_id: int) -> int:
        a = self.acceptance.get(request_id, self.cfg.initial_acceptance)
        return best_k(a, self.cfg.k_max, self.cfg.draft_cost)

    @hookimpl
    def specflow_draft_length(self, batch):
        running = batch.size
        if self.speculating and running >= self.cfg.off_above_batch:
            self.speculating = False
        elif not self.speculating and running <= self.cfg.on_below_batch:
            self.speculating = True
        if not self.speculating:
            return torch.zeros(batch.size, dtype=torch.long)
        return torch.tensor([self.k_for(r) for r in batch.request_ids], dtype=torch.long)

    @hookimpl
    def specflow_observe(self, result):
        w = self.cfg.ewma
        for rid, k, acc in zip(result.request_ids, result.draft_lengths(), result.num_accepted):
            old = self.acceptance.get(rid, self.cfg.initial_acceptance)
            if k > 0:
                self.acceptance[rid] = (1 - w) * old + w * acc / min(acc + 1, k)
            elif self.speculating:
                # a row switched off for poor acceptance drifts back to the prior and is probed
                # again, so one bad stretch does not end speculation for the whole request
                self.acceptance[rid] = (1 - w) * old + w * self.cfg.initial_acceptance

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.acceptance.pop(request.request_id, None)      # a fresh request never inherits state

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.acceptance.pop(request.request_id, None)
