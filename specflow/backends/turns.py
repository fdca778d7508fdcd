"""Timing ways of doing the same work on a machine that others share: in turns, keeping each
way's least time.

The choices made when a pipeline starts (the product form for a number of rows, the thread count,
the native pass or the eager layers, packed or dense weights) time two or more ways of doing the
same work and keep the fastest. On a shared machine a neighbour's burst slows whatever runs while
it lasts, memory-bound work above all (a cloud VM shares its socket's memory bandwidth):
SmolLM2's one-row products over all its weights took 14-27 ms from one measurement to the next on
a 2-core EPYC VM. Timed one way after the other, each in a block of its own, a burst lands on one
of them and turns the choice: the native product lost its one-row pick to a form that streams no
faster, and with it the whole native pass (a decoding pass 1.5x slower for the whole run). Taken
in turns, the first of each round rotating, a burst lands on every way alike, and each way's
least time is what it costs undisturbed.

A Choice's ways are measured here (backends/choice.py). Given a `choice` name and its `key`,
the times are kept on disk and read back while the key stays the same
(backends/choice_cache.py): a second run on the same machine times nothing.
"""
from __future__ import annotations

import numbers
import time
from typing import Callable, Mapping, Sequence

Cost = Callable[[], Sequence[float]]     # one measurement of one way: its times (seconds)


def in_turns(costs: Sequence[Cost], rounds: int, deadline: float | None = None,
             min_rounds: int = 2, *, choice: str | None = None, key: Mapping | None = None,
             warm_up: bool = False, clock: Callable[[], float] = time.perf_counter
             ) -> list[list[float]]:
    """Each way's least times, element by element, over `rounds` rounds in which every way is
    measured once (round r starts with way r mod n, the rest in order). Past `deadline` (a
    `clock()` value) no further round starts, but at least `min_rounds` run: a budget
    cuts repeats, never the alternation. `warm_up`: each way runs once, untimed, first (its
    first calls pick kernels and allocate).

    With `choice` (the chooser's name) and `key` (what its times depend on besides the machine:
    shapes, settings, the model's files, the state the ways run in), the times kept from an
    earlier run under the same key are returned and nothing runs (backends/choice_cache.py)."""
    def timed() -> list[list[float]]:
        if warm_up:
            for cost in costs:
                cost()
        return _in_turns(costs, rounds, deadline, min_rounds, clock)

    if choice is None:
        return timed()
    from specflow.backends import choice_cache

    def usable(kept) -> bool:      # one list of numbers per way
        return isinstance(kept, list) and len(kept) == len(costs) and all(
            isinstance(t, list) and all(isinstance(x, numbers.Real) for x in t) for t in kept)

    return choice_cache.recall(choice, {"ways": len(costs), **(key or {})}, timed, usable)


def _in_turns(costs: Sequence[Cost], rounds: int, deadline: float | None,
              min_rounds: int, clock: Callable[[], float]) -> list[list[float]]:
    best: list[list[float] | None] = [None] * len(costs)
    n = len(costs)
    for r in range(max(rounds, min_rounds)):
        if r >= min_rounds and deadline is not None and clock() > deadline:
            break
        for i in [(r + j) % n for j in range(n)]:
            got = list(costs[i]())
            best[i] = got if best[i] is None else [min(a, b) for a, b in zip(best[i], got)]
    return [b or [] for b in best]
