"""specflow's vLLM general plugin: SPECFLOW_VLLM_OVERRIDES refused in vLLM's front end, before any
engine process starts (a stand-in for vLLM's EngineArgs; tests/vllm_support/test_in_vllm.py runs
the real one)."""
from __future__ import annotations

import pathlib
import sys

import pytest

from specflow.errors import ConfigError
from specflow.vllm import SpecflowProposer, plugin
from specflow.vllm.testing import vllm_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRAFT_LINE = ("proposer=draft needs a draft model, which specflow cannot run inside vLLM; use "
              "vLLM's own draft-model speculation")
TYPO_LINE = "Could not find 'proposer/ngarm'; valid options for proposer: draft, eagle, ngram, none"


def engine_args(method="custom_class", model="specflow.vllm.SpecflowProposer"):
    """A stand-in for vllm.engine.arg_utils.EngineArgs, wrapped as the plugin wraps vLLM's."""
    made = []

    class EngineArgs:
        def create_engine_config(self, usage_context=None, headless=False):
            config = vllm_config(k=3, max_num_seqs=2)
            config.speculative_config.method = method
            config.speculative_config.model = model
            made.append(config)
            return config

    plugin.wrap(EngineArgs)
    return EngineArgs(), made


@pytest.mark.parametrize("overrides, line", [("proposer=draft", DRAFT_LINE),
                                             ("proposer=ngarm", TYPO_LINE)])
def test_a_bad_override_is_refused_in_one_line_when_the_front_end_makes_its_config(
        monkeypatch, overrides, line):
    monkeypatch.setenv("SPECFLOW_VLLM_OVERRIDES", overrides)
    args, made = engine_args()
    with pytest.raises(ConfigError) as err:
        args.create_engine_config()
    assert line in str(err.value) and "\n" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__   # no chained story
    assert len(made) == 1          # refused right after vLLM resolved its config: nothing started


def test_vllms_command_line_gets_the_line_and_exit_status_2(monkeypatch, capsys):
    monkeypatch.setenv("SPECFLOW_VLLM_OVERRIDES", "proposer=ngarm")
    monkeypatch.setattr(plugin, "_in_vllm_cli", lambda: True)
    args, _ = engine_args()
    with pytest.raises(SystemExit) as done:
        args.create_engine_config()
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specflow: error: {TYPO_LINE}") and len(err.splitlines()) == 1


def test_good_overrides_and_other_drafters_pass_untouched(monkeypatch):
    monkeypatch.setenv("SPECFLOW_VLLM_OVERRIDES", "proposer=ngram policy=adaptive")
    args, made = engine_args()
    assert args.create_engine_config() is made[-1]
    monkeypatch.setenv("SPECFLOW_VLLM_OVERRIDES", "proposer=draft")   # read by no one here
    for method, model in [("ngram", "ngram"), ("custom_class", "mypkg.drafters.Mine"),
                          ("custom_class", "specflow.vllm.NoSuchClass")]:
        args, made = engine_args(method, model)
        assert args.create_engine_config() is made[-1]
    assert "mypkg" not in sys.modules        # another package's drafter is not imported


def test_the_drafter_is_checked_as_it_will_be_built():
    config = vllm_config(k=5, max_num_seqs=3)
    stages = SpecflowProposer.stages_for(config, ["proposer=ngram"])
    assert stages.k_max == 5 and stages.cfg.max_batch_size == 3
    assert plugin.drafter_class("specflow.vllm.SpecflowProposer") is SpecflowProposer
    assert plugin.drafter_class("specflow.vllm.proposer.SpecflowProposer") is SpecflowProposer
    assert plugin.drafter_class("specflow.vllm.OVERRIDES_ENV") is None


def test_wrapping_twice_checks_once(monkeypatch):
    class EngineArgs:
        def create_engine_config(self):
            return vllm_config()

    plugin.wrap(EngineArgs)
    wrapped = EngineArgs.create_engine_config
    plugin.wrap(EngineArgs)
    assert EngineArgs.create_engine_config is wrapped


def test_without_vllm_the_entry_point_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)     # import fails
    plugin.register()


def test_vllm_finds_the_plugin_in_the_package_metadata():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["specflow"]
    module, _, name = target.partition(":")
    assert (module, name) == ("specflow.vllm.plugin", "register")


def test_the_drafter_in_a_worker_puts_the_line_on_stderr_as_well(monkeypatch, capsys):
    """Where the front end did not check (VLLM_PLUGINS without specflow), vLLM's worker wraps the
    drafter's error in tracebacks: the line stands on its own on stderr first."""
    monkeypatch.setenv("SPECFLOW_VLLM_OVERRIDES", "proposer=draft")
    with pytest.raises(ConfigError, match="proposer=draft needs a draft model"):
        SpecflowProposer(vllm_config())
    assert capsys.readouterr().err == f"specflow: error: {DRAFT_LINE}: " \
                                      f"speculative_config={{'method': 'draft_model', " \
                                      f"'model': <draft folder>}}\n"
