"""Shared fixtures: tiny fixed-seed synthetic pipelines; no network, no installed plugins."""
from __future__ import annotations

import os

# tests see only specflow's built-ins unless a test installs a plugin itself
os.environ.setdefault("SPECFLOW_DISABLE_PLUGIN_AUTOLOAD", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# tiny tensors: one thread avoids oversubscription on 2-core machines
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _short_pack_timing():
    """pack=auto times whole passes when a pipeline is built (15 per end and layout: ~1.2 s of
    each demo-pair build with one thread). Tests build hundreds of pipelines and none depends on
    which layout wins (tests/models/test_packing.py fixes the timings itself), so three passes
    decide here; the choice is made by the same code either way."""
    from specflow.models import packing

    saved = packing.REPS, packing.DRAFT_REPS
    packing.REPS = packing.DRAFT_REPS = 3
    yield
    packing.REPS, packing.DRAFT_REPS = saved


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_pipeline():
    """Pipeline.from_config with the synthetic pair and any overrides."""
    from specflow import Pipeline

    def build(*overrides: str, plugins=()):
        return Pipeline.from_config(overrides=["model=synthetic", "draft=synthetic", *overrides],
                                    plugins=plugins)

    return build
