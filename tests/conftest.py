"""Shared fixtures: tiny fixed-seed synthetic pipelines; no network, no installed plugins."""
from __future__ import annotations

import os

# tests see only specflow's built-ins unless a test installs a plugin itself
os.environ.setdefault("SPECFLOW_DISABLE_PLUGIN_AUTOLOAD", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# tiny tensors: one thread avoids oversubscription on 2-core machines
torch.set_num_threads(1)


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
