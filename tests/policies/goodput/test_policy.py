"""GoodputPolicy wiring its parts: what it fits from a round, and how a proposer's costs reach
it through hooks (any proposer: the policy never asks which one it is)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specflow import Pipeline
from specflow.policies.goodput import GoodputPolicy, GoodputPolicyConfig
from specflow.state import DecodeBatch, RoundResult

from tests.policies.goodput.fakes import FakeProposer, PaddedTarget, TimedTarget, built


class RecordingFit:
    """A target cost fit that keeps what it was given."""

    def __init__(self):
        self.positions = []

    def add(self, x, y):
        self.positions.append(x)

    def coef(self):
        return (1.0, 0.0)


def _round() -> RoundResult:
    return RoundResult(0, [0, 1, 2, 3], [4, 0, 0, 0], [4, 0, 0, 0], [[1] * 5, [1], [1], [1]],
                       [None] * 4, 4, sim_time={"target": 1.0, "draft": 0.3})


@pytest.mark.parametrize("target,positions", [(PaddedTarget(), 20), (None, 8)])
def test_goodput_fits_the_positions_a_pass_computed(target, positions):
    """Padded rows: four rows x five positions, not 5 + 1 + 1 + 1; each row its own otherwise."""
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=8), SimpleNamespace(target=target, slots=1))
    pol.target_fit = RecordingFit()
    pol.specflow_observe(_round())
    assert pol.target_fit.positions == [positions]


def _fresh_batch(size: int) -> DecodeBatch:
    batch = DecodeBatch.make_dummy(size)
    batch.max_new_tokens = [64] * size
    return batch


def test_a_new_proposer_is_priced_through_its_hooks_without_editing_the_policy():
    """A proposer the policy has never heard of answers specflow_draft_step_seconds (its step
    is timed once the pipeline is built) and specflow_catch_up_tokens (each round): a row whose
    model must first be fed many tokens stops drafting while the others draft."""
    cfg = GoodputPolicyConfig(k_max=4)
    caught_up = FakeProposer(fixed=0.001, per_position=0.00005, owed=[0, 0, 0, 0])
    pol, pm = built(GoodputPolicy, cfg, caught_up, target=TimedTarget(), slots=4)
    assert pol.draft_prior == pytest.approx((0.001, 0.00005))     # the proposer's own step
    batch = _fresh_batch(4)
    k = pm.hook.specflow_draft_length(batch=batch).tolist()
    assert min(k) > 0
    lagging = FakeProposer(fixed=0.001, per_position=0.00005, owed=[0, 0, 0, 100_000])
    pol, pm = built(GoodputPolicy, cfg, lagging, target=TimedTarget(), slots=4)
    k = pm.hook.specflow_draft_length(batch=batch).tolist()
    assert k[3] == 0 and min(k[:3]) > 0
    # a dear draft step prices drafting out for everyone
    dear = FakeProposer(fixed=0.050, per_position=0.001, owed=[0, 0, 0, 0])
    pol, pm = built(GoodputPolicy, cfg, dear, target=TimedTarget(), slots=4)
    assert pm.hook.specflow_draft_length(batch=batch).tolist() == [0, 0, 0, 0]


def test_a_pipeline_hands_the_policy_its_proposers_costs_once_everything_is_registered():
    """Pipeline calls specflow_pipeline_built after every stage and plugin is registered: a
    plugin's step timing reaches the policy's priors (an n-gram proposer answers nothing)."""
    fake = FakeProposer(fixed=0.001, per_position=0.00005)
    pipe = Pipeline.from_config(["model=demo", "proposer=ngram", "policy=goodput",
                                 "max_batch_size=4", "threads=2"], plugins=[fake])
    pol = pipe.pm.get_plugin("policy.goodput")
    assert pol.measured.target is not None                         # the demo target, timed
    assert pol.draft_prior == pytest.approx((0.001, 0.00005))
    assert pol.catch_up.per_token == pytest.approx(0.00005)
