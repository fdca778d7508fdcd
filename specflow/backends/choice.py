"""One way to choose: a `Choice` names the ways of doing the same work, how one way is measured,
the rule that decides from the measurements, and how the decision is applied and described.
`decide()` runs every choice the same way: the ways in turns (backends/turns.py), the times kept
per machine, model and settings (backends/choice_cache.py), then the rule, then apply.

The choices a backend makes when a pipeline is built run in one ordered list per role
(`HFBackend.CHOICES`: threads, then native, then pack for a target; native, then the draft's
pack for a draft model), each built from the state the earlier ones left (its key holds it).
A chooser module gives `plan(backend, setting, positions, rows)`: a `Choice` to decide, or a
`Decided` value where nothing needs timing (a setting given, a backend with nothing to compare).

Every measurement reads time from the `clock` handed to `decide()` (time.perf_counter by
default), so a test decides with a fake clock instead of sleeping.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

from specflow.backends.turns import in_turns

Clock = Callable[[], float]                              # seconds, as time.perf_counter


@dataclass
class Choice:
    """A choice between `ways` (a thread count, True/False, a product form: anything hashable).

    measure(way, clock): the times (seconds) of one measurement of `way`, the way in effect
    while it runs and undone after. rule({way: least times}): the decision. apply(decision): puts
    it into effect. describe(decision): what metrics.json records of it (JSON). key: what the
    times depend on besides the machine (None: keep nothing on disk)."""
    name: str
    ways: Sequence[Hashable]
    measure: Callable[[Hashable, Clock], Sequence[float]]
    rule: Callable[[dict], Any]
    apply: Callable[[Any], None] = lambda decision: None
    describe: Callable[[Any], Any] = lambda decision: decision
    key: Mapping | None = None
    rounds: int = 3
    min_rounds: int = 2
    budget_s: float | None = None      # no new round past it (min_rounds still run)
    warm_up: bool = False              # each way once, untimed, first


@dataclass(frozen=True)
class Decided:
    """A decision made and applied without timing anything (`value`, described as `record`)."""
    value: Any
    record: Any = field(default=None)


def times(choice: Choice, clock: Clock = time.perf_counter) -> dict:
    """{way: least times} for `choice`, measured in turns or read back (choice_cache)."""
    deadline = None if choice.budget_s is None else clock() + choice.budget_s
    # only the real clock's times are kept: a fake clock's (a test's) mean nothing to a later run
    real = clock is time.perf_counter
    kept = {} if choice.key is None or not real else {"choice": choice.name, "key": dict(choice.key)}
    best = in_turns([lambda w=w: choice.measure(w, clock) for w in choice.ways], choice.rounds,
                    deadline, choice.min_rounds, warm_up=choice.warm_up, clock=clock, **kept)
    return dict(zip(choice.ways, best))


def decide(choice: Choice | Decided, clock: Clock = time.perf_counter) -> Any:
    """The decision for `choice`, applied (a `Decided` is returned as it is)."""
    if isinstance(choice, Decided):
        return choice.value
    decision = choice.rule(times(choice, clock))
    choice.apply(decision)
    return decision


def record(choice: Choice | Decided, decision: Any) -> Any:
    """What metrics.json says was chosen."""
    if isinstance(choice, Decided):
        return choice.value if choice.record is None else choice.record
    return choice.describe(decision)


def kept_for(backend, name: str, **settings) -> Mapping | None:
    """A Choice's key for passes of `backend` under `settings` (rows, positions, repeats...):
    the backend's own (`choice_key()`: its model's files, dtype, cache and the state its earlier
    choices left) with them; None (time, keep nothing) for a backend that has none."""
    own = backend.choice_key()
    return None if own is None else {**own, **settings}


# --- rules shared by choosers ---------------------------------------------------------------------

def time_ends(backend, rows: int, positions: int, reps: int,
              clock: Clock = time.perf_counter) -> list[float]:
    """Seconds of the two passes a pipeline runs between (`Backend.time_pass`, median of
    `reps`): one row at one position (plain decoding of a lone request) and its fullest, `rows`
    rows at `positions` (one pass when both are one)."""
    ends = sorted({(1, 1), (rows, positions)})                                   # (rows, positions)
    return [time_pass(backend, r, p, reps, clock) for r, p in ends]


def time_pass(backend, rows: int, positions: int, reps: int, clock: Clock) -> float:
    """backend.time_pass read from `clock`; the clock is handed over only where it is not the
    default, so a backend written before clocks were (a plugin's) still times."""
    kw = {} if clock is time.perf_counter else {"clock": clock}
    return backend.time_pass(rows=rows, positions=positions, reps=reps, **kw)


def mean_ratio(trial: Sequence[float], base: Sequence[float]) -> float:
    """The mean of trial/base, end by end: each end counts for its own relative cost (a sum of
    times lets the dearest pass decide alone)."""
    return sum(t / b for t, b in zip(trial, base)) / len(base)


def first_of_lasting_wins(wins: Sequence[bool]) -> int | None:
    """The first index from which every later point is won too (points ordered by size), or
    None: where a way wins the wider points only, it serves from there."""
    return next((i for i in range(len(wins)) if all(wins[i:])), None)


def fastest(best: Mapping) -> Hashable:
    """The way of least summed time (the first listed of equals)."""
    return min(best, key=lambda way: sum(best[way]))
