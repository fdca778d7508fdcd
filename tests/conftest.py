"""Shared fixtures: tiny fixed-seed synthetic pipelines; no network, no installed plugins."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# tests see only specflow's built-ins unless a test installs a plugin itself
os.environ.setdefault("SPECFLOW_DISABLE_PLUGIN_AUTOLOAD", "1")
# The choices timed when a pipeline is built (threads, native, pack, product forms: ~1.5 s of a
# demo-pair build, most of a test that builds two) are kept for this test run only, in a
# temporary folder (never the user's cache; workers and the commands tests start share it), so
# the hundreds of pipelines built on the same files time each choice once. A fake clock's times
# are never kept (backends/choice.py); tests that replace what is timed (time_pass, a kernel's
# timer) are marked `times_choices` or use `linear_clock`, and time with nothing kept or read.
if not os.environ.get("SPECFLOW_CHOICE_DIR"):
    os.environ["SPECFLOW_CHOICE_DIR"] = tempfile.mkdtemp(prefix="specflow-test-choices-")
    atexit.register(shutil.rmtree, os.environ["SPECFLOW_CHOICE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

# tiny tensors: one thread avoids oversubscription on 2-core machines
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _short_pack_timing():
    """pack=auto times whole passes when a pipeline is built (15 per end and layout: ~1.2 s of
    each demo-pair build with one thread). Tests build hundreds of pipelines and none depends on
    which layout wins (tests/backends/lean/test_packing.py fixes the timings itself), so three passes
    decide here; the choice is made by the same code either way."""
    from specflow.backends.lean import packing

    saved = packing.REPS, packing.DRAFT_REPS
    packing.REPS = packing.DRAFT_REPS = 3
    yield
    packing.REPS, packing.DRAFT_REPS = saved


@pytest.fixture(autouse=True)
def _choices_timed_afresh(request, monkeypatch):
    """A test marked `times_choices`, or one with `linear_clock`, neither reads nor keeps the
    times of choices: what it times is replaced, and a later test must not decide from it."""
    if request.node.get_closest_marker("times_choices") or "linear_clock" in request.fixturenames:
        monkeypatch.setenv("SPECFLOW_CHOICE_CACHE", "0")


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


# seconds a timed pass reports under `linear_clock`: (fixed, per position fed), by role
LINEAR_COSTS = {"model": (0.010, 0.0005), "draft": (0.001, 0.00005), "head": (0.0005, 0.00005)}


@pytest.fixture
def linear_clock(monkeypatch):
    """Passes and head steps timed at build run for real (their caches are used and emptied)
    but report seconds from fixed lines (LINEAR_COSTS): a test that compares two timings (a
    wider step dearer than a narrower one, a head step cheaper than a target pass) cannot flip
    on a loaded machine, where a wall clock can time the wider pass faster."""
    from specflow.backends.contract import Backend
    from specflow.stages.proposers.eagle import EagleProposer

    real_pass, real_step = Backend.time_pass, EagleProposer.step_seconds

    def seconds(role, rows, positions):
        fixed, per = LINEAR_COSTS[role]
        return fixed + per * rows * positions

    def time_pass(self, rows=1, positions=1, reps=5, context=32):
        assert real_pass(self, rows, positions, reps=1, context=context) > 0
        return seconds(getattr(self, "role", "model"), rows, positions)

    def step_seconds(self, rows, reps=5, context=64, positions=1):
        assert real_step(self, rows, reps=1, context=context, positions=positions) > 0
        return seconds("head", rows, positions)

    monkeypatch.setattr(Backend, "time_pass", time_pass)
    monkeypatch.setattr(EagleProposer, "step_seconds", step_seconds)
    return LINEAR_COSTS
