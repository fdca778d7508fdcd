"""A draft's catch-up: the tokens a proposer's model must be fed before a row drafts, charged to
the rows that draft."""
from __future__ import annotations

import numpy as np
import pytest

from specflow.policies.goodput import GoodputPolicy, GoodputPolicyConfig
from specflow.policies.goodput.catch_up import CatchUpCosts
from specflow.policies.goodput.choose import choose_k_padded
from specflow.state import DecodeBatch

from tests.policies.goodput.fakes import FakeProposer, TimedTarget, built, timed_round


class FixedCosts(GoodputPolicy):
    def costs(self):
        return (0.010, 0.0001, 0.0001, 0.0)       # drafting looks nearly free


def test_a_rows_catch_up_is_charged_to_drafting_spread_over_the_rounds_it_has_left():
    """A draft that has not fed a row's prompt must prefill it before the row drafts: seconds
    plain decoding never spends. Charged once (spread over the drafting rounds the row has
    left), it keeps a loaded batch of fresh requests from drafting while a long request, or one
    whose draft is caught up, still drafts."""
    proposer = FakeProposer(per_position=20e-6, owed=[298] * 16)   # 20 us a position fed
    pol, _ = built(GoodputPolicy, GoodputPolicyConfig(k_max=4), proposer, target=TimedTarget(),
                   slots=16)
    assert pol.catch_up.per_token == pytest.approx(20e-6)
    batch = DecodeBatch.make_dummy(16)
    for ids in batch.token_ids:
        ids[:] = [1] * 300                                       # fresh 300-token prompts
    batch.prompt_lens = [300] * 16
    batch.max_new_tokens = [64] * 16
    acc = np.full((16, 4), 0.8)
    short = pol.catch_up_costs(batch, acc)
    batch.max_new_tokens = [4096] * 16
    long = pol.catch_up_costs(batch, acc)
    E4 = 1 + 0.8 + 0.64 + 0.512 + 0.4096
    assert short[0] == pytest.approx(20e-6 * 298 / (64 / E4))
    assert long[0] == pytest.approx(short[0] * 64 / 4096)
    costs = (0.012, 0.0005, 0.0008, 0.0)         # a plain round 17 ms: drafting pays a little
    assert max(choose_k_padded(acc, *costs, plain=0.017, row_first=long)) > 0
    assert choose_k_padded(acc, *costs, plain=0.017, row_first=short) == [0] * 16
    # a row whose draft fed everything but the last tokens owes nothing
    proposer.owed[0] = 0
    assert pol.catch_up_costs(batch, acc)[0] == 0.0


def test_nothing_is_charged_when_no_proposer_answers_or_a_token_costs_nothing():
    batch = DecodeBatch.make_dummy(2)
    acc = np.full((2, 4), 0.8)
    pol, _ = built(GoodputPolicy, GoodputPolicyConfig(k_max=4), FakeProposer(owed=None),
                   target=TimedTarget(), slots=2)
    assert pol.catch_up.per_token > 0 and pol.catch_up_costs(batch, acc).tolist() == [0, 0]
    assert CatchUpCosts(0.05, 0.0).seconds([100, 100], [10, 10], np.ones(2)).tolist() == [0, 0]


def test_goodput_learns_the_catch_up_seconds_per_token_from_the_rows_that_drafted():
    target = TimedTarget()
    target.pads_rows = False                  # (no round forced without drafts)
    proposer = FakeProposer(per_position=0.0, owed=[0, 0])      # the prior: catch-up is free
    pol, _ = built(FixedCosts, GoodputPolicyConfig(k_max=4), proposer, target=target, slots=2)
    assert pol.catch_up.per_token == 0.0
    batch = DecodeBatch.make_dummy(2)
    cached = [0, 0]                           # what each row's draft holds, as a proposer knows
    rng = np.random.default_rng(0)
    for _ in range(40):
        for ids in batch.token_ids:           # rows grow by a random stretch between rounds
            ids.extend([1] * int(rng.integers(3, 60)))
        proposer.owed = [max(0, len(ids) - n - 2) for ids, n in zip(batch.token_ids, cached)]
        k = pol.specflow_draft_length(batch).tolist()
        fed = sum(owed for owed, kb in zip(proposer.owed, k) if kb)
        pol.specflow_observe(timed_round(max(k), 2, 2, 0.015, prefill=30e-6 * fed))
        for b, kb in enumerate(k):            # the drafts hold what was committed, but the last
            if kb:
                cached[b] = len(batch.token_ids[b]) + 2 - 1
    assert pol.catch_up.per_token == pytest.approx(30e-6, rel=0.05)
    # a row given k but held at 0 after the policy (the length cap, the draft's own context)
    # was not fed: the catch-up fit stays as it was
    fit = pol.catch_up.fit.coef()
    proposer.owed = [50, 0]
    assert pol.specflow_draft_length(batch).sum() > 0
    pol.specflow_observe(timed_round(0, 2, 1, 0.010))
    assert pol.catch_up.fit.coef() == fit
