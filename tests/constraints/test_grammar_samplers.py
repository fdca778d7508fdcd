"""Grammar masks with truncating samplers (top-k, top-p, min-p): masks come first, so truncation
picks among the allowed tokens and every constrained request gives grammar-valid output, with
every proposer. Before, truncation ran first, the mask then removed every survivor, the row
became NaN and id 0 (EOS) came out as an empty answer."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specflow import Pipeline

CHOICES = ("yes", "no", "maybe", "not sure")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "kind": {"enum": ["class", "function"]}},
          "required": ["name", "kind"]}
PATTERN = r"(def|class) [a-z_]{1,10}\(\):"
CONSTRAINTS = {
    "choice": ["constraint=choice", "constraint.choices=[yes,no,maybe,'not sure']"],
    "regex": ["constraint=regex", f"constraint.pattern={PATTERN}"],
    "json_schema": ["constraint=json_schema", f"constraint.schema={json.dumps(SCHEMA)}"],
}
# top-k 5 and top-p 0.5 keep a handful of the model's favourites, which are rarely allowed here
SAMPLERS = {
    "top_k": ["logits=[top_k]", "logits.top_k.k=5"],
    "top_p": ["logits=[top_p]", "logits.top_p.p=0.5"],
    "min_p": ["logits=[min_p]", "logits.min_p.p=0.3"],
    "temperature,top_k": ["logits=[temperature,top_k]", "logits.temperature.value=0.7",
                          "logits.top_k.k=3"],
}
PROMPTS = ["def parse(line):\n    # answer: ", "import os\n# as JSON:\n", "class Reader:\n    ",
           "x = 1\n# verdict: "]


def check_valid(name: str, text: str) -> None:
    if name == "choice":
        assert text in CHOICES, text
    elif name == "regex":
        assert re.fullmatch(PATTERN, text), text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)


def generate(constraint: str, sampler: str, proposer: str):
    pipe = Pipeline.from_config([f"proposer={proposer}", *CONSTRAINTS[constraint],
                                 *SAMPLERS[sampler]])
    assert not pipe.greedy
    return pipe.generate(PROMPTS, max_new_tokens=48, seed=3)


FAST = [(c, "top_k", p) for c in CONSTRAINTS for p in ("none", "ngram", "draft")] + \
       [("choice", s, "draft") for s in SAMPLERS if s != "top_k"]
SLOW = [(c, s, p) for c in CONSTRAINTS for s in SAMPLERS for p in ("none", "ngram", "draft")
        if (c, s, p) not in FAST]


@pytest.mark.parametrize("constraint,sampler,proposer",
                         FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in SLOW])
def test_constrained_sampling_gives_valid_output(constraint, sampler, proposer):
    for r in generate(constraint, sampler, proposer):
        assert r.finish_reason == "eos", (r.text, r.finish_reason)
        check_valid(constraint, r.text)


@pytest.mark.slow
def test_constrained_top_k_keeps_the_distribution_under_speculation():
    """The answer's distribution with a grammar and top-k is the same with and without drafts
    (chi-square on 240 answers per arm)."""
    from specflow.experiments.chi_square import independence

    prompts = ["def parse(line):\n    # answer: "] * 240
    counts = {}
    for proposer in ("none", "draft", "ngram"):
        pipe = Pipeline.from_config([f"proposer={proposer}", *CONSTRAINTS["choice"],
                                     "logits=[top_k]", "logits.top_k.k=2", "max_batch_size=16"])
        texts = [r.text for r in pipe.generate(prompts, max_new_tokens=8, seed=11)]
        counts[proposer] = [texts.count(c) for c in CHOICES]
    table = [[n + 1 for n in row] for row in counts.values()]
    assert independence(table).pvalue > 1e-3, counts
    assert all(sum(row) == 240 for row in counts.values())
