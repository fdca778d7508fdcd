"""The rounds the policy forces to keep measuring: plain rounds while it drafts, probes while
it does not."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specflow.policies.goodput import GoodputPolicy, GoodputPolicyConfig
from specflow.policies.goodput.explore import IdleProbes, PlainRounds
from specflow.state import DecodeBatch

from tests.policies.goodput.fakes import PaddedTarget, timed_round


class FixedCosts(GoodputPolicy):
    """The goodput policy with costs held where a test puts them (the oracle's override)."""

    def __init__(self, cfg, ctx=None, costs=(0.010, 0.0001, 0.0001, 0.0)):
        super().__init__(cfg, ctx)
        self.fixed_costs = costs

    def costs(self):
        return self.fixed_costs


@pytest.mark.parametrize("padded,batch,interval", [(False, 4, 50), (True, 4, 200), (True, 1, 50)])
def test_goodput_probes_after_idle_rounds_less_often_when_a_probe_pads_every_row(padded, batch,
                                                                                 interval):
    ctx = SimpleNamespace(target=PaddedTarget()) if padded else None
    pol = FixedCosts(GoodputPolicyConfig(k_max=4, explore_every=50), ctx,
                     costs=(1.0, 10.0, 1.0, 1.0))          # drafting never pays
    b = DecodeBatch.make_dummy(batch)
    probes = [r for r in range(1, 2 * interval + 1) if pol.specflow_draft_length(b).sum() > 0]
    assert probes == [interval, 2 * interval]


def test_a_probe_goes_to_the_likeliest_row():
    probes = IdleProbes(explore_every=2, padded=False)
    acceptance = np.array([[0.2], [0.9], [0.5]])
    assert probes.probe([0, 0, 0], acceptance) == [0, 0, 0]
    assert probes.probe([0, 0, 0], acceptance) == [0, 1, 0]
    assert probes.probe([0, 2, 0], acceptance) == [0, 2, 0] and probes.idle_rounds == 0


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
        pol.specflow_observe(timed_round(max(k), batch, tokens, seconds))
    return out


def test_goodput_measures_plain_decoding_at_each_batch_size_it_drafts_at():
    """After MIN_DRAFTED drafting rounds at a batch size, PLAIN_FIRST rounds run without drafts
    (their seconds price k = 0 from then on), and one after every explore_every drafting
    rounds keeps the measure current."""
    pol = FixedCosts(GoodputPolicyConfig(k_max=4, explore_every=10),
                     SimpleNamespace(target=PaddedTarget(), slots=4))   # drafting: nearly free
    drafted = _drive(pol, 4, 80, drafting=(3, 0.015), plain=(1, 0.010))
    m, f = PlainRounds.MIN_DRAFTED, PlainRounds.PLAIN_FIRST
    assert drafted[:m] == [True] * m and drafted[m:m + f] == [False] * f
    later = drafted[m + f:]
    assert later.count(False) == len(later) // 11
    assert pol.plain_seconds(4) == pytest.approx(0.010) and pol.plain_seconds(3) is None
    # the synthetic pair's clock prices rows separately: nothing is forced there
    pol = FixedCosts(GoodputPolicyConfig(k_max=4, explore_every=10))
    assert all(_drive(pol, 4, 30, drafting=(3, 0.015), plain=(1, 0.010)))


def test_plain_seconds_are_the_median_of_the_last_few_plain_rounds():
    plain = PlainRounds(explore_every=10, padded=True)
    for seconds in (0.050, 0.010, 0.011, 0.012, 0.013, 0.014):    # the first, slow, drops out
        plain.record(4, drafted=False, seconds=seconds)
    assert plain.seconds(4) == pytest.approx(0.012)
    assert plain.seconds(8) is None
