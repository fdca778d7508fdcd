"""`specflow calibrate` finds the crossover and writes a schedule that `policy=calibrated` loads."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specflow.errors import ConfigError, SpecflowError
from specflow.experiments import calibrate as cal
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
            "calibrate.new_tokens=48", "calibrate.repetitions=2", "calibrate.min_requests=2",
            f"hydra.run.dir={tmp_path}/run"]
    out = subprocess.run([SPECFLOW, "calibrate", *args], capture_output=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    report = json.loads((tmp_path / "run/calibration.json").read_text())
    cross = report["crossover"]
    assert cross is not None and 1 < cross < 16
    for r in report["rows"]:     # the simulated clock is deterministic: repetitions agree
        assert r["repetitions"] == 2 and r["warmup"] == 1 and r["requests"] == max(2, r["batch"])
        assert len(r["speedup"]["reps"]) == 2 and len(r["spec"]["throughput_reps"]) == 2
        assert r["speedup"]["hi"] - r["speedup"]["lo"] < 1e-9
    assert "repetitions" in (tmp_path / "conf/policy/calibrated.yaml").read_text()
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


# --- the noise decision ---------------------------------------------------------------------------

def point(batch, ratios, off=100.0):
    """A sweep row from per-repetition speedups (plain decoding at `off` tokens/s)."""
    def run(thr):
        return {"tokens": 64, "time": 64 / thr, "wall": 64 / thr, "unit": "s", "throughput": thr,
                "per_token": [1 / thr], "alpha": 0.6}
    return cal.summarize_point(batch, max(batch, 8), [run(off) for _ in ratios],
                               [run(off * g) for g in ratios], warmup=1)


CLEAR = [point(1, [1.40, 1.45, 1.50]), point(2, [1.25, 1.30, 1.32]), point(4, [1.12, 1.15, 1.18]),
         point(8, [0.85, 0.90, 0.92]), point(16, [0.60, 0.62, 0.65])]
# the incident: batch 1 from noise, while 2 and 4 clearly pay 1.14-1.34x
NOISY_BATCH_1 = [point(1, [0.70, 0.95, 1.30]), point(2, [1.10, 1.14, 1.20]),
                 point(4, [1.30, 1.34, 1.36]), point(8, [0.80, 0.85, 0.90])]


def test_summarize_point_pairs_repetitions_and_reports_the_spread():
    r = point(2, [1.3, 1.1, 1.2])
    assert r["repetitions"] == 3 and r["requests"] == 8 and r["warmup"] == 1
    sp = r["speedup"]
    assert sp["median"] == pytest.approx(1.2)
    assert (sp["min"], sp["max"]) == (pytest.approx(1.1), pytest.approx(1.3))
    assert (sp["lo"], sp["hi"]) == (sp["min"], sp["max"])         # 3 repetitions: min - max
    assert r["spec"]["throughput"] == pytest.approx(120)
    assert (r["spec"]["throughput_min"], r["spec"]["throughput_max"]) == (
        pytest.approx(110), pytest.approx(130))
    assert cal.gain(r) == pytest.approx(1.2) and cal.classify(r) == "pays"


def test_median_interval_narrows_with_more_repetitions():
    assert cal.median_interval([3.0]) == (3.0, 3.0)
    assert cal.median_interval([2.0, 1.0, 3.0]) == (1.0, 3.0)
    assert cal.median_interval([5, 1, 4, 2, 3]) == (1, 5)               # 93.75 %; inner pair 62.5 %
    assert cal.median_interval(list(range(1, 10))) == (3, 7)            # 82 %
    assert cal.median_interval(list(range(1, 10)), coverage=0.95) == (2, 8)


def test_clear_measurements_write_the_schedule(tmp_path):
    assert cal.undetermined(CLEAR) is None
    result = cal.write_calibrated(tmp_path / "policy/calibrated.yaml", CLEAR, 4, 0.25, "test")
    assert 4 < result["crossover"] < 8
    assert result["ranges"] == [{"up_to": 4, "k": 4}, {"up_to": None, "k": 0}]
    assert (tmp_path / "policy/calibrated.yaml").exists()


def test_noise_at_batch_1_refuses_to_write(tmp_path):
    path = tmp_path / "policy/calibrated.yaml"
    with pytest.raises(cal.NoisyCalibration) as err:
        cal.write_calibrated(path, NOISY_BATCH_1, 4, 0.25, "test")
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and isinstance(err.value, SpecflowError)
    assert "\n" not in msg
    assert "batch 1: 0.95x, interval 0.70-1.30 over 3 repetitions" in msg
    assert "noise +-0.30 vs effect -0.05" in msg
    assert "clearly pays at batch 2 (1.14x, interval 1.10-1.20)" in msg
    assert "calibrate.repetitions" in msg and "quieter machine" in msg
    assert not path.exists()


@pytest.mark.parametrize("rows,ok", [
    # one unclear size between one that pays and one that loses: the sweep's own resolution
    ([point(1, [1.5] * 3), point(4, [1.2] * 3), point(8, [0.8, 1.0, 1.3]), point(16, [0.7] * 3)],
     True),
    # two unclear sizes in a row: the crossover could be anywhere from 4 to 32
    ([point(4, [1.2] * 3), point(8, [0.8, 1.0, 1.3]), point(16, [0.8, 0.95, 1.2]),
      point(32, [0.6] * 3)], False),
    # unclear and wide at the start, nothing smaller that pays: could pay a lot at batch 1
    ([point(1, [0.6, 0.9, 1.5]), point(2, [0.8] * 3)], False),
    # unclear but break-even at the start (within 1 +- 0.05): off everywhere is harmless
    ([point(1, [0.98, 0.99, 1.02]), point(2, [0.8] * 3)], True),
    # unclear and wide at the end: no larger size that clearly loses
    ([point(1, [1.5] * 3), point(2, [0.7, 1.05, 1.4])], False),
    ([point(1, [1.5] * 3), point(2, [0.97, 1.01, 1.03])], True),
    # a break-even size before one that clearly pays, median <= 1: crossover() would stop there
    ([point(1, [0.97, 0.99, 1.03]), point(2, [1.2] * 3), point(4, [0.8] * 3)], False),
    ([point(1, [0.99, 1.02, 1.03]), point(2, [1.2] * 3), point(4, [0.8] * 3)], True),
    # clearly loses, then clearly pays: no single crossover
    ([point(1, [0.8] * 3), point(2, [1.2] * 3)], False),
    # noise far from 1 does not matter
    ([point(1, [1.2, 1.6, 2.4]), point(2, [1.1, 1.3, 1.5]), point(4, [0.3, 0.6, 0.9])], True),
    ([point(1, [1.3] * 3), point(2, [1.2] * 3)], True),                  # always pays
    ([point(1, [0.7] * 3), point(2, [0.6] * 3)], True),                  # never pays
    ([], False),                                                          # nothing measured
])
def test_noise_decision(rows, ok):
    assert (cal.undetermined(rows) is None) == ok


def test_rows_without_repetitions_still_decide():
    rows = [row(1, 10, 20), row(2, 18, 27), row(4, 30, 30)]
    assert cal.undetermined(rows) is None and crossover(rows) == pytest.approx(4.0)


def test_table_shows_spread_and_refusal():
    from rich.console import Console

    from specflow.console import calibrate_table
    from specflow.experiments.calibrate import classify
    con = Console(width=250, record=True)
    con.print(calibrate_table(NOISY_BATCH_1, {"crossover": None, "ranges": None, "path": None,
                                              "refused": "noise"},
                              [classify(r) for r in NOISY_BATCH_1]))
    text = con.export_text()
    assert "NOT WRITTEN" in text and "unclear" in text and "0.95 [0.70-1.30]" in text
    assert "8 x 3" in text and "100.0 (100.0-100.0)" in text and "95.0 (70.0-130.0)" in text


# --- warm-up, requests per point and interleaving -------------------------------------------------

def test_warmup_is_untimed_and_arms_interleave(monkeypatch):
    from specflow.config import compose
    from specflow.pipeline import Pipeline

    cfg = compose(["model=synthetic", "draft=synthetic", "model.token_cost=0.05"], "calibrate")
    calls, timed = [], []
    generate, measure = Pipeline.generate, cal._measure

    def counting_generate(self, prompts, *a, **kw):
        calls.append((self.cfg.proposer.name, len(prompts), kw.get("max_batch_size"),
                      kw.get("max_new_tokens"), bool(timed)))
        return generate(self, prompts, *a, **kw)

    def flagged_measure(*a, **kw):
        timed.append(1)
        try:
            return measure(*a, **kw)
        finally:
            timed.pop()

    monkeypatch.setattr(Pipeline, "generate", counting_generate)
    monkeypatch.setattr(cal, "_measure", flagged_measure)
    new = cal.WARMUP_TOKENS + 4
    rows = cal.run_calibration(cfg, ["def f(x):", "def g(y):", "class A:"], [1, 4], new,
                               repetitions=3, min_requests=5, warmup=1)
    assert [(r["batch"], r["requests"], r["repetitions"], r["warmup"]) for r in rows] == [
        (1, 5, 3, 1), (4, 5, 3, 1)]
    none, spec = "none", cfg.proposer.name
    for i, (b, warm) in enumerate(((1, new), (4, cal.WARMUP_TOKENS))):
        seq = calls[8 * i: 8 * (i + 1)]
        # first an untimed full batch per arm (all new tokens at the first size, a short one
        # after), then the timed runs, the arm order alternating
        assert seq[:2] == [(none, b, b, warm, False), (spec, b, b, warm, False)]
        assert seq[2:] == [(arm, 5, b, new, True) for arm in (none, spec, spec, none, none, spec)]
    assert len(calls) == 16
    assert all(r["speedup"]["lo"] == pytest.approx(r["speedup"]["hi"]) for r in rows)


def test_one_repetition_is_refused_on_a_real_clock(monkeypatch):
    from specflow.config import compose

    cfg = compose(["model=synthetic", "draft=synthetic"], "calibrate")
    real = cal._measure
    monkeypatch.setattr(cal, "_measure", lambda *a: {**real(*a), "unit": "s"})
    with pytest.raises(ConfigError, match="repetitions"):
        cal.run_calibration(cfg, ["def f(x):"], [1], 4, repetitions=1, min_requests=1)
