"""Least-squares fits that forget: what the goodput policy learns its costs with.

Costs drift (a machine gets busy, kernels warm up, the batch changes what a pass costs), so each
fit weighs its newest observation by `memory` and every older one by (1 - memory) more per
observation: an exponentially weighted least-squares fit. Each is shrunk by a weak ridge towards
a prior (what was timed when the pipeline was built, or a guess), so data that cannot separate
the weights (every round alike) fall back to the prior's split instead of to nonsense, and every
weight is kept >= 0 (a cost is never negative).

- TwoTermFit: y = a x1 + b x2, no intercept (plain floats: it is read every round);
- LineFit: y = a + b x, a TwoTermFit with x1 = 1 (a target pass's seconds over the positions it
  computes; a draft's catch-up seconds over the tokens it feeds);
- DraftCostFit: a round's drafting seconds = fixed + per_step x steps + per_token x tokens, whose
  prior also weighs as a few observations at first (three weights are pinned by three rounds).
"""
from __future__ import annotations

import numpy as np

RIDGE = 1e-3      # the prior's weight against the data, relative to the data's own scale


class TwoTermFit:
    """y = a x1 + b x2 (no intercept) by exponentially weighted least squares with a weak ridge
    towards the prior (a, b), so collinear or missing data fall back to it; a, b >= 0."""

    def __init__(self, memory: float, a: float, b: float):
        self.memory, self.prior = memory, (a, b)
        # discounted sums of x1 x1, x1 x2, x2 x2, x1 y, x2 y (plain floats: read every round)
        self.s11 = self.s12 = self.s22 = self.s1y = self.s2y = 0.0
        self.n = 0.0                                  # discounted count of observations

    def add(self, x1: float, x2: float, y: float) -> None:
        d = 1 - self.memory
        self.s11, self.s12, self.s22 = d * self.s11 + x1 * x1, d * self.s12 + x1 * x2, \
            d * self.s22 + x2 * x2
        self.s1y, self.s2y, self.n = d * self.s1y + x1 * y, d * self.s2y + x2 * y, d * self.n + 1

    def coef(self) -> tuple[float, float]:
        """(a, b): the prior until something is added."""
        if self.n == 0:
            return self.prior
        pa, pb = self.prior
        l1, l2 = RIDGE * self.s11 + 1e-12, RIDGE * self.s22 + 1e-12   # scale-free ridge
        m11, m22, m12 = self.s11 + l1, self.s22 + l2, self.s12
        r1, r2 = self.s1y + l1 * pa, self.s2y + l2 * pb
        det = m11 * m22 - m12 * m12                   # > 0: the ridge keeps it positive definite
        a, b = (m22 * r1 - m12 * r2) / det, (m11 * r2 - m12 * r1) / det
        return max(a, 0.0), max(b, 0.0)


class LineFit:
    """y = a + b x by exponentially weighted least squares, shrunk towards the prior (a, b);
    a, b >= 0. The target's pass: seconds = a + b positions; a draft's catch-up: seconds =
    b tokens (a = 0)."""

    def __init__(self, memory: float, a: float, b: float = 0.0):
        self.fit = TwoTermFit(memory, a, b)

    def add(self, x: float, y: float) -> None:
        self.fit.add(1.0, x, y)

    def coef(self) -> tuple[float, float]:
        """(a, b): the prior until something is added."""
        return self.fit.coef()


class DraftCostFit:
    """A round's drafting seconds = fixed + per_step x steps + per_token x tokens (steps: the
    longest draft, or a tree's depth; tokens: drafted over all rows, a tree's nodes), fitted as
    TwoTermFit is (discounted least squares, a weak ridge towards the prior, each weight >= 0).

    The fixed cost of drafting at all in a round (the first step's shaping, a tree's selection)
    is its own weight: spread over the steps it made deep drafts look dear.

    Three weights are pinned by three observations, so the first few (a warm-up round that
    builds kernels for new shapes, several times the usual seconds) would set them alone; and a
    fit that prices drafting out is not corrected, since rounds that draft nothing add no data.
    So the prior also counts as PRIOR_ROUNDS observations at first, fading as observations
    arrive (half after FADE of them): early rounds are shrunk towards it, later ones are not."""

    PRIOR_ROUNDS, FADE = 4.0, 10.0

    def __init__(self, memory: float, prior: tuple[float, float, float]):
        """prior: (fixed, per_step, per_token) seconds."""
        self.memory, self.prior = memory, np.asarray(prior, dtype=np.float64)
        self.sxx, self.sxy, self.n = np.zeros((3, 3)), np.zeros(3), 0.0
        self.added = 0                                  # observations ever added (no discount)
        self.solved: tuple[float, ...] | None = None    # the weights, solved once per observation

    def add(self, steps: float, tokens: float, seconds: float) -> None:
        x = np.array([1.0, steps, tokens], dtype=np.float64)
        d = 1 - self.memory
        self.sxx = d * self.sxx + np.outer(x, x)
        self.sxy, self.n = d * self.sxy + x * seconds, d * self.n + 1
        self.added += 1
        self.solved = None

    def coef(self) -> tuple[float, float, float]:
        """(fixed, per_step, per_token): the prior until something is added."""
        if self.solved is not None:
            return self.solved
        if self.n == 0:
            return tuple(self.prior.tolist())
        mean_sq = np.diag(self.sxx) / self.n                              # a typical x_i^2
        early = self.PRIOR_ROUNDS * self.FADE / (self.FADE + self.added)  # pseudo-observations
        ridge = (RIDGE * self.n + early) * mean_sq + 1e-12                # scale-free
        w = np.linalg.solve(self.sxx + np.diag(ridge), self.sxy + ridge * self.prior)
        self.solved = tuple(np.maximum(w, 0.0).tolist())
        return self.solved
