"""The Backend contract's own choices and timing: `tune` (threads, weight layout), `describe`
(what metrics.json records) and `time_pass` (a synchronised, median pass; slots left empty), and
the proposers' `specflow_draft_step_seconds`."""
from __future__ import annotations

import re

import pytest
import torch

from specflow import Pipeline
from specflow.backends.contract import SimClock
from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.synthetic import SyntheticBackend, SyntheticModelConfig


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo_target():
    return HFBackend(HFModelConfig(path=str(DEMO_DIR / "target")), torch.device("cpu"), 2)


def test_time_pass_times_a_synthetic_pass_without_charging_its_clock():
    clock = SimClock()
    backend = SyntheticBackend(SyntheticModelConfig(), clock=clock, slots=2)
    seconds = backend.time_pass(rows=2, positions=3, reps=2)
    assert seconds > 0 and clock.time == 0
    assert [backend.cache_length(s) for s in (0, 1)] == [0, 0]


def test_time_pass_times_a_transformers_pass_and_empties_its_slots(demo_target):
    one = demo_target.time_pass(reps=2)
    wide = demo_target.time_pass(rows=2, positions=4, reps=2, context=8)
    assert one > 0 and wide > 0
    assert [demo_target.cache_length(s) for s in (0, 1)] == [0, 0]


def test_describe_reports_how_a_transformers_backend_runs(demo_target):
    described = demo_target.describe()
    assert {"forward", "threads", "packed", "kernels"} <= described.keys()
    assert described["forward"] == "lean"
    assert described["kernels"] == demo_target.lean.kernels.describe()
    assert described["packed"] is False and described["threads"] == torch.get_num_threads()


def test_tune_applies_threads_and_pack_for_the_target_only(restore_threads):
    # the settings are the backend's own config group's (model.threads, draft.pack, ...)
    target = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), threads=1, pack=False),
                       torch.device("cpu"), 2)
    torch.set_num_threads(2)
    target.tune(rows=1, positions=5)
    assert torch.get_num_threads() == 1
    assert target.describe()["threads"] == 1 and target.describe()["packed"] is False
    assert not target.lean.packed
    draft = HFBackend(HFModelConfig(path=str(DEMO_DIR / "draft"), threads=1, pack=False),
                      torch.device("cpu"), 1, role="draft")
    torch.set_num_threads(2)
    draft.tune(rows=1, positions=1)
    assert torch.get_num_threads() == 2                 # a draft model leaves threads alone
    assert draft.describe()["packed"] is False


def test_pipeline_reports_what_its_backends_chose(restore_threads):
    pipe = Pipeline.from_config(["model=demo", "draft=demo", "proposer=draft", "threads=1",
                                 "pack=false", "show_progress=false"])
    assert pipe.threads == 1 and pipe.packed is False and pipe.draft_packed is False
    assert pipe.kernels == pipe.target.lean.kernels.describe()
    assert pipe.backends["target"] == pipe.target.describe()
    assert pipe.backends["draft"]["forward"] == "lean"
    seconds = pipe.hook.specflow_draft_step_seconds(rows=2, positions=1)
    assert seconds is not None and seconds > 0
    assert [pipe.draft.cache_length(s) for s in (0, 1)] == [0, 0]
    unbuilt = Pipeline.from_config(["model=demo", "draft=demo", "proposer=ngram", "threads=1",
                                    "pack=false", "show_progress=false"])
    assert "draft" not in unbuilt.backends and unbuilt.draft_packed is False
    assert unbuilt.ctx._draft is None                     # reading them built no draft model


def test_a_simulated_draft_model_offers_no_step_timing(make_pipeline):
    pipe = make_pipeline("proposer=draft")
    assert pipe.hook.specflow_draft_step_seconds(rows=1, positions=1) is None
    assert pipe.threads == torch.get_num_threads() and pipe.packed is False


def test_a_tokenizer_declares_its_grammar_vocabulary_and_grammars_compile_over_it():
    """Grammars read the tokens' bytes through the contract (Tokenizer.grammar_vocabulary), not
    a transformers tokenizer's insides: a tokenizer of any backend that spells its tokens gets
    grammar constraints; one that declares nothing is refused in one line."""
    from specflow.backends.contract import GrammarVocabulary, Tokenizer, grammar_vocabulary
    from specflow.constraints.index import compile_index

    class Letters(Tokenizer):
        eos_token_id = 0

        def grammar_vocabulary(self, eos_id):
            return GrammarVocabulary(("letters", eos_id), lambda: {b"a": [1], b"b": [2],
                                                                   b"ab": [3]})

    index = compile_index("(ab)+", Letters(), 0, "constraint.pattern")
    assert sorted(index.get_allowed_tokens(index.get_initial_state())) == [1, 3]
    assert grammar_vocabulary(Letters(), 0).key == ("letters", 0)

    class Plain:                    # a plugin's tokenizer that predates the contract's method
        eos_token_id = 0
    assert grammar_vocabulary(Plain(), 0) is None
    assert grammar_vocabulary(Tokenizer(), 0) is None


def test_the_root_keys_fill_the_model_and_draft_groups_and_each_group_may_differ(restore_threads):
    from specflow.config import compose

    cfg = compose(["threads=1", "pack=false", "native=false"])
    assert (cfg.model.threads, cfg.model.pack, cfg.model.native) == (1, False, False)
    assert (cfg.draft.pack, cfg.draft.native) == (False, False)
    cfg = compose(["model.threads=2", "draft.pack=true"])
    assert (cfg.threads, cfg.model.threads, cfg.draft.pack, cfg.model.pack) == ("auto", 2, True, "auto")


@pytest.mark.parametrize("override,line", [
    ("threads=0", "threads=0 is out of range [1, 4096]"),
    ("model.threads=two", "threads='two' is not a whole number"),
    ("pack=maybe", "pack='maybe'; use auto"),
    ("draft.native=2", "native=2; use auto"),
])
def test_a_bad_backend_setting_is_one_line(override, line):
    from specflow.config import compose, validate
    from specflow.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(line)):
        validate(compose([override]))
