"""Checks before the weights load (backends/hf/preflight.py): they read config files and tokenizers
only, so each test hands them model folders whose weights are missing; a check that loaded
weights would fail on those with another error."""
from __future__ import annotations

import pathlib
import shutil

import pytest

from specflow.config import compose
from specflow.errors import ConfigError, InputError
from specflow.backends.hf.backend import DEMO_DIR
from specflow.backends.hf.tokenizers import _loaded, take_tokenizer
from specflow.build import preflight
from specflow.pipeline import Pipeline


def _without_weights(src: pathlib.Path, dst: pathlib.Path, tokenizer_of=None) -> pathlib.Path:
    """A copy of a model folder with its config and a tokenizer (its own, or another folder's),
    and no weights."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy((tokenizer_of or src) / name, dst / name)
    return dst


def _other_tokenizer():
    """A 300-token byte-level BPE: a tokenizer of another family."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([__doc__] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(autouse=True)
def forget_tokenizers():
    yield
    _loaded.clear()


def test_the_demo_draft_under_another_target_names_what_ships(tmp_path):
    target = _without_weights(DEMO_DIR / "target", tmp_path / "other-target")
    cfg = compose(["model=hf", f"model.path={target}"])          # draft=demo, proposer=draft
    with pytest.raises(ConfigError, match=r"proposer=draft \(the default proposer\) needs a "
                                          r"draft model with the target's tokenizer, and none "
                                          r"ships for model.path=.*proposer=ngram"):
        Pipeline(cfg)


def test_a_draft_with_another_tokenizer_is_refused_before_any_weights_load(tmp_path):
    target = _without_weights(DEMO_DIR / "target", tmp_path / "target")
    draft = _without_weights(DEMO_DIR / "draft", tmp_path / "draft")
    _other_tokenizer().save_pretrained(draft)
    cfg = compose(["model=hf", f"model.path={target}", "draft=hf", f"draft.path={draft}"])
    with pytest.raises(ConfigError, match="does not share the tokenizer of target"):
        Pipeline(cfg)


def test_a_prompt_past_the_context_is_refused_before_any_weights_load(tmp_path):
    target = _without_weights(DEMO_DIR / "target", tmp_path / "target")
    cfg = compose(["model=hf", f"model.path={target}", "proposer=ngram", "model.max_model_len=8"])
    preflight(cfg, ["a", "b"])                                     # short prompts pass
    with pytest.raises(InputError, match=r"prompt 1 has \d+ tokens but the model's context is 8; "
                                         r"shorten the prompt"):
        preflight(cfg, ["a", "abcdefghij" * 3])


def test_a_checked_tokenizer_is_handed_to_the_model_s_load_once():
    cfg = compose(["model=demo", "proposer=ngram"])
    preflight(cfg, ["def f():"])
    folder = str(DEMO_DIR / "target")
    tok = _loaded[folder]
    pipe = Pipeline(cfg)
    assert pipe.tokenizer.tok is tok and take_tokenizer(folder) is None
