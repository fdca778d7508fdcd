"""What the policy does to keep measuring the choice it is not making.

- PlainRounds: with padded rows (a real target) the k = 0 choice is priced by measured rounds
  without drafts at the batch size, not by the cost fit's line: the fit is solved on the
  positions rounds compute, and while every round drafts it only sees 2B positions and more, so
  its a_t + b_t B for plain decoding is an extrapolation (too dear, so drafting looked worth
  it: docs/decisions.md, "Plain decoding is measured, not extrapolated"). So at a batch size
  that has drafted MIN_DRAFTED rounds (past the first rounds' warm-up), the next PLAIN_FIRST
  rounds run without drafts, and then one after every `explore_every` drafting rounds.
- IdleProbes: after a stretch of rounds without drafts the likeliest row probes k = 1, so what
  drafting costs and gains keeps being measured. With padded rows the probe makes every row
  score one more position, so it comes B times less often (the same share of the time at any
  load).
"""
from __future__ import annotations

import statistics
from collections import deque

import numpy as np


class PlainRounds:
    PLAIN_KEPT, PLAIN_FIRST = 5, 3   # rounds without drafts kept per batch size; measured first
    MIN_DRAFTED = 4                  # drafting rounds at a batch size before plain is measured

    def __init__(self, explore_every: int, padded: bool):
        self.explore_every, self.padded = explore_every, padded
        # per batch size: the seconds of its last PLAIN_KEPT rounds without drafts (padded rows)
        self.plain_times: dict[int, deque[float]] = {}
        self.drafted_since_plain: dict[int, int] = {}   # drafting rounds since its last plain one
        self.drafted: dict[int, int] = {}               # drafting rounds ever

    def seconds(self, batch_size: int) -> float | None:
        """Seconds of a round without drafts at this batch size as measured: the median of the
        last PLAIN_KEPT, so one slow round does not set it; None before any."""
        times = self.plain_times.get(batch_size)
        return statistics.median(times) if times else None     # (numpy's is far slower)

    def check(self, k: list[int]) -> list[int]:
        """k, or no drafts for every row when this round is one that measures plain decoding."""
        size = len(k)
        if not (self.padded and size and any(k)):
            return k
        first = self.drafted.get(size, 0) >= self.MIN_DRAFTED \
            and len(self.plain_times.get(size, ())) < self.PLAIN_FIRST
        if first or self.drafted_since_plain.get(size, 0) >= self.explore_every:
            return [0] * size
        return k

    def record(self, batch_size: int, drafted: bool, seconds: float) -> None:
        """A round at this batch size: whether any row drafted, and its own seconds (a new
        prompt's catch-up and the policy's time left out)."""
        if self.padded and not drafted and seconds > 0:   # plain decoding, measured
            self.plain_times.setdefault(batch_size, deque(maxlen=self.PLAIN_KEPT)).append(seconds)
            self.drafted_since_plain[batch_size] = 0
        elif drafted:
            self.drafted_since_plain[batch_size] = self.drafted_since_plain.get(batch_size, 0) + 1
            self.drafted[batch_size] = self.drafted.get(batch_size, 0) + 1


class IdleProbes:
    def __init__(self, explore_every: int, padded: bool):
        self.explore_every, self.padded = explore_every, padded
        self.idle_rounds = 0           # rounds in a row in which no row drafted

    def probe(self, k: list[int], acceptance: np.ndarray) -> list[int]:
        """k, with the likeliest row (acceptance [B, K]) at 1 once enough rounds drafted
        nothing: explore_every rounds (x B with padded rows)."""
        size = len(k)
        self.idle_rounds = self.idle_rounds + 1 if size and not any(k) else 0
        if self.idle_rounds >= self.explore_every * (size if self.padded else 1):
            k[int(acceptance[:, 0].argmax())] = 1
            self.idle_rounds = 0
        return k
