"""Acceptance estimates: per sequence and draft position, learned from the rounds' verdicts."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from specflow.policies.goodput import GoodputPolicy, GoodputPolicyConfig
from specflow.policies.goodput.acceptance import AcceptanceEstimates
from specflow.state import DecodeBatch, RoundResult


def _round(num_drafts, num_accepted, **fields) -> RoundResult:
    B = len(num_drafts)
    return RoundResult(0, list(range(B)), num_drafts, num_accepted,
                       [[1] * (a + 1) for a in num_accepted], [None] * B, B,
                       sim_time={"target": 1.0, "draft": 0.3}, **fields)


def test_goodput_learns_each_sequences_acceptance_and_reprobes_after_a_bad_run():
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=8))
    batch = DecodeBatch.make_dummy(2)
    for _ in range(30):
        pol.specflow_observe(_round([6, 6], [6, 0]))
    acc = pol.acceptance(batch)
    assert acc[0, 0] > 0.9 and acc[1, 0] < 0.3
    k = pol.specflow_draft_length(batch).tolist()
    assert k[0] > k[1]
    # row 1 stops drafting; what it knew fades, so the estimate returns towards the average
    before = pol.acceptance(batch)[1, 0].item()
    for _ in range(40):
        pol.specflow_observe(_round([6, 0], [6, 0]))
    assert pol.acceptance(batch)[1, 0].item() > before


def test_a_new_sequence_starts_from_everyones_rate_and_a_deeper_position_from_its_own():
    est = AcceptanceEstimates(k_max=4, ewma=0.1, prior_acceptance=0.7, optimism=0.0)
    assert np.allclose(est.estimate([5], "chain"), 0.7)            # nothing seen: the prior
    for _ in range(50):                          # row 0: two drafts, both accepted every time
        est.observe(_round([2], [2]), "chain")
    acc = est.estimate([0, 9], "chain")
    assert acc[0, 0] > 0.9 and acc[0, 3] > 0.8   # positions 3, 4 never tried: its own rate
    assert 0.7 < acc[1, 0] < acc[0, 0]           # a new sequence: the global rate, risen


def test_optimism_lifts_what_little_is_known():
    plain = AcceptanceEstimates(4, 0.1, 0.5, optimism=0.0).estimate([0], "chain")
    hopeful = AcceptanceEstimates(4, 0.1, 0.5, optimism=0.5).estimate([0], "chain")
    assert (hopeful > plain).all() and (hopeful <= 1.0).all()


def test_each_mode_counts_its_own_and_a_finished_request_is_forgotten():
    est = AcceptanceEstimates(4, 0.1, 0.7, 0.5, modes=("tree", "chain"))
    est.observe(_round([6], [2], tree_depths=[3], num_examined=[3]), "tree")   # a tree's levels
    assert est.counts_by_mode["tree"][0][:, :3].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert 0 not in est.counts_by_mode["chain"]
    est.forget(0)
    assert 0 not in est.counts_by_mode["tree"]


def test_a_request_that_ends_leaves_nothing_for_the_next_one_with_its_id():
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=4))
    batch = DecodeBatch.make_dummy(1)
    fresh = pol.acceptance(batch).copy()
    for _ in range(20):
        pol.specflow_observe(_round([4], [0]))
    assert (pol.acceptance(batch) < fresh).all()
    pol.specflow_request_end(0, SimpleNamespace(request_id=0), "length")
    # as a sequence never seen (the global rate moved, the row's own counts are gone)
    assert np.allclose(pol.acceptance(batch), pol.estimates.estimate([123], pol.mode))
