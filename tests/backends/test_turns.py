"""Ways of doing the same work timed in turns (backends/turns.py): each way's least time, the
first of each round rotating, at least two rounds past a budget; a neighbour's burst that turns
a choice timed in blocks leaves the choice in turns alone."""
from __future__ import annotations

import time

from specflow.backends.turns import in_turns


def test_rounds_rotate_and_each_way_keeps_its_least_times():
    calls = []
    times = {"a": iter([[3.0, 5.0], [2.0, 6.0], [4.0, 1.0]]), "b": iter([[9.0], [7.0], [8.0]])}

    def way(name):
        def cost():
            calls.append(name)
            return next(times[name])
        return cost

    best = in_turns([way("a"), way("b")], rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert best == [[2.0, 1.0], [7.0]]


def test_a_spent_budget_cuts_repeats_but_not_the_alternation():
    calls = []
    best = in_turns([lambda: calls.append("a") or [1.0], lambda: calls.append("b") or [2.0]],
                    rounds=10, deadline=time.perf_counter() - 1)
    assert calls == ["a", "b", "b", "a"] and best == [[1.0], [2.0]]


class Machine:
    """Two ways of equal work, one 10% faster; a neighbour's burst doubles whatever runs during
    three consecutive measurements."""

    def __init__(self, burst_from: int):
        self.clock, self.burst = 0, range(burst_from, burst_from + 3)

    def way(self, cost: float):
        def measure():
            slow = 2.0 if self.clock in self.burst else 1.0
            self.clock += 1
            return [cost * slow]
        return measure


def in_blocks(ways, rounds: int) -> list[float]:
    """The old way: every repeat of one way, then every repeat of the next."""
    return [min(w()[0] for _ in range(rounds)) for w in ways]


def test_a_burst_turns_a_choice_timed_in_blocks_but_not_one_timed_in_turns():
    fast, slow = 1.0, 1.1
    blocks = Machine(burst_from=0)
    assert in_blocks([blocks.way(fast), blocks.way(slow)], rounds=3) == [2.0, 1.1]   # turned
    for start in range(6):         # wherever the burst starts, the faster way stays the faster
        turns = Machine(burst_from=start)
        best = in_turns([turns.way(fast), turns.way(slow)], rounds=3)
        assert best[0][0] < best[1][0], start
