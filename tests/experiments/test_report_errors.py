"""`specflow report` on damaged or unfinished sweeps: one line naming the file and the fix
(InputError, exit 2); an arm without its metrics.json is never dropped silently."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

from specflow import InputError
from specflow.experiments import report

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
ENV = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> pathlib.Path:
    """A finished two-arm sweep on the synthetic pair (4 short prompts, one repetition)."""
    root = tmp_path_factory.mktemp("report_errors")
    out = subprocess.run([SPECFLOW, "ab", "model=synthetic", "draft=synthetic", "ab.name=tiny",
                          "ab.baseline=none", '+ab.arms.none=["proposer=none"]',
                          '+ab.arms.draft=["proposer=draft"]', "max_new_tokens=8", "--quiet",
                          f"hydra.sweep.dir={root}/sweep"], cwd=root, capture_output=True,
                         env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    return root / "sweep"


@pytest.fixture
def copy(sweep, tmp_path) -> pathlib.Path:
    dst = tmp_path / "sweep"
    shutil.copytree(sweep, dst)
    return dst


def _load(folder: pathlib.Path) -> dict:
    arms, _ = report.load_sweep(folder)
    return report.summarize(arms, n_boot=50)


def _edit(path: pathlib.Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _refused(folder: pathlib.Path, *parts: str) -> str:
    with pytest.raises(InputError) as info:
        _load(folder)
    text = str(info.value)
    assert "\n" not in text and info.value.exit_code == 2, text
    for part in parts:
        assert part in text, text
    return text


def test_a_finished_sweep_reports(copy):
    summary = _load(copy)
    assert list(summary["arms"]) == ["none", "draft"] and summary["arms"]["draft"]["requests"] == 4


def _truncate(p):
    p.write_text(p.read_text()[: len(p.read_text()) // 2])


def _torn_request_line(p):
    lines = p.read_text().splitlines()
    p.write_text("\n".join([lines[0], lines[1][:40], *lines[2:]]) + "\n")


# (file under the sweep, damage, message substring after "<sweep>/<file>")
DAMAGED = [
    ("draft/rep0/metrics.json", _truncate, ": not valid JSON ("),
    ("draft/rep0/metrics.json", lambda p: p.write_text("[1, 2]"),
     ": a JSON array, not the object specflow ab writes"),
    ("draft/rep0/metrics.json", lambda p: p.write_text(""), ": not valid JSON ("),
    ("draft/rep0/metrics.json", lambda p: _edit(p, lambda d: d.pop("aggregate")),
     ": no field 'aggregate'"),
    ("none/rep0/metrics.json", lambda p: _edit(p, lambda d: d.pop("requests")),
     ": no field 'requests'"),
    ("none/rep0/metrics.json", lambda p: _edit(p, lambda d: d["aggregate"].pop("num_drafts")),
     ": no field 'aggregate.num_drafts'"),
    ("none/rep0/metrics.json", lambda p: _edit(p, lambda d: d.update(rep="0")),
     ": field 'rep' is a JSON string"),
    ("draft/rep0/requests.jsonl", _torn_request_line, ":2: not valid JSON ("),
    ("draft/rep0/requests.jsonl", lambda p: p.write_text(p.read_text()[:-30]),
     ":4: not valid JSON ("),
    ("draft/rep0/requests.jsonl", lambda p: p.write_text(p.read_text() + "[1]\n"),
     ":5: not a request record"),
    ("draft/rep0/requests.jsonl", lambda p: p.write_text(p.read_text().split("\n", 1)[1]),
     ": holds 3 requests but metrics.json counts 4"),
    ("draft/rep0/requests.jsonl", lambda p: p.unlink(),
     ": missing, though the job's metrics.json exists"),
]


@pytest.mark.parametrize("name,damage,message", DAMAGED,
                         ids=[f"{d[0]}-{i}" for i, d in enumerate(DAMAGED)])
def test_a_damaged_job_file_is_named(copy, name, damage, message):
    damage(copy / name)
    job = (copy / name).parent
    _refused(copy, f"{copy / name}{message}", f"the job '{job}' is damaged: delete that folder "
                                                f"and rerun the same specflow ab command")


def test_a_job_without_metrics_refuses_the_report_and_names_it(copy):
    (copy / "draft/rep0/metrics.json").unlink()
    _refused(copy, f"sweep '{copy}' is not finished: no metrics.json in draft/rep0 (1 of 2 jobs)",
             "rerun the same specflow ab command")


@pytest.mark.parametrize("multirun", [True, False], ids=["multirun.yaml", "arms-of-metrics"])
def test_an_arm_that_never_started_is_not_dropped(copy, multirun):
    shutil.rmtree(copy / "draft")
    if not multirun:
        (copy / "multirun.yaml").unlink()
    _refused(copy, "is not finished: no metrics.json in draft/rep0")


def test_a_job_moved_to_another_folder(copy):
    shutil.move(copy / "draft/rep0", copy / "draft/rep1")
    _refused(copy, "records arm 'draft', repetition 0, but sits in draft/rep1")


def test_jobs_of_two_experiments_are_not_mixed(copy):
    _edit(copy / "draft/rep0/metrics.json", lambda d: d.update(experiment="other"))
    _refused(copy, "is from experiment", "report one sweep folder at a time")


def test_empty_missing_and_parent_folders(tmp_path, sweep):
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", "no finished A/B jobs under", "run specflow ab first")
    _refused(tmp_path / "nope", f"'{tmp_path / 'nope'}' is not a folder")
    shutil.copytree(sweep, tmp_path / "ab/tiny")
    _refused(tmp_path / "ab", "it holds the sweeps tiny: report one of them "
                              f"(specflow report {tmp_path / 'ab/tiny'})")


@pytest.mark.parametrize("content,message", [
    (None, "cannot read --baseline"), ("{", "is not valid JSON"),
    ("[1]", "is not a report.json that specflow report wrote"),
    ('{"arms": {"draft": {"tau": 1}}}', "is not a report.json that specflow report wrote")])
def test_a_bad_baseline_report(tmp_path, content, message):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError, match=message):
        report.read_baseline(str(path))


def test_specflow_does_not_depend_on_scipy():
    # transformers imports scipy's optimizer whenever scipy is installed (a third of a second
    # of every start); the chi-square tests run on torch.special (experiments/chi_square.py)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].strip()
             for d in deps["dependencies"] + sum(deps["optional-dependencies"].values(), [])]
    assert "scipy" not in names


def test_cli_an_unfinished_arm_is_one_line_and_writes_no_report(copy):
    (copy / "draft/rep0/metrics.json").unlink()
    out = subprocess.run([SPECFLOW, "report", str(copy)], capture_output=True, env=ENV,
                         timeout=300)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, (out.returncode, err)
    assert err.startswith("specflow: error:") and len(err.splitlines()) == 1, err
    assert "no metrics.json in draft/rep0" in err and "Traceback" not in err
    assert not (copy / "report.json").exists()
