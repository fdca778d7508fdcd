"""An A/B arm's first timed request comes after the engine's warm-up: a first call's cost (a
stand-in that makes the first round of the process COLD seconds dearer) lands in the untimed
warm-up, not in a request's seconds. vLLM's side: tests/vllm_support/test_vllm_warmup.py."""
from __future__ import annotations

import time

import pytest

from specflow.app.folder_run import run_into
from specflow.app.warmup import WARMUP_PROMPT, WARMUP_TOKENS
from specflow.config import compose
from specflow.experiments.ab import run_job
from specflow.plugins import hookimpl

COLD = 0.3
PROMPTS = ["def add(a, b): return a + b", "x = 1, z = 3, x = 1, z = 3"]
# an experiment on the synthetic pair, two prompts; the sweep's own keys as Hydra sets them
TASK = ["experiment=demo_proposers", "model=synthetic", "draft=synthetic", "workload=demo",
        f"workload.prompts=[{','.join(repr(p) for p in PROMPTS)}]", "max_new_tokens=12"]


class ColdStart:
    """The first round this process runs costs COLD seconds more, inside a timed stage (the
    cache sync), as a first pass's setup does; it also counts the requests it saw start."""

    def __init__(self):
        self.rounds = 0
        self.prompts: list[str] = []

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.prompts.append(request.prompt)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        self.rounds += 1
        if self.rounds == 1:
            time.sleep(COLD)


@pytest.fixture
def cold(monkeypatch):
    """Every pipeline the app layer builds gets the ColdStart probe."""
    from specflow import pipeline

    probe = ColdStart()
    real = pipeline.Pipeline

    class Probed(real):
        def __init__(self, cfg, plugins=()):
            super().__init__(cfg, [*plugins, probe])

    monkeypatch.setattr(pipeline, "Pipeline", Probed)
    return probe


def seconds(rows: list[dict]) -> list[float]:
    return [sum(r["stats"]["seconds"].values()) for r in rows]


@pytest.mark.parametrize("arm", ["none", "ngram", "draft"])
def test_an_arms_first_timed_request_comes_after_its_warm_up(cold, tmp_path, arm):
    cfg = compose([*TASK, f"ab.arm={arm}", "ab.rep=0"])
    run = run_job(cfg, TASK, tmp_path / arm / "rep0")
    assert [r["prompt"] for r in run.rows] == PROMPTS
    assert cold.prompts[0] == WARMUP_PROMPT and cold.prompts[1:] == PROMPTS   # warm-up first
    assert max(seconds(run.rows)) < COLD, seconds(run.rows)
    assert run.stats["num_committed_tokens"] == sum(len(r["token_ids"]) for r in run.rows)


def test_without_the_warm_up_the_first_request_pays_the_first_call(cold, tmp_path):
    """The probe is felt where nothing warms up (`specflow run`): the test above can fail."""
    cfg = compose([*TASK, "proposer=ngram"])
    run = run_into(cfg, tmp_path, owner="test", setting="hydra.run.dir", rerun="rerun",
                   progress=False, replace_finished=True)
    assert cold.prompts == PROMPTS
    assert seconds(run.rows)[0] >= COLD > seconds(run.rows)[1]


def test_warm_up_changes_no_output(tmp_path):
    cfg = compose([*TASK, "proposer=ngram"])
    runs = [run_into(cfg, tmp_path / str(warm), owner="test", setting="hydra.run.dir",
                     rerun="rerun", progress=False, replace_finished=True, warm_up=warm)
            for warm in (False, True)]
    assert [r["token_ids"] for r in runs[0].rows] == [r["token_ids"] for r in runs[1].rows]
    assert [r["stats"]["num_accepted_tokens"] for r in runs[0].rows] == \
        [r["stats"]["num_accepted_tokens"] for r in runs[1].rows]


def test_a_resumed_arm_with_nothing_left_does_not_warm_up(cold, tmp_path):
    cfg = compose([*TASK, "ab.arm=none", "ab.rep=0"])
    out = tmp_path / "none" / "rep0"
    run_job(cfg, TASK, out)
    (out / "metrics.json").unlink()            # finished requests, no metrics: resumed, none left
    cold.prompts.clear()
    run_job(cfg, TASK, out)
    assert cold.prompts == []


def test_the_warm_up_is_short_and_skipped_where_the_model_cannot_take_it():
    from specflow.app.warmup import warmup_prompts
    from specflow.backends.synthetic import CharTokenizer

    tok = CharTokenizer(64)
    assert warmup_prompts(tok, "off", 3, None) == [WARMUP_PROMPT] * 3
    assert warmup_prompts(tok, "off", 1, len(WARMUP_PROMPT) + WARMUP_TOKENS) == []   # no room
    assert warmup_prompts(CharTokenizer(8), "off", 1, None) == []      # an alphabet without it
