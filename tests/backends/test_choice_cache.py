"""The times the choices at start measured, kept on disk (backends/choice_cache.py): a second tune
under the same key times nothing and decides the same; a changed key, `retime` and
SPECFLOW_RETIME=1 time again; a corrupt, torn or stale file is ignored and rewritten; writers
replace whole files; where each choice's times came from is recorded. Timers here count calls
and return fixed times: nothing sleeps."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.backends import choice_cache
from specflow.backends.lean import kernels
from specflow.backends.hf.backend import HFBackend
from specflow.backends.turns import in_turns
from specflow.policies.goodput.costs import measure


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """The cache on (conftest turns it off for the suite), in a folder of this test's own."""
    monkeypatch.setenv(choice_cache.ENABLE_ENV, "1")
    monkeypatch.delenv(choice_cache.RETIME_ENV, raising=False)
    monkeypatch.setattr(choice_cache, "folder", lambda: tmp_path / "choices")
    return tmp_path / "choices"


class Ways:
    """Two ways of doing the same work whose measurements are counted: a is 1 s, b is 2 s."""

    def __init__(self):
        self.calls = 0

    def way(self, seconds: float):
        def cost():
            self.calls += 1
            return [seconds]
        return cost

    def time(self, key: dict, **kwargs) -> list[list[float]]:
        return in_turns([self.way(1.0), self.way(2.0)], 3, choice="test.ways", key=key, **kwargs)


def test_a_second_timing_under_the_same_key_times_nothing(kept):
    ways = Ways()
    with choice_cache.recording() as first:
        assert ways.time({"rows": 1}) == [[1.0], [2.0]]
    assert ways.calls == 6 and first == {"test.ways": "timed"}
    with choice_cache.recording() as second:
        assert ways.time({"rows": 1}) == [[1.0], [2.0]]
    assert ways.calls == 6 and second == {"test.ways": "cache"}
    assert len(list(kept.glob("test-ways-*.json"))) == 1
    assert not list(kept.glob(".*"))                     # no temporary file left behind


def test_a_changed_key_or_machine_times_again(kept, monkeypatch):
    ways = Ways()
    ways.time({"rows": 1})
    ways.time({"rows": 2})                               # another shape: timed
    assert ways.calls == 12
    ways.time({"rows": 1})
    assert ways.calls == 12
    monkeypatch.setattr(choice_cache, "machine", lambda: {"cpu": "another", "torch": "9.9"})
    ways.time({"rows": 1})                               # another machine (or torch): timed
    assert ways.calls == 18


def test_retime_and_the_environment_time_again_and_rewrite(kept, monkeypatch):
    ways = Ways()
    ways.time({"rows": 1})
    with choice_cache.retiming(), choice_cache.recording() as seen:
        ways.time({"rows": 1})
    assert ways.calls == 12 and seen == {"test.ways": "timed"}
    monkeypatch.setenv(choice_cache.RETIME_ENV, "1")
    ways.time({"rows": 1})
    assert ways.calls == 18
    monkeypatch.setenv(choice_cache.RETIME_ENV, "0")
    ways.time({"rows": 1})
    assert ways.calls == 18


def test_a_benchmark_times_again_unless_the_environment_says(kept, monkeypatch):
    """bench/*.py call retime_unless_told(): a kept choice is timed again (it may come from a
    busy machine), while SPECFLOW_RETIME=0 set by the user still reads it."""
    monkeypatch.setenv(choice_cache.RETIME_ENV, "")     # recorded: gone again after the test
    monkeypatch.delenv(choice_cache.RETIME_ENV)
    ways = Ways()
    ways.time({"rows": 1})
    choice_cache.retime_unless_told()
    ways.time({"rows": 1})
    assert ways.calls == 12
    monkeypatch.setenv(choice_cache.RETIME_ENV, "0")
    choice_cache.retime_unless_told()
    ways.time({"rows": 1})
    assert ways.calls == 12


@pytest.mark.parametrize("garbage", [b"", b"{\"key\": ", b"\xff\xfe not json", b"[1, 2]",
                                     b"{\"key\": {}, \"value\": [[1.0], [2.0]]}"])
def test_a_corrupt_or_foreign_file_is_ignored_and_rewritten(kept, garbage):
    ways = Ways()
    ways.time({"rows": 1})
    (path,) = kept.glob("test-ways-*.json")
    path.write_bytes(garbage)
    assert ways.time({"rows": 1}) == [[1.0], [2.0]] and ways.calls == 12
    assert json.loads(path.read_text())["value"] == [[1.0], [2.0]]    # rewritten whole
    ways.time({"rows": 1})
    assert ways.calls == 12


def test_a_kept_value_of_the_wrong_shape_is_stale(kept):
    ways = Ways()
    ways.time({"rows": 1})
    (path,) = kept.glob("test-ways-*.json")
    data = json.loads(path.read_text())
    data["value"] = [[1.0]]                              # one way where two are timed
    path.write_text(json.dumps(data))
    ways.time({"rows": 1})
    assert ways.calls == 12


def test_off_reads_and_writes_nothing(kept, monkeypatch):
    monkeypatch.setenv(choice_cache.ENABLE_ENV, "0")
    ways = Ways()
    ways.time({"rows": 1})
    ways.time({"rows": 1})
    assert ways.calls == 12 and not kept.exists()


def test_an_unwritable_cache_leaves_the_choice_timed(tmp_path, monkeypatch):
    monkeypatch.setenv(choice_cache.ENABLE_ENV, "1")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(choice_cache, "folder", lambda: blocker / "choices")
    ways = Ways()
    assert ways.time({"rows": 1}) == [[1.0], [2.0]]
    assert ways.time({"rows": 1}) == [[1.0], [2.0]] and ways.calls == 12


def test_concurrent_writers_leave_a_whole_file(kept):
    path, full = choice_cache.entry("test.race", {"n": 1})
    values = [[[float(i)] * 200] for i in range(8)]
    torn = []

    def write(value):
        for _ in range(30):
            choice_cache._write(path, full, value)

    def read():
        for _ in range(200):
            if path.exists():
                found, value = choice_cache._read(path, full, None)
                if not found or value not in values:
                    torn.append(value)

    threads = [threading.Thread(target=write, args=(v,)) for v in values]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torn
    assert json.loads(path.read_text())["value"] in values
    assert not list(kept.glob(".*"))


def test_pick_reads_its_forms_times_back(kept, monkeypatch):
    import torch

    weights = [torch.randn(96, 64), torch.randn(64, 96)]
    kernels.forget_picks()
    with choice_cache.recording() as seen:
        first = kernels.pick(weights, repeats=2)
    assert seen == {"kernels.pick": "timed"}
    with choice_cache.recording() as seen:                # this process's own memo
        assert kernels.pick(weights, repeats=2) is first
    assert seen == {"kernels.pick": "cache"}
    kernels.forget_picks()

    def untimed(x, w):
        raise AssertionError("a form ran: the pick was timed again")

    for name in kernels.FORMS:
        monkeypatch.setitem(kernels.FORMS, name, untimed)
    with choice_cache.recording() as seen:
        assert kernels.pick(weights, repeats=2) == first
    assert seen == {"kernels.pick": "cache"}


DEMO = ["model=demo", "proposer=draft", "max_batch_size=2", "native=auto", "threads=1"]
START_THREADS = 2        # torch's threads when a pipeline is built (a tune leaves its own choice)


@pytest.fixture
def counted_passes(monkeypatch):
    """HFBackend.time_pass counted, with fixed seconds by layout and size (packed dearer at one
    position, cheaper at more)."""
    calls = []

    def fake(backend, rows=1, positions=1, reps=5, context=32):
        calls.append((backend.role, rows, positions))
        per = 0.002 if backend.lean.packed else 0.003
        return (0.004 if backend.lean.packed else 0.002) + per * rows * positions

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    return calls


def built(*overrides: str) -> Pipeline:
    torch.set_num_threads(START_THREADS)     # as a new process starts, whatever ran before here:
    kernels.forget_picks()                  # no product forms picked earlier in this process
    pipe = Pipeline.from_config([*DEMO, *overrides])
    assert pipe.draft is not None                         # built (and tuned) on first use
    return pipe


def decisions(pipe: Pipeline) -> dict:
    return {role: {k: v for k, v in said.items() if k != "choices"}
            for role, said in pipe.backends.items()}


def test_a_second_pipeline_tunes_from_the_cache_and_decides_the_same(kept, counted_passes):
    first = built()
    assert {"model", "draft"} <= {role for role, _, _ in counted_passes}
    said = first.backends
    assert said["target"]["choices"]["pack"] == "timed"
    assert said["draft"]["choices"]["draft_pack"] == "timed"
    counted_passes.clear()
    kernels.forget_picks()                               # as in a new process
    second = built()
    assert counted_passes == []
    assert decisions(second) == decisions(first)
    assert set(second.backends["target"]["choices"].values()) == {"cache"}, second.backends["target"]["choices"]
    assert set(second.backends["draft"]["choices"].values()) == {"cache"}


def test_a_changed_setting_or_retime_times_again(kept, counted_passes):
    built()
    counted_passes.clear()
    built("max_batch_size=3")                            # the fullest pass changed: pack again
    assert ("model", 3, 5) in counted_passes
    counted_passes.clear()
    pipe = built("retime=true")
    assert ("model", 2, 5) in counted_passes and ("draft", 1, 1) in counted_passes
    assert pipe.backends["target"]["choices"]["pack"] == "timed"
    counted_passes.clear()
    built()
    assert counted_passes == []


def test_retime_must_be_true_or_false():
    with pytest.raises(ConfigError, match="retime='sometimes'; use false"):
        Pipeline.from_config(["model=synthetic", "draft=synthetic", "retime=sometimes"])


class KeyedTarget:
    """A real-looking target with a key for the cache, its passes counted."""

    pads_rows = True
    clock = None

    def __init__(self):
        self.calls = 0

    def choice_key(self) -> dict:
        return {"model": "fake"}

    def time_pass(self, rows: int = 1, positions: int = 1, reps: int = 5) -> float:
        self.calls += 1
        return 0.010 + 0.0005 * rows * positions


def test_goodputs_costs_are_kept_under_the_target_and_proposer(kept):
    target, steps = KeyedTarget(), []

    def step(rows, positions):
        steps.append((rows, positions))
        return 0.001 + 0.0001 * rows * positions

    first = measure(target, 4, 5, step, 1, key={"proposer": "draft"})
    assert target.calls == 2 and steps
    calls, asked = target.calls, len(steps)
    assert measure(target, 4, 5, step, 1, key={"proposer": "draft"}) == first
    assert (target.calls, len(steps)) == (calls, asked)
    measure(target, 4, 5, step, 1, key={"proposer": "eagle"})       # another proposer
    assert target.calls == calls + 2
