"""Logprobs are written as JSON can carry them: an alternative a mask or a processor made
impossible (-inf) is left out, as OpenAI leaves such tokens out, and a chosen token's logprob is
always finite, in results and in `specflow run`'s requests.jsonl."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

from specflow import Pipeline

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
# top_k=2: at every position all but two tokens are impossible
TOP_2 = ["model=synthetic", "draft=synthetic", "proposer=draft", "proposer.k=3",
         "logits=[temperature,top_k]", "logits.top_k.k=2"]


def strict(line: str):
    def refuse(constant):
        raise AssertionError(f"{constant} in {line[:200]}")
    return json.loads(line, parse_constant=refuse)


def test_results_leave_impossible_alternatives_out():
    result = Pipeline.from_config(TOP_2).generate(["def fib(n):"], max_new_tokens=12,
                                                  logprobs=5)[0]
    assert len(result.top_logprobs) == len(result.token_ids) == 12
    assert all(1 <= len(top) <= 2 for top in result.top_logprobs)
    assert all(math.isfinite(v) for top in result.top_logprobs for v in top.values())
    assert all(math.isfinite(v) for v in result.logprobs)
    for token, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
        assert token in top and top[token] == lp
    strict(json.dumps(result.to_json()))


def test_requests_jsonl_of_a_run_with_logprobs_is_strict_json(tmp_path):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([SPECFLOW, "run", *TOP_2, "prompt=def fib(n):", "max_new_tokens=12",
                          "logprobs=5", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                         capture_output=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    lines = (tmp_path / "run/requests.jsonl").read_text().splitlines()
    rows = [strict(line) for line in lines]
    assert len(rows) == 1 and len(rows[0]["top_logprobs"]) == 12
    assert all(1 <= len(top) <= 2 for top in rows[0]["top_logprobs"])
