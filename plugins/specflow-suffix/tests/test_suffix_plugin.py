"""proposer=suffix through specflow: discovery, config, exact greedy output, run-over-run gains."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from specflow import ConfigError, Pipeline, plugins
from specflow.config import compose
from specflow.pipeline import Request
from specflow.state import PAD, DecodeBatch, RoundResult

from specflow_suffix.proposer import SuffixProposer, SuffixProposerConfig

# repetitive code, so the trees find continuations within a request and across requests
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add(a, b):",
    "import os\nimport sys\nimport re\n\nimport os\nimport sys\n",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]


def token_ids(results):
    return [r.token_ids for r in results]


# --- discovery and config ---------------------------------------------------------------------

def test_the_entry_point_is_listed_with_its_package_and_version():
    rows = {r["name"]: r for r in plugins.plugin_distributions()}
    row = rows["suffix"]
    assert row["package"] == "specflow-suffix" and row["version"] == "0.1.0"
    assert row["components"] == ["proposer=suffix"]
    assert {"specflow_register", "specflow_config_searchpath"} <= set(row["hooks"])


def test_proposer_suffix_composes_with_its_defaults_and_the_static_policy_reads_k():
    cfg = compose(["proposer=suffix", "proposer.min_token_prob=0.2"])
    assert cfg.proposer.name == "suffix" and cfg.proposer.k == 12 and cfg.policy.k == 12
    assert cfg.proposer.max_depth == 24 and cfg.proposer.max_cached_requests == 200
    assert cfg.proposer.min_token_prob == 0.2
    assert cfg.proposer.cache_path is None and cfg.proposer.use_global is True


@pytest.mark.parametrize("override, match", [
    ("proposer.max_depth=0", r"proposer\.max_depth=0 must be >= 1"),
    ("proposer.min_token_prob=1.5", r"proposer\.min_token_prob=1\.5 must be in \[0, 1\]"),
    ("proposer.max_spec_factor=0", r"proposer\.max_spec_factor=0\.0 must be > 0"),
    ("proposer.k=-1", r"proposer\.k=-1 must be >= 0"),
    ("proposer.max_cached_requests=-2", r"max_cached_requests=-2 must be >= 0"),
    ("proposer.kk=3", r"proposer\.kk"),
])
def test_bad_values_fail_at_compose_time_with_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as info:
        compose(["proposer=suffix", override])
    assert "\n" not in str(info.value)


def test_a_cache_path_without_the_global_tree_is_refused():
    with pytest.raises(ConfigError, match=r"cache_path=c\.json is set but the global tree is off"):
        compose(["proposer=suffix", "proposer.use_global=false", "proposer.cache_path=c.json"])


def test_the_repeat_experiment_composes():
    cfg = compose(["experiment=suffix_repeat"])
    ab = OmegaConf.to_container(cfg.ab, resolve=False)
    assert ab["name"] == "suffix_repeat" and ab["repetitions"] == 3 and ab["baseline"] == "none"
    assert ab["arms"]["none"] == ["proposer=none"] and ab["arms"]["suffix"][0] == "proposer=suffix"
    assert any(o.startswith("proposer.cache_path=") for o in ab["arms"]["suffix"])
    assert cfg.workload.limit == 8 and cfg.max_new_tokens == 48 and cfg.max_batch_size == 1


# --- the stage on its own -----------------------------------------------------------------------

def _request(i, ids):
    return Request(i, "", list(ids), 32, None, 0)


def test_propose_pads_ragged_rows_and_respects_each_rows_k():
    prop = SuffixProposer(SuffixProposerConfig(k=3, use_global=False))
    batch = DecodeBatch.make_dummy(batch_size=3, prompt_len=3)
    batch.token_ids = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5], [7, 8, 9]]
    batch.prompt_lens = [len(t) for t in batch.token_ids]
    for slot, ids in enumerate(batch.token_ids):
        prop.specflow_request_start(slot=slot, request=_request(slot, ids))
    out = prop.specflow_propose(batch=batch, k=torch.tensor([8, 0, 2]))
    assert out.draft_probs is None
    drafts = out.draft_token_ids
    assert drafts.shape == (3, 3) and drafts.dtype == torch.long
    assert drafts[0].tolist() == [3, 1, 2]                 # capped at proposer.k = 3
    assert drafts[1].tolist() == [PAD] * 3                 # k = 0: no drafts
    assert drafts[2].tolist() == [PAD] * 3                 # no earlier occurrence: nothing to say


def test_sync_then_end_moves_the_request_into_the_global_tree():
    prop = SuffixProposer(SuffixProposerConfig(k=4))
    prompt = [1, 2, 3, 4]
    prop.specflow_request_start(slot=0, request=_request(0, prompt))
    batch = DecodeBatch.make_dummy(batch_size=1)
    batch.token_ids = [prompt + [5, 6]]
    prop.specflow_sync_cache(batch=batch, result=RoundResult.make_dummy([1], [1]))
    prop.specflow_request_end(slot=0, request=_request(0, prompt), finish_reason="length")
    assert list(prop.global_tree.sequences()) == [[1, 2, 3, 4, 5, 6]] and prop.slots == {}
    # a new request with the same start drafts the old continuation from the global tree
    prop.specflow_request_start(slot=0, request=_request(1, [1, 2, 3]))
    batch.token_ids = [[1, 2, 3]]
    assert prop.specflow_propose(batch=batch, k=torch.tensor([4])).draft_token_ids.tolist() == [
        [4, 5, 6]]                                         # match length 3 -> at most 3 tokens


def test_tokens_the_pipeline_retracts_at_the_end_stay_out_of_the_global_tree():
    prop = SuffixProposer(SuffixProposerConfig(k=4))
    prop.specflow_request_start(slot=1, request=_request(0, [1, 2]))
    batch = DecodeBatch.make_dummy(batch_size=1)
    batch.slots = torch.tensor([1])
    live = [1, 2, 3, 4, 5]                                 # the pipeline's own list for the row
    batch.token_ids = [live]
    prop.specflow_sync_cache(batch=batch, result=RoundResult.make_dummy([2], [2]))
    del live[3:]                                           # a stop string's tokens retracted
    prop.specflow_request_end(slot=1, request=_request(0, [1, 2]), finish_reason="stop")
    assert list(prop.global_tree.sequences()) == [[1, 2, 3]]


def test_cache_files_that_cannot_be_used_fail_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.json is not a suffix cache.*delete the file"):
        SuffixProposer(SuffixProposerConfig(cache_path=str(bad)))
    other = tmp_path / "other.json"
    prop = SuffixProposer(SuffixProposerConfig(cache_path=str(other)),
                          SimpleNamespace(target=SimpleNamespace(vocab_size=100)))
    prop.add_finished([1, 2, 3])
    prop.save()
    with pytest.raises(ConfigError, match=r"100-token vocabulary but this model has 64"):
        SuffixProposer(SuffixProposerConfig(cache_path=str(other)),
                       SimpleNamespace(target=SimpleNamespace(vocab_size=64)))
    data = json.loads(other.read_text())
    data["sequences"] = [[1, 150], [-1, 2]]                  # ids a model of 100 tokens lacks
    other.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"token ids in \[0, 100\)"):
        SuffixProposer(SuffixProposerConfig(cache_path=str(other)),
                       SimpleNamespace(target=SimpleNamespace(vocab_size=100)))


# --- pipelines ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_demo_output():
    """proposer=none on the demo pair: the reference every greedy suffix run must equal."""
    os.environ.pop(plugins.AUTOLOAD_ENV, None)
    plugins.reset()
    pipe = Pipeline.from_config(["proposer=none"])
    return token_ids(pipe.generate(PROMPTS, max_new_tokens=32))


def test_greedy_output_equals_plain_decoding_and_the_second_run_accepts_more(plain_demo_output):
    pipe = Pipeline.from_config(["proposer=suffix"])
    first = pipe.generate(PROMPTS, max_new_tokens=32)
    s1 = dict(pipe.last_stats)
    assert token_ids(first) == plain_demo_output
    assert s1["num_accepted_tokens"] > 0
    prop = pipe.pm.get_plugin("proposer.suffix")
    assert len(prop.global_tree) == len(PROMPTS)           # every finished request went in
    second = pipe.generate(PROMPTS, max_new_tokens=32)     # the same prompts again
    s2 = pipe.last_stats
    assert token_ids(second) == plain_demo_output
    assert s2["alpha"] > s1["alpha"] and s2["num_accepted_tokens"] > s1["num_accepted_tokens"]
    assert s2["num_rounds"] < s1["num_rounds"]


def test_the_cache_file_carries_acceptance_to_a_fresh_pipeline(tmp_path, plain_demo_output):
    cache = tmp_path / "cache" / "suffix.json"
    overrides = ["proposer=suffix", f"proposer.cache_path={cache}", "max_batch_size=2"]
    a = Pipeline.from_config(overrides)
    assert token_ids(a.generate(PROMPTS, max_new_tokens=32)) == plain_demo_output
    saved = json.loads(cache.read_text())
    assert saved["format"] == "specflow-suffix-cache" and len(saved["sequences"]) == len(PROMPTS)
    assert [p for p in cache.parent.iterdir()] == [cache]   # no temporary file left behind
    b = Pipeline.from_config(overrides)
    assert len(b.pm.get_plugin("proposer.suffix").global_tree) == len(PROMPTS)
    assert token_ids(b.generate(PROMPTS, max_new_tokens=32)) == plain_demo_output
    assert b.last_stats["alpha"] > a.last_stats["alpha"]
    assert b.last_stats["num_accepted_tokens"] > a.last_stats["num_accepted_tokens"]
    assert len(json.loads(cache.read_text())["sequences"]) == 2 * len(PROMPTS)


def test_sampling_on_the_synthetic_pair_runs():
    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic", "proposer=suffix",
                                 "logits=[temperature]", "proposer.k=6"])
    assert not pipe.greedy
    out = pipe.generate(["abcabcabcabc", "the cat the cat the"], max_new_tokens=48)
    assert [len(r.token_ids) for r in out] == [48, 48]
    assert pipe.last_stats["num_draft_tokens"] > 0
    assert 0.0 <= pipe.last_stats["alpha"] <= 1.0


def test_specflow_run_proposer_suffix_from_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != plugins.AUTOLOAD_ENV}
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "specflow.cli", "run", "proposer=suffix", "max_new_tokens=16",
         "prompt=def add(a, b):", "--quiet", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["aggregate"]["num_committed_tokens"] == 16


def test_a_cache_rewritten_by_another_pipeline_is_reloaded_at_run_start(tmp_path):
    cache = str(tmp_path / "shared.json")
    a = SuffixProposer(SuffixProposerConfig(cache_path=cache))
    b = SuffixProposer(SuffixProposerConfig(cache_path=cache))   # built before a saved
    a.add_finished([1, 2, 3])
    a.specflow_run_end(pipeline=None, results=[], stats={})
    assert len(b.global_tree) == 0
    b.specflow_run_start(pipeline=None, requests=[])
    assert list(b.global_tree.sequences()) == [[1, 2, 3]]
    b.specflow_run_start(pipeline=None, requests=[])             # unchanged file: no reload
    assert list(b.global_tree.sequences()) == [[1, 2, 3]]
