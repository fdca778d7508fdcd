"""The command line, end to end in subprocesses: outputs, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specflow import HOOK_API_VERSION

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")


SYNTHETIC = ["model=synthetic", "draft=synthetic"]


def specflow(*args, cwd, stdin=None):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([SPECFLOW, *args], cwd=cwd, input=stdin, capture_output=True, env=env,
                          timeout=300)


def test_help_lists_the_commands(tmp_path):
    out = specflow("--help", cwd=tmp_path)
    assert out.returncode == 0
    for command in (b"run", b"sim", b"plugins"):
        assert command in out.stdout


def test_run_synthetic_end_to_end_writes_results_and_metrics(tmp_path):
    out = specflow("run", *SYNTHETIC, "prompt=def fib(n):", "max_new_tokens=12",
                   "+proposer=ngram", "+policy=adaptive", f"hydra.run.dir={tmp_path}/run",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(line) for line in (tmp_path / "run/requests.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and len(rows[0]["token_ids"]) == 12 and rows[0]["finish_reason"] == "length"
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    for name in ("num_rounds", "num_target_passes", "num_drafts", "num_draft_tokens",
                 "num_examined_draft_tokens", "num_accepted_tokens", "acceptance_rate", "alpha",
                 "accepted_per_position", "mean_acceptance_length", "tokens_per_step_histogram",
                 "seconds", "c", "tokens_per_second", "predicted_speedup"):
        assert name in metrics["aggregate"], name
    assert "α = accepted / examined" in out.stdout.decode()
    assert (tmp_path / "run/.hydra/config.yaml").exists()


def test_run_reads_a_prompt_from_stdin(tmp_path):
    out = specflow("run", *SYNTHETIC, "prompt=-", "max_new_tokens=5", f"hydra.run.dir={tmp_path}/r",
                   cwd=tmp_path, stdin=b"x = (1, 2)\n")
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads((tmp_path / "r/requests.jsonl").read_text())["prompt"] == "x = (1, 2)\n"


def test_run_from_a_workload_file_runs_every_prompt(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"q": "abc"}\n{"q": "def"}\n{"q": "ghi"}\n')
    out = specflow("run", *SYNTHETIC, "workload=file", f"workload.path={tmp_path}/p.jsonl",
                   "workload.field=q",
                   "max_new_tokens=4", "max_batch_size=2", f"hydra.run.dir={tmp_path}/r",
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    assert len((tmp_path / "r/requests.jsonl").read_text().splitlines()) == 3


def _bad_file(tmp_path, kind):
    path = tmp_path / f"{kind}.txt"
    if kind == "empty":
        path.write_text("\n\n")
    elif kind == "latin1":
        path.write_bytes("caf\xe9\n".encode("latin-1"))
    return path


# docs/bad-input.md's table is tests/test_bad_inputs.py; these are the other bad inputs
BAD_INPUTS = [
    (["proposer=ngarm"], "valid options for proposer: draft, eagle, ngram, none"),
    (["logits=[top_k]", "logits.top_k.k=0"], "top_k.k=0 must be >= 1"),
    (["workload=file", "workload.path={tmp}/missing.jsonl"], "cannot read prompt file"),
    (["model.max_length=8", "proposer.k=7"], "proposer.k=7 leaves no room"),
    (["policy=adaptive", "policy.on_below_batch=99"], "thresholds must be ordered"),
    (["policy=adaptive", "policy.k_max=-1"], "policy.k_max=-1 must be >= 0"),
    (["policy=goodput", "policy.k_max=-2"], "policy.k_max=-2 must be >= 0"),
    (["policy=schedule", "policy.ranges=[{up_to: 16, k: 2}, {up_to: 4, k: 4}]"], "strictly increasing"),
    (["policy=greedyish"], "valid options for policy"),
    (["prompt=ÿ"], "alphabet lacks"),
]


@pytest.mark.parametrize("args,message", BAD_INPUTS, ids=[a[0] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, args, message):
    for kind in ("empty", "latin1"):
        _bad_file(tmp_path, kind)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = specflow("run", *SYNTHETIC, *args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, (out.returncode, err)
    assert err.startswith("specflow: error:") and message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run/metrics.json").exists()


@pytest.mark.parametrize("args,message", [
    (["constraint=regex", "constraint.pattern=[一-鿿]{3"], "is not a regex the constraint engine accepts"),
])
def test_bad_constraint_exits_2_on_the_demo_pair(tmp_path, args, message):
    out = specflow("run", *args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run/metrics.json").exists()


def test_structured_output_from_the_command_line(tmp_path):
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    out = specflow("run", "constraint=json_schema", f"constraint.schema={schema}",
                   "prompt=# status\n", "logprobs=1", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    row = json.loads((tmp_path / "run/requests.jsonl").read_text())
    assert json.loads(row["text"])["ok"] in (True, False) and row["finish_reason"] == "eos"
    assert len(row["logprobs"]) == len(row["token_ids"])


def test_unknown_command_exits_2(tmp_path):
    out = specflow("frobnicate", cwd=tmp_path)
    assert out.returncode == 2 and b"unknown command 'frobnicate'" in out.stderr


def test_plugins_lists_the_builtins_with_their_hooks(tmp_path):
    out = specflow("plugins", cwd=tmp_path)
    assert out.returncode == 0
    text = out.stdout.decode()
    assert "specflow.builtins" in text and "specflow_register" in text and "proposer=ngram" in text
    listed = json.loads(specflow("plugins", "--json", cwd=tmp_path).stdout)
    assert listed["hook_api"] == HOOK_API_VERSION == "1.5"
    assert listed["plugins"][0]["package"] == "specflow (built-in)"
    bad = specflow("plugins", "--yaml", cwd=tmp_path)
    assert bad.returncode == 2 and b"takes no arguments but --json" in bad.stderr


def test_sim_writes_tables_json_and_plots(tmp_path):
    out = specflow("sim", "rows=8", "tokens=60", "studies=[k_sweep,histogram]",
                   "k_sweep.ks=[1,4]", f"hydra.run.dir={tmp_path}/sim", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    report = json.loads((tmp_path / "sim/sim.json").read_text())
    assert [r["k"] for r in report["k_sweep"]] == [1, 4]
    assert (tmp_path / "sim/k_sweep.png").stat().st_size > 10_000
    assert (tmp_path / "sim/tokens_per_round.png").stat().st_size > 10_000
    assert "formula(α)" in out.stdout.decode()


def test_a_quoted_stop_string_with_escapes_stops_at_a_blank_line(tmp_path):
    """docs/config.md's `'stop.strings=["\n\n"]'`: Hydra keeps the backslashes, specflow decodes them
    (the demo target writes Python, so a blank line comes within a few tokens)."""
    out = specflow("run", 'stop.strings=["\\n\\n"]', "prompt=class A:\n    pass\n",
                   "max_new_tokens=24", "--quiet", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    row = json.loads((tmp_path / "run/requests.jsonl").read_text())
    assert row["finish_reason"] == "stop" and len(row["token_ids"]) < 24, row
    assert row["text"] and "\n\n" not in row["text"]


def test_cfg_job_prints_the_config_and_no_argument_the_user_did_not_type(tmp_path):
    out = specflow("run", "proposer=ngram", "--cfg", "job", "max_new_tokens=7", cwd=tmp_path)
    text = out.stdout.decode()
    assert out.returncode == 0, out.stderr.decode()
    assert "max_new_tokens: 7" in text and "  name: ngram" in text
    assert "hydra.searchpath" not in text + out.stderr.decode() and "job.name" not in text


def test_a_prompt_near_the_context_lowers_max_new_tokens_with_one_warning(tmp_path):
    (tmp_path / "p.txt").write_text("abcdefghij\nabc\nabcdefghijkl\n")
    out = specflow("run", *SYNTHETIC, "model.max_length=16", "workload=file",
                   f"workload.path={tmp_path}/p.txt", "max_new_tokens=8", "--quiet",
                   f"hydra.run.dir={tmp_path}/r", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    warnings = [line for line in out.stderr.decode().splitlines() if "warning" in line]
    assert warnings == ["specflow: warning: prompt 0 has 10 tokens and the model's context is 16, "
                        "so max_new_tokens=8 is lowered to 6 for it (and for 1 more prompt); "
                        "shorten the prompt or ask for fewer tokens"]
    rows = [json.loads(line) for line in (tmp_path / "r/requests.jsonl").read_text().splitlines()]
    assert [len(r["token_ids"]) for r in sorted(rows, key=lambda r: r["index"])] == [6, 8, 4]


def test_serve_prints_its_banner_once_bound_and_a_taken_port_is_one_line(tmp_path):
    """server.port=0: the banner names the port the system picked, once the socket is bound; a
    second server on that port is refused in one line, before any model loads, with no banner."""
    import re
    import select
    import signal
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([SPECFLOW, "serve", *SYNTHETIC, "server.port=0",
                             f"hydra.run.dir={tmp_path}/a"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "no banner within 120 s"
        banner = proc.stdout.readline()
        port = int(re.match(r"specflow serve: http://127\.0\.0\.1:(\d+) \(", banner).group(1))
        assert port > 0, banner
        # off a terminal too, a line says it is loading before the address comes
        assert proc.stderr.readline().startswith("specflow serve: loading ")
        for _ in range(100):
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("the server did not answer after its banner")
        taken = specflow("serve", *SYNTHETIC, f"server.port={port}", f"hydra.run.dir={tmp_path}/b",
                         cwd=tmp_path)
        err = taken.stderr.decode().strip()
        assert taken.returncode == 2 and len(err.splitlines()) == 1, err
        assert f"server.port={port}: 127.0.0.1:{port} is already in use" in err
        assert b"specflow serve: http" not in taken.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
