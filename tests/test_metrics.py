"""Metric definitions (docs/design.md §3): examined, not proposed, is what alpha divides by."""
from __future__ import annotations

import pytest

from specflow.metrics import Counters, predicted_speedup


@pytest.mark.parametrize("k,accepted,examined", [(4, 0, 1), (4, 2, 3), (4, 4, 4), (0, 0, 0),
                                                 (1, 1, 1), (1, 0, 1)])
def test_examined_drafts(k, accepted, examined):
    c = Counters()
    c.add_row(k, accepted, accepted + 1)
    assert c.num_examined_draft_tokens == examined
    assert c.num_draft_tokens == k
    assert sum(c.examined_per_position) == examined and sum(c.accepted_per_position) == accepted


def test_alpha_and_acceptance_rate_differ_exactly_by_never_examined_drafts():
    c = Counters()
    for k, a in [(8, 0), (8, 8), (8, 3)]:
        c.add_row(k, a, a + 1)
    d = c.derived()
    assert d["acceptance_rate"] == pytest.approx(11 / 24)
    assert d["alpha"] == pytest.approx(11 / (1 + 8 + 4))
    assert d["mean_acceptance_length"] == pytest.approx((1 + 9 + 4) / 3)
    assert c.tokens_per_step_histogram == {1: 1, 9: 1, 4: 1}


def test_predicted_speedup_formula():
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.4)
    assert predicted_speedup(1.0, 4, 0.0) == 5.0
    assert predicted_speedup(0.5, 0, 0.1) == 1.0
    # half the rounds draft 4 tokens at alpha 0.8, half have nothing to propose
    assert predicted_speedup(0.8, 4, 0.1, drafting=0.5) == pytest.approx(
        (0.5 * (1 - 0.8 ** 5) / 0.2 + 0.5) / (0.5 * 0.4 + 1))


def test_taking_back_tokens_keeps_the_histogram_and_the_count_in_agreement():
    from specflow.metrics import MetricsRecorder
    from specflow.state import RoundResult

    rec = MetricsRecorder()
    rec.start(0)
    for committed in (3, 2, 0):
        rec.specflow_observe(RoundResult(0, [0], [4], [committed], [[1] * committed], [None], 1))
    rec.retract(0, 3)                      # a stop string that began two rounds back
    for c in (rec.requests[0], rec.total):
        assert c.num_committed_tokens == 2
        assert sum(n * k for n, k in c.tokens_per_step_histogram.items()) == 2
        assert c.tokens_per_step_histogram == {2: 1, 0: 2}


@pytest.mark.parametrize("ending", [
    ["constraint=choice", "constraint.choices=[yes,no,maybe]"],   # the grammar ends in an EOS
    ["stop.strings=[o]"],                                         # a stop string, trimmed
])
def test_tau_of_plain_decoding_is_one_whatever_ends_the_requests(ending):
    """A trial found tau 0.79 for plain decoding with a grammar: the pass that drew the ending
    EOS was counted, its token was not."""
    from specflow import Pipeline

    pipe = Pipeline.from_config(overrides=["proposer=none", "pack=false", *ending])
    results = pipe.generate(["def fib(n):", "import os\n", "x = 1"], max_new_tokens=12)
    s = pipe.last_stats
    assert any(r.finish_reason in ("eos", "stop") for r in results)
    assert s["mean_acceptance_length"] == 1.0
    assert s["num_drawn_tokens"] == s["num_target_passes"]
    assert s["num_committed_tokens"] == sum(len(r.token_ids) for r in results)
    for r in results:
        assert r.stats["mean_acceptance_length"] == 1.0
