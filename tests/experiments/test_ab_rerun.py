"""`specflow ab` reruns: other overrides are refused (not skipped), ab.name stays inside ab/, and a
sweep (or one of its job folders) in use by another process is refused."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specflow import ConfigError, InputError
from specflow.config import compose
from specflow.experiments import ab as ab_mod
from specflow.io import folder_lock

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
# the synthetic pair: a few seconds per sweep
SYN = ["experiment=demo_proposers", "model=synthetic", "draft=synthetic", "prompt=hello",
       "max_new_tokens=8", "--quiet"]


def specflow(*args, cwd):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([SPECFLOW, *args], cwd=cwd, capture_output=True, env=env, timeout=600)


def one_line(out) -> str:
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name", ["../../etc", "/tmp/x", "a/../../b", "..", "."])
def test_ab_name_cannot_leave_the_ab_folder(name):
    cfg = compose(["experiment=demo_proposers", f"ab.name={name}"])
    with pytest.raises(ConfigError, match=r"must be a plain folder name \(letters, digits, '_', "
                                          r"'-' or '.', not '.' or '..'\)"):
        ab_mod.check_experiment(cfg)
    assert ab_mod.check_experiment(compose(["experiment=demo_proposers", "ab.name=v1.2-b_c"]))


def test_a_bad_ab_name_on_the_command_line_is_one_line(tmp_path):
    err = one_line(specflow("ab", *SYN, "ab.name=../../etc", cwd=tmp_path))
    assert "specflow: error: ab.name='../../etc' must be a plain folder name" in err, err
    assert not list(tmp_path.iterdir())


def test_a_rerun_with_other_overrides_is_refused_before_anything_runs(tmp_path):
    sweep = tmp_path / "sweep"
    assert specflow("ab", *SYN, f"hydra.sweep.dir={sweep}", cwd=tmp_path).returncode == 0
    def stamps():          # every file but the lock files (the holder's pid is written in them)
        return {p: p.stat().st_mtime_ns for p in sweep.glob("**/*")
                if p.is_file() and p.name != ".specflow.lock"}

    finished = stamps()
    metrics = json.loads((sweep / "none/rep0/metrics.json").read_text())
    assert metrics["config"] == json.loads(
        (sweep / "none/rep0/requests.jsonl").read_text().splitlines()[0])["config"]
    out = specflow("ab", *SYN, "max_new_tokens=9", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    err = one_line(out)
    assert (f"demo_proposers, arm none, repetition 0: {sweep}/none/rep0 holds results of other "
            f"overrides (config {metrics['config']}, now ") in err, err
    assert ("rerun with the overrides it was run with to resume it, or choose a new "
            "hydra.sweep.dir=... (or ab.name=...)") in err
    # nothing ran: not a job, not Hydra's multirun.yaml
    assert stamps() == finished
    # the same overrides still resume (here: every job finished earlier, skipped)
    assert specflow("ab", *SYN, f"hydra.sweep.dir={sweep}", cwd=tmp_path).returncode == 0


def test_an_unfinished_job_of_other_overrides_is_refused_too(tmp_path):
    job = tmp_path / "sweep/ngram/rep0"
    job.mkdir(parents=True)
    (job / "requests.jsonl").write_text(json.dumps({"index": 0, "config": "0123abcd"}) + "\n")
    assert ab_mod.recorded_config(job) == "0123abcd"
    with pytest.raises(InputError, match=f"{job} holds results of other overrides "
                                         r"\(config 0123abcd, now ffff\)"):
        ab_mod.check_rerun(job, "ffff")
    ab_mod.check_rerun(job, "0123abcd")
    cfg = compose(SYN[:-1])
    with pytest.raises(InputError, match="demo_proposers, arm ngram, repetition 0: "):
        ab_mod.check_sweep(cfg, SYN[:-1], str(tmp_path / "sweep"))


def test_a_sweep_or_job_folder_in_use_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    with folder_lock(sweep, "specflow ab", "hydra.sweep.dir"):
        err = one_line(specflow("ab", *SYN, f"hydra.sweep.dir={sweep}", cwd=tmp_path))
    assert (f"{sweep} is in use by another specflow ab (pid {os.getpid()}); wait for it to "
            f"finish, or choose another hydra.sweep.dir=...") in err, err
    # a job folder held by another process (a parallel launcher's job, say)
    with folder_lock(sweep / "none/rep0", "specflow ab", "hydra.sweep.dir"):
        err = one_line(specflow("ab", *SYN, f"hydra.sweep.dir={sweep}", cwd=tmp_path))
    assert (f"demo_proposers, arm none, repetition 0: {sweep}/none/rep0 is in use by another "
            f"specflow ab (pid {os.getpid()})") in err, err
    assert not list(sweep.glob("*/rep0/metrics.json"))
