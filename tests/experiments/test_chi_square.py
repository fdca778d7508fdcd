"""The chi-square tests against closed forms: chi2(1)'s survival is erfc(sqrt(x / 2)) and
chi2(2)'s is exp(-x / 2); textbook critical values; Pearson's statistic by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from specflow.experiments.chi_square import goodness_of_fit, independence, survival


@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 3.841458820694124, 10.0, 40.0])
def test_survival_equals_the_closed_forms(x):
    assert survival(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-10)
    assert survival(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
    # dof 4: exp(-x/2) (1 + x/2)
    assert survival(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-10)


@pytest.mark.parametrize("x,dof,p", [(3.841458820694124, 1, 0.05), (18.307038053275146, 10, 0.05),
                                     (135.80672317102676, 100, 0.01), (0.0, 3, 1.0)])
def test_survival_at_textbook_critical_values(x, dof, p):
    assert survival(x, dof) == pytest.approx(p, rel=1e-8)


def test_survival_refuses_no_degrees_of_freedom():
    with pytest.raises(ValueError, match="dof=0"):
        survival(1.0, 0)


def test_goodness_of_fit_is_pearsons_statistic():
    test = goodness_of_fit([18, 22, 20, 40], [25, 25, 25, 25])
    assert test.statistic == pytest.approx((49 + 9 + 25 + 225) / 25)
    assert test.dof == 3 and test.pvalue == pytest.approx(survival(12.32, 3))
    with pytest.raises(ValueError, match="expected"):
        goodness_of_fit([1, 2], [1, 1])


def test_independence_of_a_2x2_table_takes_yates_correction():
    test = independence([[10, 20], [20, 10]])         # expected 15 everywhere, |O - E| = 5
    assert test.dof == 1 and test.statistic == pytest.approx(4 * 4.5 ** 2 / 15)
    assert test.pvalue == pytest.approx(math.erfc(math.sqrt(test.statistic / 2)))


def test_independence_of_a_larger_table():
    table = np.array([[10, 20, 30], [20, 20, 20]])
    expected = table.sum(1, keepdims=True) * table.sum(0) / table.sum()
    assert independence(table).statistic == pytest.approx(((table - expected) ** 2 / expected).sum())
    assert independence(table).dof == 2
    assert independence([[5, 5, 5], [5, 5, 5]]).pvalue == pytest.approx(1.0)
    with pytest.raises(ValueError, match="all zeros"):
        independence([[0, 1], [0, 2]])


def test_the_tests_reject_what_differs_and_keep_what_does_not():
    rng = np.random.default_rng(0)
    same = rng.multinomial(2000, [0.2, 0.3, 0.5], size=2)
    other = np.stack([rng.multinomial(2000, [0.2, 0.3, 0.5]), rng.multinomial(2000, [0.3, 0.3, 0.4])])
    assert independence(same).pvalue > 1e-3
    assert independence(other).pvalue < 1e-6
