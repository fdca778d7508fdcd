"""The trace observer, installed as a package: found through its entry point, composed from its yaml."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specflow import Pipeline, hookspecs, plugins

SYNTHETIC = ["model=synthetic", "draft=synthetic", "proposer=draft"]


def test_listed_with_its_version():
    row = next(r for r in plugins.plugin_distributions() if r["package"] == "specflow-trace")
    assert row["version"] == "0.1.0" and "observer=trace" in row["components"]


def test_specflow_plugins_lists_it_with_its_version(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD"}
    specflow = os.path.join(os.path.dirname(sys.executable), "specflow")
    out = subprocess.run([specflow, "plugins", "--json"], cwd=tmp_path, capture_output=True,
                         env=env, timeout=300)
    rows = {r["package"]: r for r in json.loads(out.stdout)["plugins"]}
    assert rows["specflow-trace"]["version"] == "0.1.0"
    assert rows["specflow-trace"]["components"] == ["observer=trace"]


def _traced(tmp_path, *overrides):
    pipe = Pipeline.from_config([*SYNTHETIC, "observer=[trace]",
                                 f"observer.trace.path={tmp_path}/trace.json", *overrides])
    results = pipe.generate(["abc", "defg", "h"], max_new_tokens=24, max_batch_size=2)
    return pipe, results, json.loads((tmp_path / "trace.json").read_text())


def test_every_stage_hook_is_a_span_nested_in_its_round(tmp_path):
    pipe, results, trace = _traced(tmp_path)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    expected = {"policy", "node_price", "propose", "target", "verify", "trim", "sync_cache", "observe", "prefill",
                "process_logits [draft]", "process_logits [target]", "mask_logits [target]"}
    assert expected <= names, expected - names
    assert len(hookspecs.STAGE_HOOKS) == 10  # a new stage hook needs a wrapper here
    rounds = [e for e in spans if e["name"].startswith("round ")]
    # num_rounds counts row-rounds: a round of batch size 2 is two
    assert sum(r["args"]["batch_size"] for r in rounds) == pipe.last_stats["num_rounds"]
    assert len(rounds) == len([e for e in spans if e["name"] == "target"])
    stages = [e for e in spans if e["tid"] == 2 and e["name"] not in ("prefill",)]
    for e in stages:        # every stage span lies inside one round span
        assert e["dur"] >= 0
        assert any(r["ts"] <= e["ts"] + 1e-3 and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1e-3
                   for r in rounds), e
    requests = [e for e in spans if e["name"].startswith("request ")]
    assert sorted(e["name"] for e in requests) == ["request 0", "request 1", "request 2"]
    assert {e["tid"] for e in requests} == {100, 101}        # two slots, reused
    committed = sum(e["args"]["committed"] for e in rounds)
    assert committed == sum(len(r.token_ids) for r in results) + \
        pipe.last_stats.get("num_retracted_tokens", 0)


def test_table_counts_match_the_pipeline(tmp_path):
    pipe, _, trace = _traced(tmp_path)
    rounds = [e for e in trace["traceEvents"] if e["name"].startswith("round ")]
    table = (tmp_path / "trace_table.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| stage")}
    assert f"| target | {len(rounds)} |" in rows["target"]
    assert "| prefill | 3 |" in rows["prefill"]


def test_tracing_does_not_change_outputs(tmp_path):
    plain = Pipeline.from_config(SYNTHETIC).generate(["abc", "defg", "h"], max_new_tokens=24,
                                                     max_batch_size=2)
    _, traced, _ = _traced(tmp_path)
    assert [r.token_ids for r in plain] == [r.token_ids for r in traced]


def test_event_cap_keeps_the_table(tmp_path):
    _, _, trace = _traced(tmp_path, "observer.trace.max_events=5")
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 5
    assert trace["otherData"]["dropped_events"] > 0


def test_bad_path_is_one_line():
    from specflow import ConfigError
    from specflow.config import compose
    with pytest.raises(ConfigError, match="observer.trace.path='t.txt' must end in .json"):
        compose([*SYNTHETIC, "observer=[trace]", "observer.trace.path=t.txt"])


def test_traced_run_from_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD"}
    specflow = os.path.join(os.path.dirname(sys.executable), "specflow")
    out = subprocess.run([specflow, "run", "observer=[trace]", "proposer=ngram", "max_new_tokens=16",
                          "prompt=def add(a, b):", f"hydra.run.dir={tmp_path}/run"],
                         cwd=tmp_path, capture_output=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    trace = json.loads((tmp_path / "run/trace.json").read_text())
    assert {"target", "propose", "verify"} <= {e["name"] for e in trace["traceEvents"]}
    assert "per-stage time" in out.stderr.decode()
