"""`policy=oracle`: the goodput rule fed the synthetic pair's true acceptance and costs, the
yardstick of the policy experiment (what goodput would choose if it learned nothing wrong)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specflow.errors import ConfigError
from specflow.policies.goodput.policy import GoodputPolicy, GoodputPolicyConfig


@dataclass
class OraclePolicyConfig(GoodputPolicyConfig):
    name: str = "oracle"


class OraclePolicy(GoodputPolicy):
    """The goodput rule with the synthetic pair's true acceptance and costs (experiments only)."""

    def __init__(self, cfg: OraclePolicyConfig, ctx):
        from specflow.backends.synthetic import SyntheticBackend, acceptance_for_noise

        super().__init__(cfg, ctx)
        target, draft = ctx.target, ctx.draft
        if not isinstance(target, SyntheticBackend) or not isinstance(draft, SyntheticBackend):
            raise ConfigError("policy=oracle knows the truth only for model=synthetic "
                              "draft=synthetic; use policy=goodput for other models")
        self.draft = draft
        self.true_acceptance = lambda noise: acceptance_for_noise(draft.base, noise)
        self.true_costs = (target.cfg.step_cost, target.cfg.token_cost, draft.cfg.step_cost,
                           draft.cfg.token_cost)

    def acceptance(self, batch) -> np.ndarray:
        values = [self.true_acceptance(self.draft.noise_of(s)) for s in batch.slots.tolist()]
        return np.repeat(np.asarray(values, dtype=np.float64)[:, None], self.cfg.k_max, 1)

    def costs(self):
        return self.true_costs

    def draft_overhead(self) -> float:
        return 0.0
