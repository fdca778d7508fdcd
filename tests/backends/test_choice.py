"""One way to choose (backends/choice.py): a Choice's ways are measured in turns from the clock
handed to decide(), the rule decides, apply puts it into effect; Decided values pass through;
the times are kept per key; a backend's choices run in one ordered list and metrics.json says
what each chose."""
from __future__ import annotations

import pytest
import torch

from specflow.backends import choice_cache
from specflow.backends.choice import (Choice, Decided, decide, first_of_lasting_wins, mean_ratio,
                                      record, time_ends)

# what the choices at build time measure is replaced here: nothing is read back or kept
pytestmark = pytest.mark.times_choices


class Clock:
    """Moves only when a way runs: each way costs what `cost` says, nothing sleeps."""

    def __init__(self, cost: dict):
        self.now, self.cost, self.order = 0.0, cost, []

    def __call__(self) -> float:
        return self.now

    def measure(self, way, clock) -> list[float]:
        self.order.append(way)
        start = clock()
        self.now += self.cost[way]
        return [clock() - start]


def test_decide_times_the_ways_in_turns_from_the_given_clock_and_applies_the_rule():
    clock, applied = Clock({"a": 3.0, "b": 1.0, "c": 2.0}), []
    choice = Choice("demo", ("a", "b", "c"), clock.measure,
                    lambda best: min(best, key=lambda w: best[w][0]), applied.append, rounds=2)
    assert decide(choice, clock) == "b" and applied == ["b"]
    assert clock.order == ["a", "b", "c", "b", "c", "a"]          # round r starts with way r
    assert record(choice, "b") == "b"


def test_a_budget_on_the_clock_cuts_rounds_but_not_below_the_minimum():
    clock = Clock({"a": 5.0, "b": 5.0})
    choice = Choice("demo", ("a", "b"), clock.measure, lambda best: "a", rounds=10, budget_s=1.0)
    decide(choice, clock)
    assert len(clock.order) == 4                                   # min_rounds = 2


def test_a_decided_value_is_returned_untimed_and_described_as_given():
    assert decide(Decided(4)) == 4 and record(Decided(4), 4) == 4
    assert record(Decided(True, record="packed"), True) == "packed"


def test_the_times_are_kept_per_key_and_read_back_without_timing(monkeypatch, tmp_path):
    monkeypatch.setenv(choice_cache.ENABLE_ENV, "1")
    monkeypatch.setenv(choice_cache.FOLDER_ENV, str(tmp_path))
    runs = []

    def measure(way, clock):                    # read from the real clock: kept
        runs.append(way)
        return [{"a": 2.0, "b": 1.0}[way]]

    def build(key, measure=measure):
        return Choice("kept", ("a", "b"), measure, lambda best: min(best, key=best.get),
                      key=key, rounds=1, min_rounds=1)

    with choice_cache.recording() as seen:
        assert decide(build({"n": 1})) == "b"
    assert seen == {"kept": "timed"} and len(runs) == 2
    with choice_cache.recording() as seen:
        assert decide(build({"n": 1})) == "b"
    assert seen == {"kept": "cache"} and len(runs) == 2                 # nothing ran
    decide(build({"n": 2}))                                             # another key: timed
    assert len(runs) == 4 and len(list(tmp_path.iterdir())) == 2
    # a fake clock's times mean nothing to a later run: neither read back nor kept
    clock = Clock({"a": 1.0, "b": 2.0})
    assert decide(build({"n": 1}, clock.measure), clock) == "a"
    assert decide(build({"n": 3}, clock.measure), clock) == "a"
    assert len(clock.order) == 4 and len(list(tmp_path.iterdir())) == 2


def test_rules_shared_by_choosers():
    assert first_of_lasting_wins([False, True, False, True, True]) == 3
    assert first_of_lasting_wins([True, True]) == 0 and first_of_lasting_wins([False]) is None
    assert mean_ratio([1.0, 4.0], [2.0, 2.0]) == 1.25


def test_time_ends_hands_a_clock_only_where_one_is_given():
    class Backend:                       # a plugin's time_pass, written before clocks were
        def time_pass(self, rows=1, positions=1, reps=5):
            return float(rows * positions)

    assert time_ends(Backend(), rows=4, positions=3, reps=1) == [1.0, 12.0]
    with pytest.raises(TypeError):
        time_ends(Backend(), rows=1, positions=1, reps=1, clock=lambda: 0.0)


def test_a_target_makes_its_choices_in_order_and_says_what_each_chose(monkeypatch):
    from specflow import Pipeline
    from specflow.backends.hf.backend import HFBackend
    from specflow.backends.lean.native_pass import NativePass

    order = []
    real = HFBackend.choice_plans

    def spy(self):
        plans = real(self)
        return [(name, lambda *a, _n=name, _p=plan: order.append((self.role, _n)) or _p(*a))
                for name, plan in plans]

    monkeypatch.setattr(HFBackend, "choice_plans", spy)
    before = torch.get_num_threads()
    try:
        pipe = Pipeline.from_config(["model=demo", "threads=1", "native=false", "pack=false"])
    finally:
        torch.set_num_threads(before)
    assert order == [("model", "threads"), ("model", "native"), ("model", "pack"),
                     ("draft", "native"), ("draft", "pack")]
    chosen = pipe.target.describe()["chosen"]
    assert chosen["threads"] == 1 and chosen["pack"] is False
    assert chosen["native"] is (False if NativePass.supported(pipe.target.lean) else None)
