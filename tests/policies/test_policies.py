"""Policies: each decision rule, table-driven (goodput's parts: tests/policies/goodput/)."""
from __future__ import annotations

import pytest

from specflow import ConfigError
from specflow.policies.adaptive import (AdaptivePolicy, AdaptivePolicyConfig, best_k,
                                        expected_speedup)
from specflow.policies.static import StaticPolicy, StaticPolicyConfig
from specflow.state import DecodeBatch, RoundResult


def test_static_gives_every_row_the_same_k():
    k = StaticPolicy(StaticPolicyConfig(k=3)).specflow_draft_length(DecodeBatch.make_dummy(4))
    assert k.tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("a,c,k_max,expected", [
    # the seed's sweep (article A, docs/design.md §6): best k at c = 0.1 over 1..10
    (0.5, 0.1, 10, 2), (0.6, 0.1, 10, 3), (0.7, 0.1, 10, 4), (0.8, 0.1, 10, 6), (0.9, 0.1, 10, 10),
    (0.9, 0.1, 4, 4),          # capped by k_max
    (0.1, 0.5, 8, 0),          # drafting cannot pay: plain decoding
    (0.99, 0.1, 10, 10),       # estimates are capped at 0.95 but k still maxes out
])
def test_adaptive_picks_the_k_that_maximises_expected_speedup(a, c, k_max, expected):
    assert best_k(a, k_max, c) == expected


def test_expected_speedup_matches_the_seed_numbers():
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.36 / 1.4, abs=0.01)   # "about 2.4x"
    assert expected_speedup(0.5, 4, 0.1) == pytest.approx(1.94 / 1.4, abs=0.01)   # "about 1.4x"


def test_adaptive_follows_each_rows_acceptance():
    pol = AdaptivePolicy(AdaptivePolicyConfig(k_max=8, ewma=0.5, initial_acceptance=0.7))
    batch = DecodeBatch.make_dummy(2)
    first = pol.specflow_draft_length(batch).tolist()
    assert first[0] == first[1] == best_k(0.7, 8, 0.1)
    for _ in range(6):   # row 0 accepts everything, row 1 rejects its first draft every time
        pol.specflow_observe(RoundResult.make_dummy(num_drafts=[4, 4], num_accepted=[4, 0]))
    k = pol.specflow_draft_length(batch).tolist()
    assert k[0] == 8 and k[1] == 0


def test_adaptive_switches_off_under_load_with_hysteresis():
    pol = AdaptivePolicy(AdaptivePolicyConfig(k_max=4, off_above_batch=6, on_below_batch=3))
    decisions = []
    for size in (2, 5, 6, 5, 4, 3, 4):
        decisions.append(int(pol.specflow_draft_length(DecodeBatch.make_dummy(size)).max()))
    assert decisions == [4, 4, 0, 0, 0, 4, 4]     # off at 6, back on only at 3


def test_adaptive_rejects_thresholds_out_of_order_and_negative_k():
    with pytest.raises(ConfigError, match="ordered"):
        AdaptivePolicyConfig(off_above_batch=4, on_below_batch=8)
    with pytest.raises(ConfigError, match="k_max=-1"):
        AdaptivePolicyConfig(k_max=-1)


# --- heuristic ----------------------------------------------------------------------------------

from specflow.policies.heuristic import HeuristicPolicy, HeuristicPolicyConfig  # noqa: E402
from specflow.policies.schedule import (BatchRange, SchedulePolicy, SchedulePolicyConfig,  # noqa: E402
                                        k_for_batch)


@pytest.mark.parametrize("rounds,expected", [
    ([(4, 4)], 6),                     # all accepted: +2
    ([(4, 2)], 3),                     # a rejection: -1
    ([(4, 4), (6, 6), (8, 8)], 10),    # capped at k_max = 10
    ([(4, 0)] * 6, 1),                 # never below 1
    ([(4, 4), (6, 1), (5, 5)], 7),
])
def test_heuristic_follows_hf_schedule(rounds, expected):
    pol = HeuristicPolicy(HeuristicPolicyConfig(k_start=4, k_max=10))
    for k, acc in rounds:
        pol.specflow_observe(RoundResult.make_dummy(num_drafts=[k], num_accepted=[acc]))
    assert pol.specflow_draft_length(DecodeBatch.make_dummy(1)).tolist() == [expected]


# --- schedule -----------------------------------------------------------------------------------

@pytest.mark.parametrize("running,k", [(1, 5), (4, 5), (5, 2), (16, 2), (17, 0), (500, 0)])
def test_schedule_maps_running_sequences_to_k(running, k):
    ranges = [BatchRange(4, 5), BatchRange(16, 2), BatchRange(None, 0)]
    assert k_for_batch(ranges, running) == k
    pol = SchedulePolicy(SchedulePolicyConfig(ranges=ranges))
    assert pol.specflow_draft_length(DecodeBatch.make_dummy(running)).tolist() == [k] * running


@pytest.mark.parametrize("ranges,message", [
    ([BatchRange(16, 2), BatchRange(4, 5)], "strictly increasing"),
    ([BatchRange(None, 2), BatchRange(4, 5)], "only the last"),
    ([BatchRange(4, -1)], "k must be >= 0"),
    ([], "empty"),
])
def test_schedule_rejects_bad_ranges(ranges, message):
    with pytest.raises(ConfigError, match=message):
        SchedulePolicyConfig(ranges=ranges)
