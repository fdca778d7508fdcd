"""The forgetting least-squares fits the goodput policy learns its costs with."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specflow.policies.goodput.fits import DraftCostFit, LineFit, TwoTermFit


def test_fits_recover_costs_from_noisy_rounds():
    gen = torch.Generator().manual_seed(0)
    line, two = LineFit(0.05, 1.0), TwoTermFit(0.05, 0.1, 0.0)
    for _ in range(400):
        tokens = float(torch.randint(8, 120, (1,), generator=gen))
        line.add(tokens, 2.0 + 0.03 * tokens + 0.01 * float(torch.randn(1, generator=gen)))
        steps = float(torch.randint(1, 8, (1,), generator=gen))
        rowsteps = steps * float(torch.randint(1, 16, (1,), generator=gen))
        two.add(steps, rowsteps, 0.2 * steps + 0.004 * rowsteps)
    a, b = line.coef()
    assert a == pytest.approx(2.0, abs=0.05) and b == pytest.approx(0.03, abs=0.002)
    a, b = two.coef()
    assert a == pytest.approx(0.2, abs=0.01) and b == pytest.approx(0.004, abs=0.0005)


def test_a_fit_is_its_prior_until_it_sees_data_and_never_goes_negative():
    assert LineFit(0.05, 0.3, 0.02).coef() == (0.3, 0.02)
    fit = LineFit(0.05, 1.0, 0.0)
    for x in range(1, 50):
        fit.add(float(x), 5.0 - 0.1 * x)          # falling: a negative slope is clipped
    assert min(fit.coef()) >= 0.0


def test_a_timed_slope_survives_steady_rounds_a_flat_prior_does_not():
    """Steady full-batch rounds all score the same number of positions: the data only say
    a + b x at that x. A prior with the timed slope keeps it; a flat prior (b = 0) loses it, so
    extra positions looked free and k never fell under load."""
    a_t, b_t = 0.010, 0.0004
    timed, flat = LineFit(0.05, a_t, b_t), LineFit(0.05, 1.0, 0.0)
    for _ in range(200):                         # 16 rows x (k+1 = 5), every round alike
        timed.add(80.0, a_t + 80 * b_t)
        flat.add(80.0, a_t + 80 * b_t)
    assert timed.coef()[1] == pytest.approx(b_t, rel=0.05)
    assert flat.coef()[1] < b_t / 5


def test_the_draft_fit_separates_a_rounds_fixed_cost_from_its_steps_and_tokens():
    """seconds = fixed + per_step steps + per_token tokens: a fixed cost of drafting at all is
    not spread over the steps (which made deep drafts look dear)."""
    fit = DraftCostFit(0.05, (0.0, 0.1, 0.0))
    rng = np.random.default_rng(0)
    for _ in range(400):
        steps = int(rng.integers(1, 9))
        tokens = steps * int(rng.integers(1, 5))
        fit.add(steps, tokens, 2.0 + 0.5 * steps + 0.25 * tokens)
    assert np.allclose(fit.coef(), (2.0, 0.5, 0.25), atol=1e-2)
    assert DraftCostFit(0.05, (0.3, 0.1, 0.0)).coef() == (0.3, 0.1, 0.0)   # nothing seen: prior


def test_a_warm_up_round_does_not_price_drafting_out():
    """A first drafting round at 3x the usual seconds (kernels built for new shapes) must not
    set three weights alone: the measured prior weighs as a few rounds at first (a fit that
    had priced a one-step round at 3-6x its cost drafted nothing again, so it never learned)."""
    def truth(steps, tokens):                                    # ms
        return 1.0 + 2.5 * steps + 0.3 * tokens
    fit = DraftCostFit(0.05, (0.0, 2.0, 0.2))                    # a step timed at build
    fit.add(4, 7, 3 * truth(4, 7))
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(12):
        steps = int(rng.integers(1, 4))
        tokens = steps + int(rng.integers(0, 3))
        fit.add(steps, tokens, truth(steps, tokens))
        ratios.append(sum(fit.coef()) / truth(1, 1))
    assert max(ratios) < 2.0 and ratios[-1] < 1.25, ratios
