"""Pearson's chi-square tests, as `specflow report` and the exactness tests use them.

The p-value is the chi-square distribution's survival function, P(X > x) for x ~ chi2(dof),
which is the regularized upper incomplete gamma function Q(dof / 2, x / 2) (Abramowitz and
Stegun 26.4.19; torch.special.gammaincc, in float64). The statistics follow Pearson (1900); the
2 x 2 table takes Yates's continuity correction, as scipy.stats.chi2_contingency does by default.
specflow computes them with torch rather than importing scipy: transformers imports scipy's
optimizer whenever scipy is installed, which adds a third of a second to every start.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class ChiSquare(NamedTuple):
    statistic: float
    pvalue: float
    dof: int


def survival(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi-square with `dof` degrees of freedom (dof >= 1)."""
    if dof < 1:
        raise ValueError(f"dof={dof}: a chi-square distribution needs dof >= 1")
    if x <= 0:
        return 1.0
    a = torch.tensor(dof / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(x / 2, dtype=torch.float64)))


def goodness_of_fit(observed, expected) -> ChiSquare:
    """Do counts `observed` [k] follow `expected` [k] (the same total)? dof = k - 1."""
    o = np.asarray(observed, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if o.shape != e.shape or o.ndim != 1 or len(o) < 2:
        raise ValueError(f"observed {o.shape} and expected {e.shape}: two 1-D arrays of the "
                         f"same length >= 2")
    if not np.isclose(o.sum(), e.sum(), rtol=1e-8):
        raise ValueError(f"observed sums to {o.sum()} and expected to {e.sum()}: scale the "
                         f"expected counts to the observed total")
    stat = float(((o - e) ** 2 / e).sum())
    return ChiSquare(stat, survival(stat, len(o) - 1), len(o) - 1)


def independence(table) -> ChiSquare:
    """Are the rows of a contingency table [r, c] (counts, every row and column nonzero) draws
    of one distribution? dof = (r - 1)(c - 1); a 2 x 2 table takes Yates's correction."""
    t = np.asarray(table, dtype=np.float64)
    if t.ndim != 2 or min(t.shape) < 2:
        raise ValueError(f"a table of shape {t.shape}: the test needs at least 2 x 2")
    expected = t.sum(1, keepdims=True) * t.sum(0, keepdims=True) / t.sum()     # [r, c]
    if (expected == 0).any():
        raise ValueError("a row or column of the table is all zeros: drop it before testing")
    dof = (t.shape[0] - 1) * (t.shape[1] - 1)
    diff = np.abs(t - expected)
    if dof == 1:
        diff = np.maximum(diff - 0.5, 0.0)
    stat = float((diff ** 2 / expected).sum())
    return ChiSquare(stat, survival(stat, dof), dof)
