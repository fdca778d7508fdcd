"""Choosing k: per row for rows priced separately, for the batch when a pass pads its rows."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specflow.policies.goodput.choose import choose_k, choose_k_padded, expected_tokens


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
def test_the_per_row_choice_table(acceptance, costs, expected):
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
def test_a_padded_pass_is_priced_for_the_whole_batch(acceptance, costs, expected):
    acc = torch.tensor(acceptance)[:, None].expand(len(acceptance), 8)
    assert choose_k_padded(acc, *costs) == expected


def _padded_rate(E, ks, a_t, b_t, a_d, b_d) -> float:
    """Expected tokens per second of a round whose pass pads every row to the longest draft."""
    B = len(ks)
    return sum(E[b, k] for b, k in enumerate(ks)) / (
        a_t + b_t * B * (max(ks) + 1) + a_d * max(ks) + b_d * sum(ks))


def test_the_padded_choice_is_the_best_of_every_combination():
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


def test_k_falls_as_batch_and_per_token_cost_grow():
    acc = torch.full((1, 8), 0.8)
    ks = [choose_k(acc.expand(b, 8), 1.0, 0.01, 0.05, 0.001)[0] for b in (1, 8, 64, 256)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]


@pytest.mark.parametrize("chooser", [choose_k, choose_k_padded])
def test_a_fixed_cost_of_drafting_at_all_can_make_k_zero(chooser):
    acc = np.full((2, 6), 0.6)
    costs = (1.0, 0.0, 0.05, 0.0)
    assert max(chooser(acc, *costs)) > 0
    assert chooser(acc, *costs, first=5.0) == [0, 0]     # five passes' worth to draft at all
    deep = chooser(np.full((2, 6), 0.9), *costs, first=0.5)
    assert min(deep) >= max(chooser(np.full((2, 6), 0.9), *costs)) - 1   # paid once, not per step


def test_a_measured_plain_round_replaces_the_fits_extrapolation():
    """The fit says a plain round at batch 16 costs 20 ms and a k = 2 round 34 ms (E = 2.4 a
    row: drafting pays); measured, a plain round costs 13 ms, and then it does not."""
    acc = np.full((16, 4), 0.8)
    costs = (0.012, 0.0005, 0.002, 0.0)
    assert max(choose_k_padded(acc, *costs)) > 0
    assert choose_k_padded(acc, *costs, plain=0.013) == [0] * 16


def test_drafting_is_priced_from_the_measured_plain_round_when_the_fit_says_less():
    """A plain round measured dearer than the fit's line says (a busy hour, a longer context)
    must not make drafting look cheap: a cap costs at least the measured round plus the fit's
    price of its extra positions. Here a plain round measures 24 ms where the fit says 20; a
    k = 1 round is 24 + 8 ms, 1.33x, so rows committing 1.3 tokens do not draft (priced from the
    fit alone, 28 ms against the measured 24, they did) and rows committing 1.9 do."""
    costs = (0.012, 0.0005, 0.0, 0.0)              # the fit: plain 20 ms, k = 1 28 ms
    assert choose_k_padded(np.full((16, 4), 0.3), *costs, plain=0.024) == [0] * 16
    assert max(choose_k_padded(np.full((16, 4), 0.9), *costs, plain=0.024)) > 0


def test_a_rows_own_first_draft_cost_holds_it_back_alone():
    """row_first: seconds a row adds to the round if it drafts at all (its draft's catch-up):
    the row that owes them stops drafting, the others do not; asked only past the common
    answer (a callable is not called when nothing can pay)."""
    acc = np.full((4, 4), 0.8)
    costs = (0.012, 0.0005, 0.0008, 0.0)
    assert min(choose_k_padded(acc, *costs, row_first=[0.0] * 4)) > 0
    k = choose_k_padded(acc, *costs, row_first=[0.0, 0.0, 0.0, 1.0])
    assert k[3] == 0 and min(k[:3]) > 0
    asked = []
    assert choose_k_padded(acc, 1.0, 1.0, 0.05, 0.0, row_first=lambda: asked.append(1)) == [0] * 4
    assert asked == []


def test_a_tree_of_several_positions_per_level_drafts_shallower():
    acc = torch.full((4, 6), 0.8)
    costs = (1.0, 0.05, 0.02, 0.0)             # each scored position costs 5% of a pass
    tree = 1 + np.minimum(4 * np.arange(7), 16)                 # four nodes per level, at most 16
    assert max(choose_k_padded(acc, *costs, positions=tree)) < max(choose_k_padded(acc, *costs))
