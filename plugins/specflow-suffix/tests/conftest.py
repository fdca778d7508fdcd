"""specflow-suffix tests: the plugin is found the way users find it, through its entry point.

specflow's own tests switch entry-point autoload off; here it is switched on for every test (and
the global plugin manager rebuilt), then restored, so running both suites together stays safe.
Run with the plugin installed: `pip install -e plugins/specflow-suffix`.
"""
from __future__ import annotations

import pytest
import torch

from specflow import plugins

# tiny tensors: one thread avoids oversubscription on small shared machines
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def autoload_plugins(monkeypatch):
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    plugins.reset()
    yield
    plugins.reset()
