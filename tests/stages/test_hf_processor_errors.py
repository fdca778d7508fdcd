"""`logits=[hf] logits.hf.class_path=...` calls only a transformers LogitsProcessor subclass: any
other object (os.system, print, json.loads, a class of another kind) is refused before it is
called, with one line naming the value and the fix (ConfigError, exit 2)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from specflow import ConfigError, Pipeline

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
SYN = ["model=synthetic", "draft=synthetic"]


def _build(class_path: str, *overrides: str):
    return Pipeline.from_config([*SYN, "logits=[hf]", f"logits.hf.class_path={class_path}",
                                 *overrides])


@pytest.mark.parametrize("class_path,what", [
    ("os:system", "is the function system"),
    ("os.system", "is the function system"),
    ("builtins:print", "is the function print"),
    ("json:loads", "is the function loads"),
    ("builtins:dict", "is the class builtins.dict"),
    ("transformers.LogitsProcessorList", "is the class transformers."),
    ("os:sep", "is a str value"),
    ("os:path", "is a module"),
])
def test_anything_but_a_logits_processor_class_is_refused(class_path, what):
    with pytest.raises(ConfigError) as info:
        _build(class_path)
    text = str(info.value)
    assert text.startswith(f"logits.hf.class_path={class_path!r} {what}"), text
    assert "not a subclass of transformers.LogitsProcessor; give a LogitsProcessor class" in text
    assert "\n" not in text and info.value.exit_code == 2


def test_a_refused_callable_is_never_called(tmp_path, monkeypatch):
    (tmp_path / "sideeffect_mod.py").write_text(
        "CALLS = []\n\ndef run(**kwargs):\n    CALLS.append(kwargs)\n\n"
        "class NotAProcessor:\n    def __init__(self, **kwargs):\n        CALLS.append(kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sideeffect_mod

    for name in ("run", "NotAProcessor"):
        with pytest.raises(ConfigError, match="not a subclass of transformers.LogitsProcessor"):
            _build(f"sideeffect_mod:{name}", "+logits.hf.kwargs.command=echo")
    assert sideeffect_mod.CALLS == []
    sys.modules.pop("sideeffect_mod", None)


def test_bad_kwargs_of_a_real_processor_are_one_line():
    with pytest.raises(ConfigError) as info:
        _build("transformers.RepetitionPenaltyLogitsProcessor", "logits.hf.kwargs.penalty=-1")
    text = str(info.value)
    assert "transformers.RepetitionPenaltyLogitsProcessor({'penalty': -1}) failed:" in text
    assert "fix logits.hf.kwargs" in text and "\n" not in text
    with pytest.raises(ConfigError, match="unexpected keyword argument 'nope'; fix logits.hf"):
        _build("transformers.RepetitionPenaltyLogitsProcessor", "+logits.hf.kwargs.nope=1")


def test_a_logits_processor_class_still_runs():
    pipe = _build("transformers.RepetitionPenaltyLogitsProcessor", "logits.hf.kwargs.penalty=1.3")
    assert len(pipe.generate(["abc"], max_new_tokens=4)[0].token_ids) == 4


def test_cli_os_system_is_one_line(tmp_path):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([SPECFLOW, "run", *SYN, "logits=[hf]", "logits.hf.class_path=os:system",
                          "+logits.hf.kwargs.command=touch pwned",
                          f"hydra.run.dir={tmp_path}/run", "max_new_tokens=4"], cwd=tmp_path,
                         capture_output=True, env=env, timeout=300)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, (out.returncode, err)
    assert err.startswith("specflow: error: logits.hf.class_path='os:system' is the function "
                          "system, not a subclass of transformers.LogitsProcessor"), err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "run/pwned").exists()
    assert not (tmp_path / "run/metrics.json").exists()
