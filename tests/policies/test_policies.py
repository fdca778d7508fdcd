"""Policies: each decision rule, table-driven."""
from __future__ import annotations

import pytest
from types import SimpleNamespace
import numpy as np
import torch

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

from specflow.policies.goodput import (GoodputPolicy, GoodputPolicyConfig, LinearFit, LinearFit2, LinearFit3,  # noqa: E402
                                       choose_k, choose_k_padded, expected_tokens)
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


# --- goodput --------------------------------------------------------------------------------------

def test_expected_tokens_is_the_formula():
    E = expected_tokens(torch.full((1, 4), 0.8, dtype=torch.float64))[0]
    for k in range(5):
        assert E[k].item() == pytest.approx((1 - 0.8 ** (k + 1)) / 0.2)


@pytest.mark.parametrize("acceptance,costs,expected", [
    # memory bound (a scored position is free): k follows acceptance, even 0.1 is worth one
    # draft when three rows share its step cost
    ([0.95, 0.5, 0.1], (1.0, 0.0, 0.05, 0.0), [8, 3, 1]),
    # compute bound (a scored position costs a whole pass): only the best row drafts, a little
    ([0.95, 0.5, 0.1], (1.0, 1.0, 0.05, 0.0), [2, 0, 0]),
    # a free, perfect draft drafts to the limit
    ([1.0], (1.0, 0.0, 0.0, 0.0), [8]),
    # a draft step as dear as a target pass (c = 1): nothing pays
    ([0.99, 0.6], (1.0, 0.0, 1.0, 0.0), [0, 0]),
    # ... unless the row is alone with a near-certain draft and the step is cheap
    ([0.99], (1.0, 0.0, 0.2, 0.0), [8]),
])
def test_goodput_choice_table(acceptance, costs, expected):
    acc = torch.tensor(acceptance)[:, None].expand(len(acceptance), 8)
    assert choose_k(acc, *costs) == expected


@pytest.mark.parametrize("acceptance,costs,expected", [
    # compute bound: per-row shares let the keen row draft 2 ([2, 0, 0] above), but a padded
    # pass would make all three rows score 3 positions: nobody drafts
    ([0.95, 0.5, 0.1], (1.0, 1.0, 0.05, 0.0), [0, 0, 0]),
    # memory bound, free draft steps: the positions are paid for anyway, every row fills them
    ([0.95, 0.5, 0.1], (1.0, 0.0, 0.05, 0.0), [8, 8, 8]),
    # ... but a row whose drafts are rarely accepted stops where its draft steps stop paying
    ([0.95, 0.5, 0.1], (1.0, 0.0, 0.05, 0.05), [8, 1, 0]),
    # a draft step as dear as a target pass: nothing pays
    ([0.99, 0.6], (1.0, 0.0, 1.0, 0.0), [0, 0]),
])
def test_goodput_prices_a_padded_pass_for_the_whole_batch(acceptance, costs, expected):
    acc = torch.tensor(acceptance)[:, None].expand(len(acceptance), 8)
    assert choose_k_padded(acc, *costs) == expected


def _padded_rate(E, ks, a_t, b_t, a_d, b_d) -> float:
    """Expected tokens per second of a round whose pass pads every row to the longest draft."""
    B = len(ks)
    return sum(E[b, k] for b, k in enumerate(ks)) / (
        a_t + b_t * B * (max(ks) + 1) + a_d * max(ks) + b_d * sum(ks))


def test_the_padded_choice_is_the_best_of_every_combination():
    import itertools

    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        B, K = 3, 3
        acc = torch.rand(B, K, generator=gen)
        costs = [float(x) for x in torch.rand(4, generator=gen) * torch.tensor([1, 0.3, 0.3, 0.1])]
        E = expected_tokens(acc)
        best = max(_padded_rate(E, ks, *costs)
                   for ks in itertools.product(range(K + 1), repeat=B))
        got = _padded_rate(E, choose_k_padded(acc, *costs), *costs)
        assert got == pytest.approx(best, rel=1e-9)


def test_padded_and_per_row_choices_agree_for_one_row():
    for a in (0.3, 0.6, 0.8, 0.95):
        for costs in [(1.0, 0.0, 0.05, 0.0), (1.0, 0.2, 0.1, 0.01), (1.0, 0.05, 0.3, 0.0)]:
            acc = torch.full((1, 8), a)
            assert choose_k_padded(acc, *costs) == choose_k(acc, *costs), (a, costs)


def test_goodput_fits_the_positions_a_padded_pass_computed():
    class Padded:
        pads_rows = True
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=8), SimpleNamespace(target=Padded(), slots=1))
    seen = []
    pol.target_fit.add = lambda tokens, y: seen.append(tokens)
    pol.specflow_observe(RoundResult(0, [0, 1, 2, 3], [4, 0, 0, 0], [4, 0, 0, 0],
                                     [[1] * 5, [1], [1], [1]], [None] * 4, 4,
                                     sim_time={"target": 1.0, "draft": 0.3}))
    assert seen == [20]                 # four rows x five positions, not 5 + 1 + 1 + 1
    pol.padded = False
    pol.specflow_observe(RoundResult(0, [0, 1, 2, 3], [4, 0, 0, 0], [4, 0, 0, 0],
                                     [[1] * 5, [1], [1], [1]], [None] * 4, 4,
                                     sim_time={"target": 1.0, "draft": 0.3}))
    assert seen == [20, 8]


@pytest.mark.parametrize("padded,batch,interval", [(False, 4, 50), (True, 4, 200), (True, 1, 50)])
def test_goodput_probes_after_idle_rounds_less_often_when_a_probe_pads_every_row(padded, batch,
                                                                                 interval):
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=4, explore_every=50))
    pol.padded = padded
    pol.costs = lambda: (1.0, 10.0, 1.0, 1.0)          # drafting never pays
    b = DecodeBatch.make_dummy(batch)
    probes = [r for r in range(1, 2 * interval + 1) if pol.specflow_draft_length(b).sum() > 0]
    assert probes == [interval, 2 * interval]


def test_goodput_k_falls_as_batch_and_per_token_cost_grow():
    acc = torch.full((1, 8), 0.8)
    ks = [choose_k(acc.expand(b, 8), 1.0, 0.01, 0.05, 0.001)[0] for b in (1, 8, 64, 256)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


def test_linear_fits_recover_costs_from_noisy_rounds():
    gen = torch.Generator().manual_seed(0)
    fit, fit2 = LinearFit(0.05, 1.0), LinearFit2(0.05, 0.1, 0.0)
    for _ in range(400):
        tokens = float(torch.randint(8, 120, (1,), generator=gen))
        fit.add(tokens, 2.0 + 0.03 * tokens + 0.01 * float(torch.randn(1, generator=gen)))
        steps = float(torch.randint(1, 8, (1,), generator=gen))
        rowsteps = steps * float(torch.randint(1, 16, (1,), generator=gen))
        fit2.add(steps, rowsteps, 0.2 * steps + 0.004 * rowsteps)
    a, b = fit.coef()
    assert a == pytest.approx(2.0, abs=0.05) and b == pytest.approx(0.03, abs=0.002)
    a, b = fit2.coef()
    assert a == pytest.approx(0.2, abs=0.01) and b == pytest.approx(0.004, abs=0.0005)


def test_goodput_learns_each_sequences_acceptance_and_reprobes_after_a_bad_run():
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=8))
    batch = DecodeBatch.make_dummy(2)
    for _ in range(30):
        pol.specflow_observe(RoundResult(0, [0, 1], [6, 6], [6, 0], [[1] * 7, [1]], [None, None], 2,
                                         sim_time={"target": 1.0, "draft": 0.3}))
    acc = pol.acceptance(batch)
    assert acc[0, 0] > 0.9 and acc[1, 0] < 0.3
    k = pol.specflow_draft_length(batch).tolist()
    assert k[0] > k[1]
    # row 1 stops drafting; what it knew fades, so the estimate returns towards the average
    before = pol.acceptance(batch)[1, 0].item()
    for _ in range(40):
        pol.specflow_observe(RoundResult(0, [0, 1], [6, 0], [6, 0], [[1] * 7, [1]], [None, None], 2,
                                         sim_time={"target": 1.0, "draft": 0.3}))
    assert pol.acceptance(batch)[1, 0].item() > before


def test_oracle_is_refused_outside_the_synthetic_pair():
    from specflow import Pipeline
    with pytest.raises(ConfigError, match="policy=oracle knows the truth only"):
        Pipeline.from_config(["policy=oracle"])


def test_goodput_seeds_its_costs_from_timed_passes_so_steady_rounds_cannot_hide_the_slope():
    # steady full-batch rounds all score the same number of tokens: the fit alone cannot tell a
    # pass's fixed cost from its cost per position, and with a flat prior it called extra
    # positions free (k stayed high under load). Two timed passes of the real target at build
    # time give the slope.
    from specflow import Pipeline

    pipe = Pipeline.from_config(["model=demo", "proposer=draft", "policy=goodput",
                                 "max_batch_size=16", "threads=2", "max_new_tokens=4"])
    pol = pipe.pm.get_plugin("policy.goodput")
    a_t, b_t = pol.target_prior
    assert a_t > 0 and b_t > 0 and pol.draft_prior[0] > 0
    fit = LinearFit(0.05, a_t, b_t)
    for _ in range(200):                         # 16 rows x (k+1 = 5), every round alike
        fit.add(80.0, a_t + 80 * b_t)
    assert fit.coef()[1] == pytest.approx(b_t, rel=0.05)
    flat = LinearFit(0.05, 1.0, 0.0)             # the old prior: the slope is lost
    for _ in range(200):
        flat.add(80.0, a_t + 80 * b_t)
    assert flat.coef()[1] < b_t / 5
    # k falls with the batch under the measured costs (a sure draft: timings taken beside
    # another test worker can make a middling one never pay)
    acc = torch.full((1, 8), 0.9)
    ks = [choose_k(acc.expand(b, 8), a_t, b_t, *pol.draft_prior)[0] for b in (1, 16, 64)]
    assert ks == sorted(ks, reverse=True) and ks[-1] < ks[0]
    # the synthetic pair keeps its simulated clock's prior (nothing is timed)
    synth = Pipeline.from_config(["model=synthetic", "draft=synthetic", "policy=goodput"])
    assert synth.pm.get_plugin("policy.goodput").target_prior == (1.0, 0.0)


def test_goodput_times_a_draft_head_s_step_as_it_times_a_draft_model():
    """proposer=eagle has no draft model: the head's own step is timed at build (one row and
    every slot), and the cache rows it used are empty afterwards."""
    from specflow import Pipeline
    from specflow.stages.proposers.eagle import EagleProposer

    pipe = Pipeline.from_config(["model=demo", "proposer=eagle", "policy=goodput",
                                 "max_batch_size=8", "threads=2", "max_new_tokens=4"])
    pol = pipe.pm.get_plugin("policy.goodput")
    a_d, b_d = pol.draft_prior
    a_t, b_t = pol.target_prior
    assert 0 < a_d < a_t and b_d >= 0        # a head step is cheaper than a target pass
    head = next(p for p in pipe.pm.get_plugins() if isinstance(p, EagleProposer))
    assert all(n == 0 for n in head.cache.lengths)
    assert pipe.ctx._draft is None                # no draft model was loaded
    assert pipe.generate("def f(x):", max_new_tokens=8)[0].token_ids


def test_goodput_times_no_draft_model_for_an_ngram_tree():
    """Branch and catch-up costs are timed on a draft model only for proposer=draft: an n-gram
    tree pipeline with a draft configured never loads it."""
    from specflow import Pipeline

    pipe = Pipeline.from_config(["model=demo", "draft=demo", "proposer=ngram", "proposer.topk=4",
                                 "proposer.num_draft_tokens=8", "policy=goodput", "threads=2"])
    assert pipe.ctx._draft is None
    assert pipe.pm.get_plugin("policy.goodput").catch_up.coef()[1] == 0.0


def test_goodput_prices_a_tree_by_the_nodes_it_scores_per_level(make_pipeline):
    """A depth-k tree costs 1 + w k positions, w learned from the trees scored (a fixed 16-node
    n-gram tree: 4 per level); chains stay k + 1."""
    pipe = make_pipeline("proposer=ngram", "proposer.topk=4", "proposer.num_draft_tokens=16",
                         "policy=goodput", "policy.k_max=6")
    pol = pipe.pm.get_plugin("policy.goodput")
    assert pol.positions.tolist() == [1, 2, 3, 4, 5, 6, 7]          # from a chain's width
    for _ in range(100):
        pol.specflow_observe(RoundResult(0, [0, 1], [16, 16], [2, 0], [[1] * 3, [1]],
                                         [None] * 2, 2, tree_depths=[4, 4],
                                         num_examined=[3, 1]))
    assert np.allclose(pol.positions, [1, 5, 9, 13, 17, 17, 17], atol=1e-3)   # at most 16 nodes
    acc = torch.full((4, 6), 0.8)
    costs = (1.0, 0.05, 0.02, 0.0)             # each scored position costs 5% of a pass
    chain = choose_k_padded(acc, *costs)
    tree = choose_k_padded(acc, *costs, positions=pol.positions)
    assert max(tree) < max(chain)               # four times the positions per level: shallower
    assert make_pipeline("proposer=ngram", "policy=goodput").pm.get_plugin(
        "policy.goodput").positions is None     # a chain: k + 1

def test_the_draft_fit_separates_a_rounds_fixed_cost_from_its_steps_and_tokens():
    """y = c + a steps + b tokens: a fixed cost of drafting at all is not spread over the steps
    (which made deep drafts look dear)."""
    fit = LinearFit3(0.05, (0.0, 0.1, 0.0))
    rng = np.random.default_rng(0)
    for _ in range(400):
        steps = int(rng.integers(1, 9))
        tokens = steps * int(rng.integers(1, 5))
        fit.add((1.0, steps, tokens), 2.0 + 0.5 * steps + 0.25 * tokens)
    assert np.allclose(fit.coef(), (2.0, 0.5, 0.25), atol=1e-2)
    assert LinearFit3(0.05, (0.3, 0.1, 0.0)).coef() == (0.3, 0.1, 0.0)   # nothing seen: prior


def test_a_warm_up_round_does_not_price_drafting_out():
    """A first drafting round at 3x the usual seconds (kernels built for new shapes) must not
    set three weights alone: the measured prior weighs as a few rounds at first (a fit that
    had priced a one-step round at 3-6x its cost drafted nothing again, so it never learned)."""
    truth = lambda x: 1.0 + 2.5 * x[1] + 0.3 * x[2]              # noqa: E731  ms
    fit = LinearFit3(0.05, (0.0, 2.0, 0.2))                       # a step timed at build
    fit.add((1, 4, 7), 3 * truth((1, 4, 7)))
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(12):
        steps = int(rng.integers(1, 4))
        x = (1, steps, steps + int(rng.integers(0, 3)))
        fit.add(x, truth(x))
        ratios.append(np.dot(fit.coef(), (1, 1, 1)) / truth((1, 1, 1)))
    assert max(ratios) < 2.0 and ratios[-1] < 1.25, ratios


@pytest.mark.parametrize("chooser", [choose_k, choose_k_padded])
def test_a_fixed_cost_of_drafting_at_all_can_make_k_zero(chooser):
    acc = np.full((2, 6), 0.6)
    costs = (1.0, 0.0, 0.05, 0.0)
    assert max(chooser(acc, *costs)) > 0
    assert chooser(acc, *costs, first=5.0) == [0, 0]     # five passes' worth to draft at all
    deep = chooser(np.full((2, 6), 0.9), *costs, first=0.5)
    assert min(deep) >= max(chooser(np.full((2, 6), 0.9), *costs)) - 1   # paid once, not per step


class _Padded:
    pads_rows = True          # a real forward: every row padded to the longest


def _timed_round(k: int, batch: int, tokens_per_row: float, seconds: float,
                 prefill: float = 0.0) -> RoundResult:
    """A round of `batch` rows each drafting k and committing about tokens_per_row, timed."""
    n = [int(tokens_per_row)] * batch
    result = RoundResult(0, list(range(batch)), [k] * batch, [max(t - 1, 0) for t in n],
                         [[1] * t for t in n], [None] * batch, batch,
                         seconds={"target": seconds * 0.7, "propose": seconds * 0.3,
                                  **({"prefill": prefill} if prefill else {})})
    return result


def _drive(pol, batch: int, rounds: int, drafting: tuple[float, float],
           plain: tuple[float, float]) -> list[bool]:
    """Run the policy's choices against measured rounds: (tokens per row, seconds) for a round
    that drafts and one that does not. -> per round, whether any row drafted."""
    b = DecodeBatch.make_dummy(batch)
    out = []
    for _ in range(rounds):
        k = pol.specflow_draft_length(b).tolist()
        drafted = any(k)
        out.append(drafted)
        tokens, seconds = drafting if drafted else plain
        pol.specflow_observe(_timed_round(max(k), batch, tokens, seconds))
    return out


def test_goodput_measures_plain_decoding_at_each_batch_size_it_drafts_at():
    """After MIN_DRAFTED drafting rounds at a batch size, PLAIN_FIRST rounds run without drafts
    (their seconds price k = 0 from then on), and one after every explore_every drafting
    rounds keeps the measure current."""
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=4, explore_every=10),
                        SimpleNamespace(target=_Padded(), slots=4))
    pol.costs = lambda: (0.010, 0.0001, 0.0001, 0.0)        # drafting looks nearly free
    drafted = _drive(pol, 4, 80, drafting=(3, 0.015), plain=(1, 0.010))
    m, f = pol.MIN_DRAFTED, pol.PLAIN_FIRST
    assert drafted[:m] == [True] * m and drafted[m:m + f] == [False] * f
    later = drafted[m + f:]
    assert later.count(False) == len(later) // 11
    assert pol.plain_seconds(4) == pytest.approx(0.010) and pol.plain_seconds(3) is None
    # the synthetic pair's clock prices rows separately: nothing is forced there
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=4, explore_every=10))
    pol.costs = lambda: (0.010, 0.0001, 0.0001, 0.0)
    assert all(_drive(pol, 4, 30, drafting=(3, 0.015), plain=(1, 0.010)))


def test_a_rows_catch_up_is_charged_to_drafting_spread_over_the_rounds_it_has_left():
    """A draft that has not fed a row's prompt must prefill it before the row drafts: seconds
    plain decoding never spends. Charged once (spread over the drafting rounds the row has
    left), it keeps a loaded batch of fresh requests from drafting while a long request, or one
    whose draft is caught up, still drafts."""
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=4), SimpleNamespace(target=_Padded(), slots=16))
    pol.catch_up = LinearFit(0.05, 0.0, 20e-6)                  # 20 us per token
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
    pol._seen[batch.request_ids[0]] = 299
    assert pol.catch_up_costs(batch, acc)[0] == 0.0


def test_goodput_learns_the_catch_up_seconds_per_token_and_what_each_draft_holds():
    pol = GoodputPolicy(GoodputPolicyConfig(k_max=4), SimpleNamespace(target=_Padded(), slots=2))
    pol.costs = lambda: (0.010, 0.0001, 0.0001, 0.0)
    batch = DecodeBatch.make_dummy(2)
    rng = np.random.default_rng(0)
    for _ in range(40):
        for ids in batch.token_ids:               # rows grow by a random stretch between rounds
            ids.extend([1] * int(rng.integers(3, 60)))
        k = pol.specflow_draft_length(batch).tolist()
        lagged = sum(lag for _, lag in pol._fed.values())
        result = _timed_round(max(k), 2, 2, 0.015, prefill=30e-6 * lagged)
        pol.specflow_observe(result)
        if any(k):       # the drafts hold what was committed, but the last token
            assert pol._seen[0] == len(batch.token_ids[0]) + 2 - 1
    assert pol.catch_up.coef()[1] == pytest.approx(30e-6, rel=0.05)
    # a row given k but held at 0 after the policy (the length cap, the draft's own context)
    # was not fed: what its draft holds and the catch-up fit stay as they were
    seen, fit = dict(pol._seen), pol.catch_up.coef()
    batch.token_ids[0].extend([1] * 50)
    pol._since_plain.clear()                      # (not a round forced without drafts)
    assert pol.specflow_draft_length(batch).sum() > 0
    pol.specflow_observe(_timed_round(0, 2, 1, 0.010))
    assert pol._seen == seen and pol.catch_up.coef() == fit
    pol.specflow_request_end(0, SimpleNamespace(request_id=0), "length")
    assert 0 not in pol._seen


def test_a_measured_plain_round_replaces_the_fits_extrapolation():
    """The fit says a plain round at batch 16 costs 20 ms and a k = 2 round 34 ms (E = 2.4 a
    row: drafting pays); measured, a plain round costs 13 ms, and then it does not."""
    acc = np.full((16, 4), 0.8)
    costs = (0.012, 0.0005, 0.002, 0.0)
    assert max(choose_k_padded(acc, *costs)) > 0
    assert choose_k_padded(acc, *costs, plain=0.013) == [0] * 16
