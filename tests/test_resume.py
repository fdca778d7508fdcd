"""Interrupted runs keep every finished request, and a rerun generates only the rest, exactly."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from specflow import InputError, hookimpl
from specflow.resume import finished_requests, run_resumable

SAMPLING = ["proposer=draft", "logits=[temperature]", "max_batch_size=2"]
SHORT = [*SAMPLING, "max_new_tokens=30"]
PROMPTS = [f"prompt {i} " + "ab" * i for i in range(6)]
SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")


class StopAfter:
    """Ctrl-C after n requests have finished."""

    def __init__(self, n):
        self.n = n

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt


def test_interrupted_run_resumes_to_exactly_the_uninterrupted_result(make_pipeline, tmp_path):
    whole = make_pipeline(*SHORT).generate(PROMPTS)
    with pytest.raises(KeyboardInterrupt):
        run_resumable(make_pipeline(*SHORT, plugins=[StopAfter(3)]), PROMPTS, tmp_path, False)
    kept = finished_requests(tmp_path / "requests.jsonl", PROMPTS)
    assert len(kept) == 3
    rows, stats, resumed = run_resumable(make_pipeline(*SHORT), PROMPTS, tmp_path, False)
    assert resumed == 3 and [r["index"] for r in rows] == list(range(6))
    # same seeds per request index: the resumed run is the run that was not interrupted
    assert [r["token_ids"] for r in rows] == [r.token_ids for r in whole]
    assert stats["num_committed_tokens"] == sum(len(r.token_ids) for r in whole)
    assert stats["sessions"] == 2 and stats["wall_seconds"] > 0
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["index"] for x in lines) == list(range(6))


def test_a_torn_last_line_is_dropped_and_other_prompts_are_refused(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"index": 0, "prompt": "a"}) + "\n{\"index\": 1, \"pro")
    assert list(finished_requests(path, ["a", "b"])) == [0]
    assert path.read_text().count("\n") == 1            # rewritten without the torn line
    with pytest.raises(InputError, match="written for other prompts"):
        finished_requests(path, ["x", "b"])
    path.write_text("garbage\n" + json.dumps({"index": 0, "prompt": "a"}) + "\n")
    with pytest.raises(InputError, match="line 1 is not a request record"):
        finished_requests(path, ["a"])


def _as_from_a_shell() -> None:
    """In the child before exec: SIGINT as a terminal's shell leaves it (default, unblocked).
    A child inherits an ignored or blocked SIGINT, and Python then never raises
    KeyboardInterrupt: a pytest worker that some earlier test or library left that way made
    the run below ignore its Ctrl-C and finish with exit 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def _cli(*args, cwd, wait=True):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    cmd = [SPECFLOW, *args]
    if wait:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, env=env, timeout=600)
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=_as_from_a_shell)


def _interrupt_when(proc, path: pathlib.Path, lines: int, timeout: float = 120):
    deadline = time.monotonic() + timeout      # a hang guard, not a speed figure
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= lines:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    return proc.communicate(timeout=120)


# a whole CLI run, interrupted and rerun (about 40 s of a worker): make test-slow and CI run it
@pytest.mark.slow
def test_ctrl_c_on_the_command_line_keeps_finished_requests_and_the_rerun_resumes(tmp_path):
    prompts = tmp_path / "prompts.txt"
    n = 40
    prompts.write_text("".join(f"line {i} of the prompts\n" for i in range(n)))
    args = ["run", "model=synthetic", "draft=synthetic", *SAMPLING, "workload=file",
            f"workload.path={prompts}", "max_new_tokens=400", "--quiet",
            f"hydra.run.dir={tmp_path}/run"]
    jsonl = tmp_path / "run/requests.jsonl"
    proc = _cli(*args, cwd=tmp_path, wait=False)
    _, err = _interrupt_when(proc, jsonl, 2)
    assert proc.returncode == 130, err.decode()
    assert "interrupted; every finished request is kept" in err.decode()
    assert "hydra.run.dir=" in err.decode() and "Traceback" not in err.decode()
    kept = [json.loads(x) for x in jsonl.read_text().splitlines() if x.endswith("}")]
    assert 2 <= len(kept) < n and not (tmp_path / "run/metrics.json").exists()
    out = _cli(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(n))
    for k in kept:          # kept as they were
        assert next(r for r in rows if r["index"] == k["index"]) == k
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert metrics["resumed_requests"] >= len(kept)
    assert metrics["aggregate"]["num_committed_tokens"] == sum(len(r["token_ids"]) for r in rows)


@pytest.mark.slow
def test_ctrl_c_during_an_ab_experiment_then_rerun_finishes_it(tmp_path):
    args = ["ab", "experiment=demo_proposers", "workload.limit=6", "max_new_tokens=48", "--quiet",
            f"hydra.sweep.dir={tmp_path}/sweep"]
    first_job = tmp_path / "sweep/none/rep0/requests.jsonl"
    proc = _cli(*args, cwd=tmp_path, wait=False)
    _, err = _interrupt_when(proc, first_job, 2)
    assert proc.returncode == 130, err.decode()
    assert "rerun the same command to resume" in err.decode()
    kept = first_job.read_text().splitlines()
    out = _cli(*args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert first_job.read_text().splitlines()[:len(kept)] == kept
    for arm in ("none", "ngram", "draft"):
        assert (tmp_path / f"sweep/{arm}/rep0/metrics.json").exists()
    report = _cli("report", str(tmp_path / "sweep"), "--quiet", cwd=tmp_path)
    assert report.returncode == 0, report.stderr.decode()


def test_records_written_with_another_config_are_refused(make_pipeline, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_resumable(make_pipeline(*SHORT, plugins=[StopAfter(2)]), PROMPTS, tmp_path, False)
    with pytest.raises(InputError, match="written with another config"):
        run_resumable(make_pipeline(*SHORT, "seed=7"), PROMPTS, tmp_path, False)
    # display-only settings are not part of it
    rows, _, resumed = run_resumable(make_pipeline(*SHORT, "show_progress=false"), PROMPTS,
                                     tmp_path, False)
    assert resumed == 2 and len(rows) == 6
