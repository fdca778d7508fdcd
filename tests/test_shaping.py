"""One shaping call for draft and target: identical prefixes and processors, exact outputs."""
from __future__ import annotations

import numpy as np
import pytest
from specflow.experiments.chi_square import independence

from specflow import Pipeline, hookimpl
from specflow.experiments.workloads import read_prompt_file
from specflow.backends.hf.backend import DEMO_DIR

PROMPTS = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"))[:4]
GREEDY_PROCESSORS = ["repetition_penalty", "frequency_penalty", "presence_penalty",
                     "min_new_tokens", "no_repeat_ngram", "bad_words", "logit_bias", "hf"]


class ShapingRecorder:
    """Records (source, request, prefix, processors applied) for every shaped position."""

    def __init__(self):
        self.seen = {"draft": set(), "target": set()}

    @hookimpl(wrapper=True)
    def specflow_process_logits(self, shaping):
        chain = []
        for impl in reversed(self.pm.hook.specflow_process_logits.get_hookimpls()):
            if impl.plugin is not self:
                chain.append(impl.plugin_name)
        result = yield
        for b, rid in enumerate(shaping.request_ids):
            for p in range(shaping.num_positions):
                self.seen[shaping.source].add((rid, tuple(shaping.prefix(b, p)), tuple(chain)))
        return result


def test_draft_and_target_see_the_same_prefixes_and_processors():
    rec = ShapingRecorder()
    pipe = Pipeline.from_config(["proposer=draft", "logits=[repetition_penalty,no_repeat_ngram,"
                                 "temperature,top_p]", "logits.temperature.value=0.8"])
    rec.pm = pipe.pm
    pipe.register(rec)
    pipe.generate(PROMPTS, max_new_tokens=24, seed=3)
    draft, target = rec.seen["draft"], rec.seen["target"]
    assert len(draft) > 100
    # every draft position was shaped again by the target with the same prefix and chain
    assert draft <= target
    chains = {c for _, _, c in target}
    assert chains == {("logits.repetition_penalty", "logits.no_repeat_ngram",
                       "logits.temperature", "logits.top_p")}


@pytest.mark.parametrize("processor", GREEDY_PROCESSORS)
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_greedy_equality_with_each_processor(processor, proposer):
    plain = Pipeline.from_config(["proposer=none", f"logits=[{processor}]"])
    spec = Pipeline.from_config([f"proposer={proposer}", f"logits=[{processor}]"])
    assert plain.greedy and spec.greedy
    expected = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=32)]
    got = spec.generate(PROMPTS, max_new_tokens=32, max_batch_size=3)
    assert [r.token_ids for r in got] == expected
    assert spec.last_stats["num_draft_tokens"] > 0 and "policy" not in \
        spec.last_stats["rounds_without_drafts"]          # never silently switched off


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampling_processors_at_temperature_zero_stay_greedy_and_take_request_temperatures(
        proposer):
    """temperature 0 with a temperature processor: greedy by default (and exact), and a request
    may still ask for its own temperature; rounds shared with such a row sample, the greedy rows
    one-hot, so they stay greedy token for token."""
    over = ["logits=[temperature,top_k,top_p,min_p]", "logits.temperature.value=0"]
    plain = Pipeline.from_config(["proposer=none"])
    spec = Pipeline.from_config([f"proposer={proposer}", *over])
    assert spec.greedy and spec.samples_on_request
    plain_out = plain.generate(PROMPTS, max_new_tokens=24, logprobs=2)
    greedy = [r.token_ids for r in plain_out]
    spec_out = spec.generate(PROMPTS, max_new_tokens=24, logprobs=2)
    assert [r.token_ids for r in spec_out] == greedy
    for a, b in zip(plain_out, spec_out):     # greedy rounds skip the sampling processors, the
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)      # target's as the draft's
    own = {"temperature": 0.8, "top_k": 5}
    mixed = spec.generate(PROMPTS, max_new_tokens=24, sampling=[own, None, own, None], seed=3)
    assert [mixed[1].token_ids, mixed[3].token_ids] == [greedy[1], greedy[3]]
    tuned = Pipeline.from_config([f"proposer={proposer}", "logits=[temperature,top_k,top_p,min_p]",
                                  "logits.temperature.value=0.8", "logits.top_k.k=5"])
    sampled = tuned.generate(PROMPTS, max_new_tokens=24, seed=3)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [sampled[0].token_ids, sampled[2].token_ids]
    assert [mixed[0].token_ids, mixed[2].token_ids] != [greedy[0], greedy[2]]


def test_logprobs_equal_plain_decoding_and_are_trimmed_with_the_text():
    plain = Pipeline.from_config(["proposer=none"])
    spec = Pipeline.from_config(["proposer=draft"])
    for stop in (None, ["\n"]):
        a = plain.generate(PROMPTS, max_new_tokens=24, logprobs=3, stop=stop)
        b = spec.generate(PROMPTS, max_new_tokens=24, logprobs=3, stop=stop)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert len(y.logprobs) == len(y.token_ids) == len(y.top_logprobs)
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-4)
            for tok, lp, top in zip(y.token_ids, y.logprobs, y.top_logprobs):
                assert tok in top and abs(top[tok] - lp) < 1e-6    # greedy: the top token
    assert spec.generate(PROMPTS[:1], max_new_tokens=4)[0].logprobs is None


@pytest.mark.slow
def test_sampling_with_temperature_top_p_and_repetition_penalty_keeps_the_distribution():
    over = ["logits=[repetition_penalty,temperature,top_p]", "logits.temperature.value=0.7",
            "logits.top_p.p=0.9", "logits.repetition_penalty.penalty=1.3", "max_batch_size=64"]
    prompt = "class"
    n = 12_000

    def sample(proposer, seed):
        pipe = Pipeline.from_config([f"proposer={proposer}", *over])
        res = pipe.generate([prompt] * n, max_new_tokens=2, seed=seed)
        return [r.token_ids for r in res], pipe.last_stats

    spec, s = sample("draft", 0)
    plain, _ = sample("none", 50_000)
    assert s["num_accepted_tokens"] > 300
    for pos in (0, 1):
        a = [t[pos] for t in spec]
        b = [t[pos] for t in plain]
        keys = sorted(set(a) | set(b))
        table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
        table = table[:, table.sum(0) >= 10]
        assert table.shape[1] >= 3
        assert independence(table).pvalue > 1e-3, f"token {pos + 1} histograms differ"
