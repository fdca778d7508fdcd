"""What passes cost, timed once the pipeline is built: the priors of the policy's cost fits."""
from __future__ import annotations

import pytest
import torch

from specflow import Pipeline
from specflow.policies.goodput import GoodputPolicy, GoodputPolicyConfig
from specflow.policies.goodput.choose import choose_k
from specflow.policies.goodput.costs import CATCH_UP_POSITIONS, draft_costs, measure, target_cost

from tests.policies.goodput.fakes import FakeProposer, TimedTarget, built


def test_two_timed_passes_give_a_targets_fixed_cost_and_its_cost_per_position():
    a, b = target_cost(TimedTarget(0.010, 0.0005), rows=4, positions=9)
    assert a == pytest.approx(0.010) and b == pytest.approx(0.0005)


def test_a_simulated_target_is_not_timed_its_clock_is_the_truth():
    simulated = TimedTarget()
    simulated.clock = object()
    assert target_cost(simulated, 4, 9) is None
    assert target_cost(TimedTarget(), 1, 1) is None          # one pass: no slope to find
    proposer = FakeProposer()
    assert measure(simulated, 4, 9, lambda r, p: proposer.specflow_draft_step_seconds(r, p), 3) \
        .target is None
    assert proposer.asked == []                               # drafting is not timed either


def test_a_proposers_timed_steps_give_its_step_branch_and_catch_up_costs():
    fake = FakeProposer(fixed=0.001, per_position=0.00005)
    costs = draft_costs(fake.specflow_draft_step_seconds, rows=8, width=4)
    assert costs.draft == pytest.approx((0.001, 0.00005))    # per step, per drafting row
    assert costs.branch == pytest.approx(0.00005)              # one more frontier node
    assert costs.catch_up == pytest.approx(0.00005)            # one more position fed
    assert (1, CATCH_UP_POSITIONS) in fake.asked
    chains = draft_costs(fake.specflow_draft_step_seconds, rows=8, width=1)
    assert chains.branch == 0.0
    nothing = draft_costs(lambda rows, positions: None, rows=8, width=4)   # no model (n-gram)
    assert nothing.draft is None and nothing.branch == nothing.catch_up == 0.0


def test_a_policy_without_a_pipeline_keeps_its_priors():
    pol = GoodputPolicy(GoodputPolicyConfig(prior_draft_cost=0.2))
    assert pol.target_prior == (1.0, 0.0) and pol.draft_prior == (0.2, 0.0)
    assert pol.costs() == (1.0, 0.0, 0.2, 0.0) and pol.draft_overhead() == 0.0


def test_a_policy_times_passes_only_once_the_pipeline_is_built():
    fake = FakeProposer(fixed=0.001, per_position=0.00005)
    pol, pm = built(GoodputPolicy, GoodputPolicyConfig(k_max=4), target=TimedTarget(), slots=8)
    assert pol.target_prior == pytest.approx((0.010, 0.0005)) and fake.asked == []
    pol, pm = built(GoodputPolicy, GoodputPolicyConfig(k_max=4), fake, target=TimedTarget(),
                    slots=8)
    assert fake.asked                                          # asked in specflow_pipeline_built
    assert pol.draft_prior == pytest.approx((0.001, 0.00005))
    assert pol.catch_up.per_token == pytest.approx(0.00005)
    assert pol.costs() == pytest.approx((0.010, 0.0005, 0.001, 0.00005))


def test_goodput_seeds_its_costs_from_timed_passes_so_steady_rounds_cannot_hide_the_slope(
        linear_clock):
    # steady full-batch rounds all score the same number of tokens: the fit alone cannot tell a
    # pass's fixed cost from its cost per position (tests/policies/goodput/test_fits.py). Two
    # timed passes of the real target once the pipeline is built give the slope.
    pipe = Pipeline.from_config(["model=demo", "proposer=draft", "policy=goodput",
                                 "max_batch_size=16", "threads=2", "max_new_tokens=4"])
    pol = pipe.pm.get_plugin("policy.goodput")
    a_t, b_t = pol.target_prior
    # the target's and the draft model's passes, each timed at two sizes (linear_clock: the
    # passes run, their seconds come from fixed lines, so a loaded machine cannot flip them)
    assert (a_t, b_t) == pytest.approx(linear_clock["model"])
    assert pol.draft_prior == pytest.approx(linear_clock["draft"])
    assert pol.catch_up.per_token == pytest.approx(linear_clock["draft"][1])
    # k falls with the batch under the measured costs
    acc = torch.full((1, 8), 0.9)
    ks = [choose_k(acc.expand(b, 8), a_t, b_t, *pol.draft_prior)[0] for b in (1, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[-1] < ks[0]
    # the synthetic pair keeps its simulated clock's prior (nothing is timed)
    synth = Pipeline.from_config(["model=synthetic", "draft=synthetic", "policy=goodput"])
    assert synth.pm.get_plugin("policy.goodput").target_prior == (1.0, 0.0)


def test_goodput_times_a_draft_head_s_step_as_it_times_a_draft_model(linear_clock):
    """proposer=eagle has no draft model: the head's own step is timed once the pipeline is
    built (one row and every slot), and the cache rows it used are empty afterwards."""
    from specflow.stages.proposers.eagle import EagleProposer

    pipe = Pipeline.from_config(["model=demo", "proposer=eagle", "policy=goodput",
                                 "max_batch_size=8", "threads=2", "max_new_tokens=4"])
    pol = pipe.pm.get_plugin("policy.goodput")
    assert pol.measured.draft is not None     # the head answered: its step was timed
    assert pol.draft_prior == pytest.approx(linear_clock["head"])     # in one row and 8
    assert pol.target_prior == pytest.approx(linear_clock["model"])
    head = next(p for p in pipe.pm.get_plugins() if isinstance(p, EagleProposer))
    assert all(n == 0 for n in head.cache.lengths)
    assert pipe.ctx._draft is None                # no draft model was loaded
    assert pipe.generate("def f(x):", max_new_tokens=8)[0].token_ids


def test_goodput_times_no_draft_model_for_an_ngram_tree():
    """Drafting costs are what the proposer answers: an n-gram tree pipeline with a draft
    configured never loads it, and prices no catch-up."""
    pipe = Pipeline.from_config(["model=demo", "draft=demo", "proposer=ngram", "proposer.topk=4",
                                 "proposer.num_draft_tokens=8", "policy=goodput", "threads=2"])
    assert pipe.ctx._draft is None
    pol = pipe.pm.get_plugin("policy.goodput")
    assert pol.catch_up.per_token == 0.0 and pol.branch_cost == 0.0
