"""What specflow can run inside vLLM, and one line for what it cannot."""
from __future__ import annotations

import pytest

from specflow.errors import ConfigError
from specflow.vllm.stages import HistoryStages, read_overrides


@pytest.mark.parametrize("overrides, message", [
    (["proposer=draft"], r"proposer=draft needs a draft model.*method': 'draft_model'"),
    (["proposer=eagle"], r"proposer=eagle cannot be built without specflow's own target model"
                         r".*hidden states.*eagle3"),
    (["proposer=ngram", "proposer.topk=2"], r"proposer.topk=2: vLLM verifies chains"),
    (["proposer=ngram", "policy=goodput"], r"policy.goodput needs specflow's own pipeline"),
    (["proposer=none"], r"proposer=none drafts nothing"),
    (["proposer=ngram", "proposer.min_n=0"], r"proposer.min_n=0"),
    (["proposer=ngram", "logits=[temperature]"], r"logits=\[temperature\]: inside vLLM the "
                                                 r"target's sampling"),
    (["proposer=ngram", "constraint=regex", "constraint.pattern=a+"],
     r"constraint=regex: inside vLLM"),
])
def test_what_needs_more_than_the_token_history_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        HistoryStages.build(overrides, k_max=4, slots=4)
    assert "\n" not in str(err.value)


def test_unsplittable_overrides_say_how_to_quote_them():
    with pytest.raises(ConfigError, match="SPECFLOW_VLLM_OVERRIDES=.*cannot be split"):
        read_overrides("proposer=ngram stop.strings=['oops")


def test_proposer_k_defaults_to_vllms_and_a_history_plugin_proposer_builds():
    stages = HistoryStages.build(read_overrides("policy=schedule"), k_max=6, slots=2)
    assert stages.cfg.proposer.name == "ngram" and stages.cfg.proposer.k == 6
    assert stages.cfg.policy.name == "schedule"
    stages = HistoryStages.build(["proposer=ngram", "proposer.k=2"], k_max=6, slots=2)
    assert stages.cfg.proposer.k == 2


PLUGIN = "specflow_vllm_fake"
SOURCE = '''
import torch
from dataclasses import dataclass
from specflow import hookimpl, Proposal, PAD


@dataclass
class Cfg:
    name: str = "repeat"
    k: int = 2


class Repeat:
    """Drafts the row's last token k times: from the token history only."""
    def __init__(self, cfg, ctx):
        self.k = cfg.k

    @hookimpl
    def specflow_propose(self, batch, k):
        out = torch.full((batch.size, int(k.max()) if batch.size else 0), PAD, dtype=torch.long)
        for b, (ids, kb) in enumerate(zip(batch.token_ids, k.tolist())):
            out[b, :kb] = ids[-1]
        return Proposal(out, None)


class Reader(Repeat):
    @hookimpl
    def specflow_hidden_layers(self):
        return [1]


@hookimpl
def specflow_register(registry):
    registry.add("proposer", "repeat", Repeat, schema=Cfg)
    registry.add("proposer", "reader", Reader, schema=Cfg)


@hookimpl
def specflow_config_searchpath():
    return "pkg://{module}.conf"
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    import sys

    from fake_plugins import install_fake_plugin

    from specflow import plugins

    root = install_fake_plugin(tmp_path, PLUGIN, SOURCE, option=("proposer", "repeat"))
    (root / PLUGIN / "conf" / "proposer" / "reader.yaml").write_text("name: reader\nk: 2\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    plugins.reset()
    yield
    plugins.reset()
    for name in [m for m in sys.modules if m.startswith(PLUGIN)]:
        del sys.modules[name]


def test_a_third_party_history_proposer_drafts_inside_vllm(plugin):
    from specflow.vllm import SpecflowProposer
    from specflow.vllm.testing import FakeEngine, vllm_config

    p = SpecflowProposer(vllm_config(k=3), overrides=read_overrides("proposer=repeat"))
    e = FakeEngine(p, 4)
    e.add("a", [3, 3, 3, 3])
    for _ in range(4):
        drafts = e.step()
        assert drafts[0] == [e.rows[0]["tokens"][-1]] * 3
    assert p.stats()["num_draft_tokens"] == 9       # three verdicts so far (the last pending)


def test_a_plugin_proposer_that_reads_hidden_states_is_refused(plugin):
    with pytest.raises(ConfigError, match="proposer=reader reads the target's hidden states.*"
                                          "eagle3"):
        HistoryStages.build(["proposer=reader"], k_max=2, slots=1)
