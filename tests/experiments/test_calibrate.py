"""`specflow calibrate` finds the crossover and writes a schedule that `policy=calibrated` loads."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specflow.experiments.calibrate import crossover, schedule_for

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")


def row(batch, off, on):
    return {"batch": batch, "none": {"throughput": off}, "spec": {"throughput": on}}


@pytest.mark.parametrize("rows,expected", [
    ([row(1, 10, 20), row(2, 18, 27), row(4, 30, 30)], 4.0),         # equal at 4
    ([row(1, 10, 20), row(2, 20, 30), row(4, 40, 30)], 2 ** (1 + 0.5 / (1.5 - 0.75))),
    ([row(1, 10, 9)], 1.0),                                             # never pays
    ([row(1, 10, 20), row(8, 30, 40)], None),                           # always pays
])
def test_crossover(rows, expected):
    got = crossover(rows)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("cross,ranges", [
    (None, [{"up_to": None, "k": 4}]),
    (11.1, [{"up_to": 8, "k": 4}, {"up_to": None, "k": 0}]),
    (1.2, [{"up_to": None, "k": 0}]),
])
def test_schedule_keeps_a_margin_below_the_crossover(cross, ranges):
    assert schedule_for(cross, 4, 0.25) == ranges


def test_calibrate_writes_a_policy_that_switches_off_above_the_crossover(tmp_path):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1",
           "SPECFLOW_CONFIG_PATH": str(tmp_path / "conf")}
    # the synthetic pair under sampling, with a per-token target cost: speculation pays at
    # batch 1 and loses at large batches (simulated time)
    args = ["model=synthetic", "draft=synthetic", "model.token_cost=0.05", "draft.noise=0.8",
            "logits=[temperature]", "workload=demo", "calibrate.batch_sizes=[1,2,4,8,16]",
            "calibrate.new_tokens=48", f"hydra.run.dir={tmp_path}/run"]
    out = subprocess.run([SPECFLOW, "calibrate", *args], capture_output=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    report = json.loads((tmp_path / "run/calibration.json").read_text())
    cross = report["crossover"]
    assert cross is not None and 1 < cross < 16
    assert (tmp_path / "run/calibration.png").stat().st_size > 10_000
    from specflow import Pipeline
    os.environ["SPECFLOW_CONFIG_PATH"] = str(tmp_path / "conf")
    try:
        pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic", "policy=calibrated"])
    finally:
        del os.environ["SPECFLOW_CONFIG_PATH"]
    policy = pipe.pm.get_plugin("policy.schedule")
    from specflow.policies.schedule import k_for_batch
    assert k_for_batch(policy.ranges, 1) == 4
    assert k_for_batch(policy.ranges, int(cross) + 1) == 0
    assert k_for_batch(policy.ranges, 64) == 0
