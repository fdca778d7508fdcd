"""`specflow ab` and `specflow report` end to end, in subprocesses, on the demo pair (small sizes)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
SMALL = ["experiment=demo_proposers", "workload.limit=3", "max_new_tokens=16", "--quiet"]


def specflow(*args, cwd):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([SPECFLOW, *args], cwd=cwd, capture_output=True, env=env, timeout=600)


def jobs(folder: pathlib.Path) -> dict:
    """(arm, rep) -> Hydra's job number, from each job's own record."""
    out = {}
    for hydra_yaml in folder.glob("*/rep*/.hydra/hydra.yaml"):
        job = yaml.safe_load(hydra_yaml.read_text())["hydra"]["job"]
        arm_dir = hydra_yaml.parents[2].name
        out[(arm_dir, hydra_yaml.parents[1].name)] = job["num"]
    return out


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    root = tmp_path_factory.mktemp("ab")
    out = specflow("ab", *SMALL, "ab.repetitions=2", f"hydra.sweep.dir={root}/sweep", cwd=root)
    assert out.returncode == 0, out.stderr.decode()
    return root / "sweep"


def test_one_folder_per_arm_and_repetition_with_config_requests_and_metrics(healthy):
    for arm in ("none", "ngram", "draft"):
        for rep in (0, 1):
            d = healthy / arm / f"rep{rep}"
            assert (d / "arm_config.yaml").exists() and (d / ".hydra/config.yaml").exists()
            assert len((d / "requests.jsonl").read_text().splitlines()) == 3
            assert json.loads((d / "metrics.json").read_text())["arm"] == arm
    # arms interleaved within each repetition: rep 0 runs every arm before rep 1 starts
    num = jobs(healthy)
    assert max(num[(a, "rep0")] for a in ("none", "ngram", "draft")) < \
        min(num[(a, "rep1")] for a in ("none", "ngram", "draft"))
    # every arm saw the same prompts in the same order
    prompts = {arm: [json.loads(x)["prompt"] for x in (healthy / arm / "rep0/requests.jsonl")
                     .read_text().splitlines()] for arm in ("none", "ngram", "draft")}
    assert prompts["none"] == prompts["ngram"] == prompts["draft"]


def test_report_speedups_intervals_exact_match_and_plots(healthy, tmp_path):
    out = specflow("report", str(healthy), cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    report = json.loads((healthy / "report.json").read_text())
    arms = report["arms"]
    assert list(arms) == ["none", "ngram", "draft"] and report["baseline"] == "none"
    for name in ("ngram", "draft"):
        lo, hi = arms[name]["speedup_ci95"]
        assert lo <= arms[name]["speedup"] <= hi
        assert arms[name]["exact_match"] == 1.0 and arms[name]["first_difference"] is None
        assert arms[name]["requests"] == 6
    assert arms["draft"]["alpha"] > 0.5 and len(arms["draft"]["acceptance_per_position"]) == 4
    for png in ("speedup", "acceptance_per_position", "tokens_per_round", "tau_vs_k"):
        assert (healthy / f"{png}.png").stat().st_size > 10_000
    text = out.stdout.decode()
    assert "95% CI" in text and "exact match 100%" in text
    assert "| draft |" in (healthy / "report.md").read_text()
    # run over run: one column per repetition, from each job's own metrics
    for name in ("ngram", "draft"):
        per_rep = arms[name]["per_repetition"]
        assert list(per_rep) == ["0", "1"]
        job = json.loads((healthy / name / "rep1/metrics.json").read_text())["aggregate"]
        assert per_rep["1"]["alpha"] == job["alpha"]
    assert "Per repetition" in (healthy / "report.md").read_text() and "per repetition" in text


@pytest.mark.slow           # 26 s on 2 cores: make test-slow (and CI) run it
def test_rerun_skips_finished_jobs_and_redoes_an_unfinished_one(healthy, tmp_path):
    done = healthy / "ngram/rep1/metrics.json"
    stamps = {p: p.stat().st_mtime_ns for p in healthy.glob("*/rep*/metrics.json")}
    done.unlink()                                     # as if interrupted before it finished
    partial = healthy / "ngram/rep1/requests.jsonl"
    first = partial.read_text().splitlines()[0]
    partial.write_text(first + "\n{\"index\": 1, \"tru")     # a line torn by the interruption
    out = specflow("ab", *SMALL, "ab.repetitions=2", f"hydra.sweep.dir={healthy}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    for p, t in stamps.items():
        if p != done:
            assert p.stat().st_mtime_ns == t            # finished jobs were not re-run
    assert done.exists() and len(partial.read_text().splitlines()) == 3
    # the finished request was kept, not generated again; the torn one and the rest were
    assert partial.read_text().splitlines()[0] == first
    assert json.loads(done.read_text())["resumed_requests"] == 1


# two sweeps and a report (about 30 s of a worker): make test-slow and CI run it
@pytest.mark.slow
def test_broken_draft_cache_lowers_alpha_and_trips_the_drift_check(healthy, tmp_path):
    from fake_plugins import LEAKY_DRAFT_PLUGIN, install_fake_plugin

    assert specflow("report", str(healthy), "--quiet", cwd=tmp_path).returncode == 0
    broken = tmp_path / "broken"
    site = install_fake_plugin(tmp_path / "site", "fake_specflow_leaky", LEAKY_DRAFT_PLUGIN,
                               option=("proposer", "leaky_draft"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SPECFLOW_DISABLE_PLUGIN_AUTOLOAD", None)
    out = subprocess.run([SPECFLOW, "ab", *SMALL, f"hydra.sweep.dir={broken}",
                          'ab.arms.draft=["proposer=leaky_draft","proposer.k=4"]'],
                         cwd=tmp_path, capture_output=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr.decode()
    out = specflow("report", str(broken), "--baseline", str(healthy / "report.json"),
                   "--max-acceptance-drop", "0.05", cwd=tmp_path)
    assert out.returncode == 1
    assert b"arm draft: \xce\xb1 fell from" in out.stderr
    report = json.loads((broken / "report.json").read_text())
    assert report["arms"]["draft"]["exact_match"] == 1.0     # output stays correct
    same = specflow("report", str(healthy), "--baseline", str(healthy / "report.json"),
                    "--quiet", cwd=tmp_path)
    assert same.returncode == 0


@pytest.mark.slow          # a whole sweep in two local processes (~25 s on 2 cores)
def test_joblib_launcher_runs_the_sweep_in_local_processes(tmp_path):
    out = specflow("ab", *SMALL, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                   f"hydra.sweep.dir={tmp_path}/jl", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert len(list((tmp_path / "jl").glob("*/rep0/metrics.json"))) == 3


def test_slurm_and_ray_launchers_compose():
    # composition only for SLURM (no cluster here); ray runs for real below when installed
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="specflow.conf", version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=submitit_slurm", "experiment=demo_proposers"],
                      return_hydra_config=True)
    assert "SlurmLauncher" in cfg.hydra.launcher._target_


def test_ray_launcher_runs_on_a_local_ray_instance(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="pip install specflow[ray]")
    out = specflow("ab", *SMALL, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2",
                   f"hydra.sweep.dir={tmp_path}/ray", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert len(list((tmp_path / "ray").glob("*/rep0/metrics.json"))) == 3


@pytest.mark.slow          # two sampled repetitions of every arm (~30 s on 2 cores)
def test_sampling_arms_get_a_distribution_check(tmp_path):
    out = specflow("ab", *SMALL, "logits=[temperature]", "ab.repetitions=2",
                   f"hydra.sweep.dir={tmp_path}/s", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert specflow("report", str(tmp_path / "s"), "--quiet", cwd=tmp_path).returncode == 0
    arms = json.loads((tmp_path / "s/report.json").read_text())["arms"]
    assert arms["draft"]["distribution"]["test"] == "first-token chi-square"
    assert 0 <= arms["draft"]["distribution"]["p_value"] <= 1


@pytest.mark.parametrize("args,message", [
    (["ab", "experiment=synthetic_sampling"], "needs an experiment that names its arms"),
    (["ab", "experiment=demo_proposers", "ab.baseline=nope"], "is not one of the arms"),
    (["report", "/no/such/folder"], "is not a folder"),
    (["ab", "experiment=demo_proposers", "workload=file", "workload.path=/no/such.jsonl",
      "--quiet"], "demo_proposers, arm none, repetition 0: cannot read prompt file"),
])
def test_bad_ab_input_is_one_line_exit_2(args, message, tmp_path):
    out = specflow(*args, cwd=tmp_path)
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and message in err and len(err.splitlines()) == 1, err
