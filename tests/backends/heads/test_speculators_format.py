"""Heads in the speculators format: written from a published-layout head, read by specflow with
the same weights (the speculators package itself: tests/vllm_support/test_in_vllm.py)."""
from __future__ import annotations

import json

import pytest

from specflow import ConfigError, Pipeline
from specflow.backends.heads.eagle import DEMO_HEAD, head_shape
from specflow.backends.hf.backend import DEMO_DIR
from specflow.backends.heads.speculators_format import flatten, to_speculators, write_speculators

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push("]


@pytest.fixture(scope="module")
def speculators_head(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec") / "head"
    write_speculators(DEMO_HEAD, out, verifier=str(DEMO_DIR / "target"))
    return out


def test_the_speculators_config_nests_the_layer_and_names_the_verifier(speculators_head):
    config = json.loads((speculators_head / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(DEMO_DIR / "target"), "architectures": ["LlamaForCausalLM"]}
    from safetensors import safe_open

    with safe_open(str(speculators_head / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and not any("midlayer" in n for n in names)


def test_flatten_reads_back_the_shape_the_published_config_gives():
    published = json.loads((DEMO_HEAD / "config.json").read_text())
    back = flatten(to_speculators(published, "target"))
    assert head_shape(back, None, "x") == head_shape(published, None, "x")
    assert back["specflow"] == published["specflow"]          # the model card travels along


def test_specflow_runs_a_speculators_head_exactly_as_the_published_one(speculators_head):
    base = ["model=demo", "max_batch_size=3", "max_new_tokens=24"]
    plain = Pipeline.from_config([*base, "proposer=none"]).generate(PROMPTS)
    runs = {}
    for name, path in (("published", DEMO_HEAD), ("speculators", speculators_head)):
        pipe = Pipeline.from_config([*base, "proposer=eagle", f"proposer.path={path}"])
        runs[name] = ([r.token_ids for r in pipe.generate(PROMPTS)],
                      pipe.last_stats["num_accepted_tokens"], pipe.last_stats["num_draft_tokens"])
    assert runs["speculators"][0] == [r.token_ids for r in plain]
    assert runs["speculators"] == runs["published"]            # same weights, same drafts
    assert runs["published"][1] > 0


def test_a_speculators_head_for_another_target_is_one_line(speculators_head, tmp_path):
    config = json.loads((speculators_head / "config.json").read_text())
    config["transformer_layer_config"]["vocab_size"] = 999
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((speculators_head / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="trained for another target.*vocabulary 999"):
        Pipeline.from_config(["model=demo", "proposer=eagle", f"proposer.path={bad}"])
