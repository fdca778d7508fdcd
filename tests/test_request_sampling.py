"""A request's own sampling settings (generate(sampling=...), the engine, the server): the rows
that set them are shaped with their values, the others with the config's, and speculation stays
exact per row, so a seeded request gives the tokens of a pipeline configured with its values."""
from __future__ import annotations

import pytest
import torch

from specflow import InputError
from specflow.stages.logits import Temperature, TemperatureConfig, TopK, TopKConfig
from specflow.state import ShapingBatch

PROMPTS = ["def fib(n):", "class A:", "x = 1\n", "import os"]
SAMPLING = ["logits=[temperature,top_k]", "logits.temperature.value=1.0", "logits.top_k.k=20"]


def test_a_row_s_own_value_shapes_that_row_only():
    shaping = ShapingBatch.make_dummy(batch_size=3, positions=2, vocab_size=40)
    logits = shaping.logits.clone()
    shaping.sampling = [None, {"temperature": 0.5}, {"top_k": 3}]
    Temperature(TemperatureConfig(value=2.0)).specflow_process_logits(shaping)
    TopK(TopKConfig(k=30)).specflow_process_logits(shaping)
    assert torch.equal(shaping.logits[0], TopK(TopKConfig(k=30)).process(logits[0] / 2.0))
    assert torch.equal(shaping.logits[1], TopK(TopKConfig(k=30)).process(logits[1] / 0.5))
    assert torch.equal(shaping.logits[2], TopK(TopKConfig(k=3)).process(logits[2] / 2.0))


def test_temperature_zero_keeps_the_argmax_alone():
    shaping = ShapingBatch.make_dummy(batch_size=2, positions=3, vocab_size=40)
    argmax = shaping.logits.argmax(-1)
    shaping.sampling = [{"temperature": 0}, None]
    Temperature(TemperatureConfig(value=1.0)).specflow_process_logits(shaping)
    probs = shaping.logits[0].softmax(-1)
    assert torch.equal(probs.argmax(-1), argmax[0]) and torch.all(probs.max(-1).values == 1)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_mixed_rows_equal_pipelines_configured_with_each_row_s_values(make_pipeline, proposer):
    base = make_pipeline(f"proposer={proposer}", "max_new_tokens=24", "max_batch_size=4",
                         *SAMPLING)
    own = {"temperature": 0.6, "top_k": 5}
    mixed = base.generate(PROMPTS, sampling=[own, None, own, {"temperature": 0}])
    plain = base.generate(PROMPTS)
    tuned = make_pipeline(f"proposer={proposer}", "max_new_tokens=24", "max_batch_size=4",
                          "logits=[temperature,top_k]", "logits.temperature.value=0.6",
                          "logits.top_k.k=5").generate(PROMPTS)
    greedy = make_pipeline(f"proposer={proposer}", "max_new_tokens=24").generate(PROMPTS)
    assert mixed[0].token_ids == tuned[0].token_ids and mixed[2].token_ids == tuned[2].token_ids
    assert mixed[1].token_ids == plain[1].token_ids
    assert mixed[3].token_ids == greedy[3].token_ids          # temperature 0: greedy, exactly
    assert mixed[0].token_ids != plain[0].token_ids or mixed[2].token_ids != plain[2].token_ids


def test_only_configured_processors_with_valid_values(make_pipeline):
    pipe = make_pipeline(*SAMPLING)
    with pytest.raises(InputError, match=r"prompt 0: sampling top_p=0.9 needs the top_p "
                                         r"processor"):
        pipe.generate("a", sampling={"top_p": 0.9})
    with pytest.raises(InputError, match=r"prompt 1: logits.temperature.value=-1.0 must be >= 0"):
        pipe.generate(["a", "b"], sampling=[None, {"temperature": -1}])
    with pytest.raises(InputError, match="'seed' is not one of"):
        pipe.generate("a", sampling={"seed": 3})
    greedy = make_pipeline()
    with pytest.raises(InputError, match="needs the temperature processor"):
        greedy.generate("a", sampling={"temperature": 0.7})
    assert pipe.running_engine is None                # nothing left running after refusals
    before = pipe.generate(PROMPTS[:2], max_new_tokens=6, seed=4)
    pipe.generate(PROMPTS[:2], sampling={"temperature": 0.1}, max_new_tokens=4)
    assert pipe.running_engine is None
    # a request's own settings travel with its rows: none outlive them
    after = pipe.generate(PROMPTS[:2], max_new_tokens=6, seed=4)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]


@pytest.mark.parametrize("proposer", ["draft", "eagle"])
def test_a_request_s_own_penalties_in_a_greedy_pipeline(proposer):
    """The penalties change the argmax, so a greedy pipeline takes them per request too (demo
    pair: the EAGLE head reads the target's states)."""
    from specflow import Pipeline

    def make_pipeline(*overrides):
        return Pipeline.from_config(["model=demo", "draft=demo", *overrides])

    base = make_pipeline(f"proposer={proposer}", "max_new_tokens=32", "max_batch_size=4",
                         "logits=[repetition_penalty,frequency_penalty]",
                         "logits.repetition_penalty.penalty=1.0", "logits.frequency_penalty.value=0")
    own = {"repetition_penalty": 1.5, "frequency_penalty": 0.8}
    mixed = base.generate(PROMPTS, sampling=[own, None, None, own])
    tuned = make_pipeline("proposer=none", "max_new_tokens=32",
                          "logits=[repetition_penalty,frequency_penalty]",
                          "logits.repetition_penalty.penalty=1.5",
                          "logits.frequency_penalty.value=0.8").generate(PROMPTS)
    plain = make_pipeline("proposer=none", "max_new_tokens=32").generate(PROMPTS)
    assert [mixed[i].token_ids for i in (0, 3)] == [tuned[i].token_ids for i in (0, 3)]
    assert [mixed[i].token_ids for i in (1, 2)] == [plain[i].token_ids for i in (1, 2)]
    assert mixed[0].token_ids != plain[0].token_ids or mixed[3].token_ids != plain[3].token_ids
    with pytest.raises(InputError, match="presence_penalty=3.0 needs the presence_penalty"):
        base.generate("a", sampling={"presence_penalty": 3.0})
    with pytest.raises(InputError, match=r"frequency_penalty.value=3.0 must be in \[-2, 2\]"):
        base.generate("a", sampling={"frequency_penalty": 3.0})
