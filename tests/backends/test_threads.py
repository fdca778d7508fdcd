"""`threads`: auto keeps the faster of all threads and one (timed at start); a number is applied."""
from __future__ import annotations

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.backends import threads as threads_mod
from specflow.backends.hf.backend import HFBackend

# what the choices at build time measure is replaced here: nothing is read back or kept
pytestmark = pytest.mark.times_choices


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("contended", [False, True])
def test_auto_keeps_the_faster_setting(monkeypatch, restore_threads, contended):
    monkeypatch.setattr(threads_mod, "DEFAULT_THREADS", 2)     # what torch gives a 2-core process
    # a busy second core makes two threads slower than one (OpenMP barriers spin on it)
    cost = {2: 0.004, 1: 0.006} if not contended else {2: 0.016, 1: 0.006}
    monkeypatch.setattr(HFBackend, "time_pass",
                        lambda backend, *a, **k: cost[torch.get_num_threads()])
    pipe = Pipeline.from_config(["model=demo", "proposer=none", "draft=none"])
    assert pipe.threads == (1 if contended else 2) == torch.get_num_threads()


def test_auto_times_the_two_counts_in_turns(monkeypatch, restore_threads):
    monkeypatch.setattr(threads_mod, "DEFAULT_THREADS", 2)
    counts = []

    def fake(backend, *a, **k):
        counts.append(torch.get_num_threads())
        return 0.004 if torch.get_num_threads() == 2 else 0.006

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    Pipeline.from_config(["model=demo", "proposer=none", "draft=none", "native=true",
                          "pack=false"])
    assert counts == [2, 1, 1, 2, 2, 1]          # a burst of a neighbour's load weighs on both


def test_auto_times_real_passes_and_leaves_the_cache_empty(monkeypatch, restore_threads):
    monkeypatch.setattr(threads_mod, "DEFAULT_THREADS", 2)
    torch.set_num_threads(1)     # an earlier pipeline's choice does not decide this one's
    pipe = Pipeline.from_config(["model=demo", "proposer=none", "draft=none"])
    assert pipe.threads in (1, 2) and torch.get_num_threads() == pipe.threads
    assert pipe.target.cache_length(0) == 0
    # the product forms were timed at the thread count the pipeline runs with
    assert pipe.kernels == pipe.target.lean.kernels.describe()


def test_a_number_is_applied_and_nonsense_is_refused(restore_threads):
    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic", "threads=1"])
    assert pipe.threads == 1 == torch.get_num_threads()
    with pytest.raises(ConfigError, match=r"threads=0 is out of range \[1, 4096\]"):
        Pipeline.from_config(["model=synthetic", "draft=synthetic", "threads=0"])
    with pytest.raises(ConfigError, match="threads='many' is not a whole number"):
        Pipeline.from_config(["model=synthetic", "draft=synthetic", "threads=many"])
