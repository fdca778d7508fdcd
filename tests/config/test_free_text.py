"""Free text is text: `${...}`, quotes and backslashes in prompts, schemas, patterns, choices, stop
strings and paths reach the run as typed (the lists decode their escapes: test_escapes.py), never
as a Hydra/OmegaConf interpolation."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from specflow.config import compose, normalize_overrides
from specflow.resume import config_fingerprint

SYN = ["model=synthetic", "draft=synthetic"]
TEXTS = [
    "${oc.env:HOME}",                       # would read the environment
    "echo ${PATH} && ls ${HOME}/x",         # a shell snippet
    "const s = `${a} + ${b.c}`;",           # a JS template
    r"a\${x} and \\${y}",                   # backslashes before an interpolation
    r"C:\dir\sub\ ",                        # a Windows path, a trailing backslash
    "it's \"quoted\" ${x}",                 # both quote kinds
    "${",                                   # an unfinished one
    "tab\there, newline\nthere",
]


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_is_kept_verbatim(text, monkeypatch):
    monkeypatch.setenv("HOME", "/leaked")
    cfg = compose([*SYN, f"prompt={text}"])
    assert cfg.prompt == text
    assert OmegaConf.to_container(cfg, resolve=True)["prompt"] == text
    config_fingerprint(cfg)                 # resolving the whole config works


@pytest.mark.parametrize("text", TEXTS[:4])
def test_patterns_schemas_paths_and_lists_are_kept_verbatim(text, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", "/leaked")
    cfg = compose([*SYN, "workload=file", f"workload.path={text}"])
    assert cfg.workload.path == text
    cfg = compose(["model=hf", f"model.path={text}", "draft=hf", f"draft.path={text}"])
    assert cfg.model.path == cfg.draft.path == text
    cfg = compose([*SYN, f"stop.strings=[{text.replace(',', ' ')}, plain]"])
    # list elements take escapes (tests/config/test_escapes.py): `\$` is a `$`, `\\` a backslash
    listed = text.replace(",", " ").strip().replace("\\\\", "\0").replace("\\$", "$")
    assert list(cfg.stop.strings) == [listed.replace("\0", "\\"), "plain"]


def test_a_regex_with_dollar_braces_is_a_regex():
    cfg = compose(["proposer=ngram", "constraint=regex", r"constraint.pattern=\$\{[a-z]+\}"])
    assert cfg.constraint.pattern == r"\$\{[a-z]+\}"
    assert OmegaConf.to_container(cfg, resolve=True)["constraint"]["pattern"] == cfg.constraint.pattern


def test_choices_take_non_ascii_and_dollar_braces_bare():
    cfg = compose(["proposer=ngram", "constraint=choice", "constraint.choices=[café, 日本,${HOME}]"])
    assert list(cfg.constraint.choices) == ["café", "日本", "${HOME}"]


@pytest.mark.parametrize("override", [
    "prompt=${oc.env:HOME} it's",
    "stop.strings=[${x}, 'y', café]",
    "constraint.choices=[a,'b\\'c',d]",
    "constraint.pattern=a\\${b}",
])
def test_normalizing_twice_changes_nothing(override):
    """ab jobs compose the already normalized overrides again."""
    once = normalize_overrides([override])
    assert normalize_overrides(once) == once


def test_config_files_still_interpolate():
    cfg = compose(["model=hf", "model.path=/x", "dtype=bfloat16", "proposer=ngram"])
    assert cfg.model.dtype == "bfloat16"      # `dtype: ${dtype}` in conf/model/hf.yaml


def test_the_cli_keeps_a_prompt_with_dollar_braces(tmp_path):
    import json
    import os
    import pathlib
    import subprocess
    import sys

    specflow = str(pathlib.Path(sys.executable).parent / "specflow")
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1", "HOME": "/leaked"}
    prompt = "echo ${HOME} `${x}`"
    out = subprocess.run([specflow, "run", "proposer=none", f"prompt={prompt}", "max_new_tokens=3",
                          "--quiet", f"hydra.run.dir={tmp_path}/run"], capture_output=True,
                         env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()
    rows = [json.loads(line) for line in (tmp_path / "run/requests.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [prompt]


@pytest.mark.parametrize("value,expected", [
    ('"Hello," she said', '"Hello," she said'),     # starts with a quote, is not one string
    ("'quoted' text", "'quoted' text"),
    ("'${x}'", "${x}"),                              # quoted Hydra's way: unquoted, still text
    ("'it\\'s'", "it's"),
])
def test_values_that_start_with_a_quote(value, expected):
    assert compose([*SYN, f"prompt={value}"]).prompt == expected


def test_dict_options_take_new_keys_and_minus_inf_bans_a_token():
    from specflow import Pipeline

    pipe = Pipeline.from_config([*SYN, "logits=[logit_bias]", "logits.logit_bias.bias={5: -inf}"])
    assert pipe.cfg.logits.logit_bias.bias[5] == float("-inf")
    plain = Pipeline.from_config(SYN).generate(["ab", "cd", "ef"], max_new_tokens=40)
    banned = pipe.generate(["ab", "cd", "ef"], max_new_tokens=40)
    assert any(5 in r.token_ids for r in plain)          # the ban has something to do
    assert all(5 not in r.token_ids for r in banned)
