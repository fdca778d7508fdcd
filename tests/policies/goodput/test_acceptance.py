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


def test_positions_asked_for_and_left_empty_count_as_rejections():
    """An n-gram lookup without a match drafts fewer tokens than asked, or none: what the
    policy prices is the chance a position asked for adds a token, so the empty ones count as
    examined and not accepted (a row that drafted nothing is not a row that was not asked)."""
    est = AcceptanceEstimates(k_max=4, ewma=0.1, prior_acceptance=0.7, optimism=0.0)
    for _ in range(60):
        # rows 0 and 1 asked for 2: row 0 drafted both and both were accepted, row 1 drafted
        # none (no match); row 2 asked for 3, drafted 1, accepted it; row 3 was not asked
        est.observe(_round([2, 0, 1, 0], [2, 0, 1, 0], num_asked=[2, 2, 3, 0]), "chain")
    acc = est.estimate([0, 1, 2, 3], "chain")
    assert acc[0, 0] > 0.9 and acc[0, 1] > 0.9
    assert acc[1, 0] < 0.1                        # asked every round, never a token
    assert acc[2, 0] > 0.9 and acc[2, 1] < 0.1    # its first token, never a second
    # without num_asked (a proposer that always drafts what it is asked) nothing changes
    plain = AcceptanceEstimates(k_max=4, ewma=0.1, prior_acceptance=0.7, optimism=0.0)
    for _ in range(60):
        plain.observe(_round([2, 0], [2, 0]), "chain")
    assert np.allclose(plain.estimate([1], "chain"), plain.estimate([9], "chain"))


def test_the_pipeline_records_what_each_row_was_asked_for():
    from specflow import Pipeline
    from specflow.plugins import hookimpl

    pipe = Pipeline.from_config(["model=demo", "proposer=ngram", "proposer.k=3", "threads=1"])
    rounds = []

    class Record:
        @hookimpl
        def specflow_observe(self, result):
            rounds.append(result)

    pipe.pm.register(Record(), "test.rounds")
    pipe.generate(["def f(x):\n    return x"], max_new_tokens=12)
    assert rounds and all(r.num_asked is not None for r in rounds)
    for r in rounds:
        for asked, drafted in zip(r.num_asked, r.num_drafts):
            assert drafted <= asked <= 3
    assert any(a > d for r in rounds for a, d in zip(r.num_asked, r.num_drafts))  # no match
