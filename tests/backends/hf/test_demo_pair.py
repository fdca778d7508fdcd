"""The embedded demo pair: shipped in the package, loaded like any model, exact, and useful."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specflow import Pipeline
from specflow.experiments.workloads import read_prompt_file
from specflow.backends.hf.backend import DEMO_DIR

PROMPTS = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"))[:6]


@pytest.fixture(scope="module")
def plain():
    return Pipeline.from_config(["proposer=none"])


def test_config_paths_are_directories_from_pretrained_loads():
    from transformers import AutoConfig

    pipe = Pipeline.from_config([])
    for node in (pipe.cfg.model, pipe.cfg.draft):
        assert os.path.isdir(node.path)
        assert AutoConfig.from_pretrained(node.path).model_type == "llama"
    assert pipe.cfg.proposer.name == "draft" and pipe.greedy


def test_shipped_files_stay_small():
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size < 50e6
    assert (DEMO_DIR / "eagle" / "model.safetensors").stat().st_size <= 10e6   # the EAGLE-3 head
    log = json.loads((DEMO_DIR / "train_log.json").read_text())
    assert log["target"]["params"] > 8 * log["draft"]["params"]


@pytest.mark.parametrize("proposer", ["draft", "ngram", "eagle"])
def test_greedy_speculation_equals_plain_on_code_prompts(plain, proposer):
    expected = [plain.generate([p], max_new_tokens=40)[0].token_ids for p in PROMPTS]
    pipe = Pipeline.from_config([f"proposer={proposer}"])
    for batch in (1, 3):
        got = pipe.generate(PROMPTS, max_new_tokens=40, max_batch_size=batch, stop=["\n\n"])
        for r, e in zip(got, expected):
            assert r.token_ids == e[:len(r.token_ids)]          # stop cuts, never changes
        got = pipe.generate(PROMPTS, max_new_tokens=40, max_batch_size=batch)
        assert [r.token_ids for r in got] == expected
    assert pipe.last_stats["alpha"] > (0.1 if proposer == "ngram" else 0.5)


@pytest.mark.slow
def test_eagle_sampling_keeps_the_distribution():
    """temperature + top-p + repetition penalty: first- and second-token histograms with the
    shipped head equal plain decoding's (chi-square)."""
    import numpy as np
    from specflow.experiments.chi_square import independence

    settings = ["logits=[repetition_penalty,temperature,top_p]", "logits.temperature.value=0.9",
                "logits.top_p.p=0.9", "logits.repetition_penalty.penalty=1.3", "max_batch_size=64"]
    prompt = "import "            # many likely first tokens

    def histogram(proposer, seed):
        pipe = Pipeline.from_config([f"proposer={proposer}", "proposer.k=3", *settings]
                                    if proposer != "none" else ["proposer=none", *settings])
        res = pipe.generate([prompt] * 2000, max_new_tokens=2, seed=seed)
        return [tuple(r.token_ids) for r in res], pipe.last_stats

    spec, s = histogram("eagle", 0)
    plain, _ = histogram("none", 10_000)
    assert s["num_accepted_tokens"] > 200
    for depth in (1, 2):      # the first token alone, then the pair
        a = [x[:depth] for x in spec]
        b = [x[:depth] for x in plain]
        keys = sorted(set(a) | set(b))
        table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
        table = table[:, table.sum(0) >= 10]
        assert table.shape[1] >= 3
        assert independence(table).pvalue > 1e-3


def test_draft_equal_to_target_is_always_accepted():
    pipe = Pipeline.from_config(["draft=hf", f"draft.path={DEMO_DIR / 'target'}"])
    pipe.generate(PROMPTS[:3], max_new_tokens=30)
    assert pipe.last_stats["alpha"] == 1.0


def test_specflow_run_with_no_overrides_writes_python(tmp_path):
    out = subprocess.run([str(pathlib.Path(sys.executable).parent / "specflow"), "run",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, cwd=tmp_path,
                         env={**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    text = "".join(r["text"] for r in rows)
    assert len(rows) == 4 and sum(text.count(w) for w in ("self", "return", "if ", "(")) > 10
    metrics = json.loads((tmp_path / "metrics.json").read_text())["aggregate"]
    assert metrics["alpha"] > 0.5 and metrics["mean_acceptance_length"] > 2


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_keep_text_and_token_ids_in_agreement(plain, include):
    pipe = Pipeline.from_config(["proposer=draft", f"stop.include_stop_str={include}"])
    checked = 0
    for stop in ["_", "\n", "(", "self", "return", "):\n"]:
        for r in pipe.generate(PROMPTS, max_new_tokens=48, stop=[stop]):
            assert pipe.tokenizer.decode(r.token_ids) == r.text
            assert r.stats["num_committed_tokens"] == len(r.token_ids)
            hist = r.stats["tokens_per_step_histogram"]
            assert sum(int(n) * c for n, c in hist.items()) == len(r.token_ids)
            if r.finish_reason == "stop":
                checked += 1
                assert (stop in r.text) == include
    assert checked > 10


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [["proposer=draft"], ["proposer=ngram"],
                                       ["proposer=draft", "logits=[temperature,top_p]"],
                                       ["proposer=none", "logits=[temperature]"]])
def test_the_pipeline_runs_on_cuda(overrides):
    cpu = Pipeline.from_config([*overrides, "device=cpu"])
    gpu = Pipeline.from_config([*overrides, "device=cuda"])
    a = cpu.generate(PROMPTS[:3], max_new_tokens=24)
    b = gpu.generate(PROMPTS[:3], max_new_tokens=24)
    assert all(len(r.token_ids) == 24 or r.finish_reason != "length" for r in b)
    if gpu.greedy:   # float32 on both: the same argmaxes barring near-ties
        same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
        assert same >= 2
