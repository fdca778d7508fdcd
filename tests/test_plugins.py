"""Hooks and plugin managers: docstrings, entry points, typos, collisions, config order."""
from __future__ import annotations

import inspect
import sys

import pytest
import torch

from fake_plugins import install_fake_plugin
from specflow import PluginError, hookimpl, hookspecs, plugins
from specflow.stages.logits import apply_min_p, apply_temperature


def test_every_hook_has_a_docstring_that_says_when_and_what():
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if name.startswith("specflow_")]
    assert len(specs) >= 14
    for f in specs:
        doc = inspect.getdoc(f) or ""
        assert "Called" in doc, f"{f.__name__}: say when it is called"
        assert "Return" in doc or "return" in doc, f"{f.__name__}: say what it returns"


def test_misspelled_hook_fails_with_the_plugins_name(make_pipeline):
    class Typo:
        @hookimpl
        def specflow_propse(self, batch, k):
            return None

    pipe = make_pipeline()
    with pytest.raises(PluginError, match=r"typo-plugin.*specflow_propse.*specflow_propose"):
        pipe.register(Typo(), name="typo-plugin")


def test_two_pipelines_do_not_share_stages(make_pipeline):
    a, b = make_pipeline("proposer=ngram"), make_pipeline("proposer=draft")
    assert a.pm is not b.pm
    assert a.pm.get_plugin("proposer.ngram") is not None and b.pm.get_plugin("proposer.ngram") is None


def test_logit_processors_run_in_config_order(make_pipeline):
    logits = torch.tensor([[[2.0, 1.5, 1.0, -1.0]]])                   # [B=1, P=1, V=4]
    for order in (["temperature", "min_p"], ["min_p", "temperature"]):
        pipe = make_pipeline(f"logits=[{','.join(order)}]", "logits.temperature.value=0.25",
                             "logits.min_p.p=0.3")
        called = [impl.plugin_name for impl in
                  reversed(pipe.hook.specflow_process_logits.get_hookimpls())]
        assert called == [f"logits.{n}" for n in order]
        expected = logits
        for name in order:
            expected = (apply_temperature(expected, 0.25) if name == "temperature"
                        else apply_min_p(expected, 0.3))
        got = pipe.shape(logits, [[0]], torch.zeros(1, 0, dtype=torch.long), 0, [0], "target")
        assert torch.equal(got, expected)
    # the two orders really differ, so the check above can fail
    a = apply_min_p(apply_temperature(logits, 0.25), 0.3)
    b = apply_temperature(apply_min_p(logits, 0.3), 0.25)
    assert not torch.equal(a, b)


# --- third-party packages through entry points -----------------------------------------------

PLUGIN_SOURCE = '''
from dataclasses import dataclass
import torch
from specflow import hookimpl
from specflow.state import Proposal

@dataclass
class EchoConfig:
    name: str = "echo"
    k: int = 2

class Echo:
    """Proposes the last token again, k times."""
    def __init__(self, cfg, ctx):
        self.k = cfg.k
    @hookimpl
    def specflow_propose(self, batch, k):
        last = batch.last_tokens()
        out = last[:, None].repeat(1, self.k)                       # [B, k]
        keep = torch.arange(self.k)[None, :] < k[:, None]           # never more than asked
        return Proposal(torch.where(keep, out, torch.full_like(out, -1)))

@hookimpl
def specflow_register(registry):
    registry.add("proposer", "echo", Echo, EchoConfig)

@hookimpl
def specflow_config_searchpath():
    return "pkg://{module}.conf"
'''


@pytest.fixture
def plugin_env(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    plugins.reset()
    yield tmp_path
    plugins.reset()
    for name in [m for m in sys.modules if m.startswith("fake_specflow")]:
        del sys.modules[name]


def test_entry_point_plugin_adds_a_proposer_and_its_config(plugin_env):
    from specflow import Pipeline

    install_fake_plugin(plugin_env, "fake_specflow_echo", PLUGIN_SOURCE)
    names = [row["name"] for row in plugins.plugin_distributions()]
    assert "fake_specflow_echo" in names
    row = next(r for r in plugins.plugin_distributions() if r["name"] == "fake_specflow_echo")
    assert row["version"] == "0.3.1" and "proposer=echo" in row["components"]
    pipe = Pipeline.from_config(["model=synthetic", "proposer=echo", "proposer.k=2"])
    out = pipe.generate(["aaaa"], max_new_tokens=12)[0]
    assert len(out.token_ids) == 12 and pipe.last_stats["num_draft_tokens"] > 0


def test_autoload_can_be_switched_off(plugin_env, monkeypatch):
    install_fake_plugin(plugin_env, "fake_specflow_off", PLUGIN_SOURCE)
    monkeypatch.setenv(plugins.AUTOLOAD_ENV, "1")
    plugins.reset()
    assert "fake_specflow_off" not in [r["name"] for r in plugins.plugin_distributions()]


def test_entry_point_plugin_with_a_misspelled_hook_fails_at_load(plugin_env):
    install_fake_plugin(plugin_env, "fake_specflow_typo", '''
        from specflow import hookimpl
        @hookimpl
        def specflow_regster(registry):
            pass
        ''', extra_conf=False)
    with pytest.raises(PluginError, match=r"fake_specflow_typo.*fake-specflow-typo 0\.3\.1.*"
                                          r"specflow_regster.*specflow_register"):
        plugins.get_plugin_manager()


def test_plugin_option_colliding_with_a_builtin_is_refused(plugin_env):
    install_fake_plugin(plugin_env, "fake_specflow_clash", '''
        from specflow import hookimpl
        @hookimpl
        def specflow_register(registry):
            registry.add("proposer", "ngram", object)
        ''', extra_conf=False)
    with pytest.raises(PluginError, match=r"'ngram'.*specflow\.builtins.*fake_specflow_clash"):
        plugins.get_registry()


RAISING_SOURCE = PLUGIN_SOURCE.replace('''        last = batch.last_tokens()''',
                                       '''        if batch.num_generated(0) >= 3:
            raise ZeroDivisionError("draft table empty")
        last = batch.last_tokens()''')


def test_plugin_raising_inside_a_hook_is_named_with_its_package(plugin_env):
    from specflow import Pipeline

    install_fake_plugin(plugin_env, "fake_specflow_raiser", RAISING_SOURCE)
    pipe = Pipeline.from_config(["model=synthetic", "proposer=echo"])
    with pytest.raises(PluginError, match=r"plugin proposer\.echo \(fake-specflow-raiser 0\.3\.1\) "
                                          r"raised ZeroDivisionError: draft table empty in hook "
                                          r"specflow_propose") as info:
        pipe.generate(["abc"], max_new_tokens=12)
    assert isinstance(info.value.__cause__, ZeroDivisionError)   # the traceback is kept


def test_plugin_factory_raising_is_named_with_its_package(plugin_env):
    from specflow import Pipeline

    install_fake_plugin(plugin_env, "fake_specflow_badinit", PLUGIN_SOURCE.replace(
        "self.k = cfg.k", "self.k = cfg.kk"))
    with pytest.raises(PluginError, match=r"fake_specflow_badinit \(fake-specflow-badinit 0\.3\.1\)"
                                          r" raised AttributeError.*building proposer=echo"):
        Pipeline.from_config(["model=synthetic", "proposer=echo"])


def test_specflows_own_bugs_are_not_blamed_on_plugins(make_pipeline):
    class Probe:   # defined in specflow's tests, not an installed package: still a plugin
        @hookimpl
        def specflow_observe(self, result):
            raise RuntimeError("probe")

    pipe = make_pipeline(plugins=[Probe()])
    with pytest.raises(PluginError, match="plugin Probe .*not an installed package.*RuntimeError"):
        pipe.generate(["ab"], max_new_tokens=3)
    assert plugins.blame(RuntimeError("x"), "here", "specflow.pipeline", "core") is None


def test_plugin_yaml_shadowing_a_builtin_option_is_refused(plugin_env):
    install_fake_plugin(plugin_env, "fake_specflow_shadow", PLUGIN_SOURCE)
    conf = plugin_env / "fake_specflow_shadow" / "conf" / "proposer"
    (conf / "ngram.yaml").write_text("name: echo\nk: 3\n")
    with pytest.raises(PluginError, match=r"config option 'proposer=ngram' of plugin "
                                          r"fake_specflow_shadow \(fake-specflow-shadow 0\.3\.1\).*"
                                          r"collides with the one of specflow \(built-in\)"):
        plugins.config_searchpath()


def test_two_plugins_with_the_same_yaml_option_are_refused(plugin_env):
    install_fake_plugin(plugin_env, "fake_specflow_one", PLUGIN_SOURCE)
    install_fake_plugin(plugin_env, "fake_specflow_two", PLUGIN_SOURCE.replace('"echo"', '"echo2"'))
    with pytest.raises(PluginError, match=r"'proposer=echo'.*fake_specflow_(one|two).*collides"
                                          r".*fake_specflow_(one|two)"):
        plugins.config_searchpath()


def test_a_proposer_returning_more_drafts_than_k_is_refused(make_pipeline):
    from specflow.state import Proposal

    class Greedy:
        @hookimpl
        def specflow_propose(self, batch, k):
            return Proposal(torch.zeros(batch.size, int(k.max()) + 2, dtype=torch.long))

    pipe = make_pipeline("proposer=draft", plugins=[Greedy()])
    with pytest.raises(PluginError, match=r"returned 6 drafts for a row given k=4; a proposer may "
                                          r"return fewer drafts than asked, never more"):
        pipe.generate(["ab"], max_new_tokens=20)


def test_a_wrapper_failing_after_its_yield_is_blamed_not_the_stage_it_wrapped(make_pipeline):
    class Tracer:
        @hookimpl(wrapper=True)
        def specflow_propose(self):
            yield
            raise RuntimeError("teardown broke")

    pipe = make_pipeline("proposer=draft", plugins=[Tracer()])
    with pytest.raises(PluginError, match=r"plugin Tracer .*RuntimeError: teardown broke in hook "
                                          r"specflow_propose"):
        pipe.generate(["ab"], max_new_tokens=8)


def test_specflow_code_failing_under_a_plugins_call_is_not_blamed_on_it(make_pipeline):
    class CallsBack:
        @hookimpl
        def specflow_propose(self, batch, k):
            return batch.select([99])          # specflow's own code raises IndexError

    pipe = make_pipeline("proposer=draft", plugins=[CallsBack()])
    with pytest.raises(Exception) as info:
        pipe.generate(["ab"], max_new_tokens=8)
    assert isinstance(info.value, IndexError)   # specflow's frame ran last: its own traceback


def test_out_of_memory_passes_through_unchanged(make_pipeline):
    class Hungry:
        @hookimpl
        def specflow_observe(self, result):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        make_pipeline(plugins=[Hungry()]).generate(["ab"], max_new_tokens=4)


@pytest.mark.parametrize("drafts,counts,message", [
    ([[3, -1, 4]], None, "padding \\(-1\\) between drafts"),
    ([[3, 10_000]], None, "token ids outside the vocabulary"),
    # counted drafts stay on the device and are checked there, read with the verifier's
    # output: the same lines, before anything is committed
    ([[3, -1, 4]], [3], "padding \\(-1\\) between drafts"),
    ([[3, 10_000]], [2], "token ids outside the vocabulary"),
    ([[3, -7]], [2], "token ids outside the vocabulary"),
    ([[3, 4]], [1], r"said its rows \[0\] hold \[1\] drafts \(draft_counts\) but returned \[2\]"),
    ([[3, 4]], [3], r"draft_counts=\[3\] for 1 rows of at most 2 drafts"),
    ([[3, 4, 5, 6, 7, 8]], [6], "returned 6 drafts for a row given k=4"),
])
def test_malformed_drafts_are_refused(make_pipeline, drafts, counts, message):
    from specflow.state import Proposal

    class Bad:
        @hookimpl
        def specflow_propose(self, batch, k):
            return Proposal(torch.tensor(drafts), draft_counts=counts)

    pipe = make_pipeline("proposer=draft", plugins=[Bad()])
    with pytest.raises(PluginError, match=message) as info:
        pipe.generate(["ab"], max_new_tokens=20)
    assert "\n" not in str(info.value)


def test_a_search_path_in_hydras_slash_form_works_and_a_broken_one_names_the_plugin(plugin_env):
    install_fake_plugin(plugin_env, "fake_specflow_slash",
                        PLUGIN_SOURCE.replace('"pkg://{module}.conf"', '"pkg://{module}/conf"'))
    assert any("slash" in e for e in plugins.config_searchpath())
    plugins.reset()
    install_fake_plugin(plugin_env, "fake_specflow_nopkg",
                        PLUGIN_SOURCE.replace('"pkg://{module}.conf"', '"pkg://{module}.nope"')
                        .replace('"echo"', '"echo3"'), extra_conf=False)
    with pytest.raises(PluginError, match=r"plugin fake_specflow_nopkg \(fake-specflow-nopkg "
                                          r"0\.3\.1\) gives config search path"):
        plugins.config_searchpath()


def test_blame_names_the_instance_that_raised_among_instances_of_one_class():
    from specflow import Pipeline

    class Obs:
        def __init__(self, bad):
            self.bad = bad

        @hookimpl
        def specflow_observe(self, result):
            if self.bad:
                raise KeyError("broken observer")

    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic"])
    pipe.register(Obs(False), name="observer.good")
    pipe.register(Obs(True), name="observer.bad")
    pipe.register(Obs(False), name="observer.also_good")
    with pytest.raises(PluginError, match=r"plugin observer\.bad "):
        pipe.generate(["ab"], max_new_tokens=4)
