"""Checks that need the loaded target (its vocabulary, its context) run while the pipeline is
built, before anything is generated; the rest run at compose time. One line each."""
from __future__ import annotations

import pytest

from specflow import Pipeline
from specflow.config import compose
from specflow.errors import ConfigError

SYN = ["model=synthetic", "draft=synthetic"]     # a 64-token vocabulary


@pytest.mark.parametrize("overrides,needle", [
    (["stop.token_ids=[3, 64]"], "stop.token_ids has token id 64, outside the target's vocabulary "
     "of 64 tokens (ids 0 to 63); remove it or give an id below 64"),
    (["logits=[bad_words]", "logits.bad_words.words=[]", "logits.bad_words.token_ids=[[1, 99]]"],
     "logits.bad_words.token_ids has token id 99, outside the target's vocabulary of 64 tokens"),
    (["logits=[logit_bias]", "logits.logit_bias.bias={70: 1.0}"],
     "logits.logit_bias.bias has token id 70, outside the target's vocabulary of 64 tokens"),
    (["draft.max_length=16", "proposer=draft", "proposer.topk=20", "proposer.num_draft_tokens=20"],
     "proposer.topk=20 leaves no room in the draft model's 16-token context"),
])
def test_what_the_loaded_models_bound_is_one_line_before_generation(overrides, needle):
    with pytest.raises(ConfigError) as info:
        Pipeline.from_config([*SYN, *overrides])
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("overrides,needle", [
    (["stop.token_ids=[-1]"], "stop.token_ids has -1, which is not a token id"),
    (["logits=[bad_words]", "logits.bad_words.token_ids=[[2, -3]]"],
     "logits.bad_words.token_ids has -3, which is not a token id"),
    (["logits=[logit_bias]", "logits.logit_bias.bias={-1: 2.0}"],
     "logits.logit_bias.bias has -1, which is not a token id"),
    # numbers written as text are checked as converted (the merge turns them into floats)
    (["logits=[temperature]", "logits.temperature.value=Infinity"],
     "logits.temperature.value=inf is not a finite number"),
    (["logits=[top_p]", "logits.top_p.p='nan'"], "logits.top_p.p=nan is not a finite number"),
    (["logits=[logit_bias]", "logits.logit_bias.bias={0: Infinity}"],
     "logits.logit_bias.bias.0=inf is not a finite number; give a finite value or -inf"),
])
def test_what_needs_no_model_is_one_line_at_compose_time(overrides, needle):
    with pytest.raises(ConfigError) as info:
        compose([*SYN, *overrides])
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)

