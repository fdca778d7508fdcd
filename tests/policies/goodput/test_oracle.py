"""policy=oracle: the goodput rule fed the synthetic pair's truth."""
from __future__ import annotations

import pytest

from specflow import ConfigError, Pipeline
from specflow.policies.goodput import OraclePolicy


def test_oracle_is_refused_outside_the_synthetic_pair():
    with pytest.raises(ConfigError, match="policy=oracle knows the truth only"):
        Pipeline.from_config(["policy=oracle"])


def test_oracle_reads_the_synthetic_pairs_true_costs_and_acceptance(make_pipeline):
    pipe = make_pipeline("proposer=draft", "policy=oracle", "draft.noise=0.3")
    pol = pipe.pm.get_plugin("policy.oracle")
    assert isinstance(pol, OraclePolicy)
    assert pol.costs() == pol.true_costs and pol.draft_overhead() == 0.0
    out = pipe.generate(["abcabcabc", "xyxyxy"], max_new_tokens=16)
    assert all(len(r.token_ids) == 16 for r in out)
    assert sum(r.stats["num_draft_tokens"] for r in out) > 0
