"""The round loop on the synthetic pair: hooks, exactness invariants, batching, metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from specflow.experiments.chi_square import goodness_of_fit, independence

from specflow import hookimpl
from specflow.hookspecs import STAGE_HOOKS

PROMPTS = ["a", "def fib(n):", "x = 1\ny = 2\n", "import os", "q", "class A:", "return x + y",
           "# note"]
EOS = ["model.eos_token_id=0"]           # "\n" ends a sequence: rows finish at different times


class Tracer:
    """A wrapper=True tracing plugin: sees every stage call, round by round."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []
        self.round = 0

    def _wrap(name):
        @hookimpl(wrapper=True)
        def impl(self, **kwargs):
            self.calls.append((self.round, name))
            return (yield)
        impl.__name__ = name
        return impl

    for _name in STAGE_HOOKS:
        locals()[_name] = _wrap(_name)
    del _name, _wrap

    @hookimpl
    def specflow_round_end(self, result, pipeline):
        self.round += 1


def test_tracing_wrapper_sees_every_stage_of_every_round(make_pipeline):
    tracer = Tracer()
    pipe = make_pipeline("proposer=draft", "logits=[temperature]", plugins=[tracer])
    pipe.generate(PROMPTS[:3], max_new_tokens=20)
    assert tracer.round >= 5
    for r in range(tracer.round):
        seen = {name for rr, name in tracer.calls if rr == r}
        assert seen == set(STAGE_HOOKS), f"round {r} missed {set(STAGE_HOOKS) - seen}"
    # the shaping hooks run for every draft step and once for the target
    shaped = [name for rr, name in tracer.calls if rr == 0 and name == "specflow_process_logits"]
    assert len(shaped) == pipe.cfg.proposer.k + 1


def plain_greedy(make_pipeline, prompts, max_new_tokens, extra=()):
    pipe = make_pipeline("proposer=none", *extra)
    return [pipe.generate([p], max_new_tokens=max_new_tokens, max_batch_size=1)[0] for p in prompts]


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_speculative_equals_greedy_plain(make_pipeline, proposer, batch):
    extra = [*EOS, "draft.mismatch=0.3"]
    expected = plain_greedy(make_pipeline, PROMPTS, 40, extra)
    pipe = make_pipeline(f"proposer={proposer}", "max_batch_size=8", *extra)
    got = pipe.generate(PROMPTS, max_new_tokens=40, max_batch_size=batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert {r.finish_reason for r in got} == {"eos", "length"}   # rows end at different times
    if proposer != "none":
        s = pipe.last_stats
        assert 0 < s["alpha"] < 1 and s["num_draft_tokens"] > 0   # drafts were really checked


def test_draft_identical_to_target_is_always_accepted(make_pipeline):
    pipe = make_pipeline("proposer=draft", "draft.noise=0.0", "logits=[temperature]")
    pipe.generate(PROMPTS, max_new_tokens=60)
    assert pipe.last_stats["alpha"] == 1.0
    assert pipe.last_stats["num_accepted_tokens"] == pipe.last_stats["num_examined_draft_tokens"] > 0


def test_desynchronised_draft_cache_lowers_acceptance(make_pipeline, monkeypatch):
    from fake_plugins import leak_draft_cache

    alphas = {}
    for fault in (False, True):
        if fault:
            leak_draft_cache(monkeypatch)
        pipe = make_pipeline("proposer=draft", "draft.noise=0.3", "logits=[temperature]",
                             "verifier.rule=rejection")     # whose acceptance is 1 - TV(p, q)
        pipe.generate(PROMPTS, max_new_tokens=100)
        alphas[fault] = pipe.last_stats["alpha"]
    assert alphas[False] == pytest.approx(0.86, abs=0.03)      # the pair's true acceptance
    assert alphas[True] < alphas[False] - 0.08               # conditioning on rejected tokens


def test_caches_track_the_committed_tokens(make_pipeline):
    class Probe:
        def __init__(self):
            self.checked = 0

        @hookimpl(trylast=True)
        def specflow_sync_cache(self, batch, result):
            for slot, ids in zip(batch.slots.tolist(), batch.token_ids):
                if result.finish_reasons[batch.slots.tolist().index(slot)] is None:
                    assert pipe.target.tokens(slot) == ids[:-1]
                    # the draft never holds an uncommitted token; after a fully accepted round
                    # it has not seen its own last draft yet (fed next round)
                    cached = pipe.draft.tokens(slot)
                    assert cached == ids[:len(cached)] and len(cached) >= len(ids) - 2
                    self.checked += 1

    probe = Probe()
    pipe = make_pipeline("proposer=draft", "logits=[temperature]", "draft.noise=0.5")
    pipe.register(probe)
    pipe.generate(PROMPTS, max_new_tokens=30)
    assert probe.checked > 20


def test_continuous_batching_refills_slots_and_keeps_order(make_pipeline):
    sizes = []

    class Sizes:
        @hookimpl
        def specflow_round_end(self, result, pipeline):
            sizes.append(result.batch_size)

    prompts = [f"p{i}" for i in range(10)]
    lengths = [5 + 3 * i for i in range(10)]
    pipe = make_pipeline("proposer=draft", "max_batch_size=3", plugins=[Sizes()])
    got = pipe.generate(prompts, max_new_tokens=40, stop=None)
    solo = [pipe.generate([p], max_new_tokens=40)[0] for p in prompts]
    assert [r.token_ids for r in got] == [r.token_ids for r in solo]
    assert [r.index for r in got] == list(range(10))
    assert max(sizes) == 3 and sizes[-1] < 3
    del lengths


def test_seeded_sampling_row_is_the_same_in_any_batch(make_pipeline):
    for proposer in ("draft", "ngram"):
        pipe = make_pipeline(f"proposer={proposer}", "logits=[temperature]")
        batch = pipe.generate(PROMPTS[:4], max_new_tokens=30, seed=10)
        solo = pipe.generate([PROMPTS[2]], max_new_tokens=30, seed=12)[0]
        assert batch[2].token_ids == solo.token_ids


def test_sampling_is_reproducible_and_varies_with_seed(make_pipeline):
    pipe = make_pipeline("proposer=draft", "logits=[temperature]")
    a = pipe.generate(["a"] * 3, max_new_tokens=30, seed=0)
    b = pipe.generate(["a"] * 3, max_new_tokens=30, seed=0)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) == 3


def test_metrics_count_examined_drafts_not_proposed(make_pipeline):
    pipe = make_pipeline("proposer=draft", "proposer.k=8", "logits=[temperature]", "draft.noise=0.8")
    results = pipe.generate(PROMPTS, max_new_tokens=80)
    s = pipe.last_stats
    assert s["num_examined_draft_tokens"] < s["num_draft_tokens"]
    assert s["alpha"] == pytest.approx(s["num_accepted_tokens"] / s["num_examined_draft_tokens"])
    assert s["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"])
    assert s["alpha"] > s["acceptance_rate"]
    assert sum(len(r.token_ids) for r in results) == s["num_committed_tokens"]
    assert s["mean_acceptance_length"] == pytest.approx(s["num_committed_tokens"]
                                                        / s["num_target_passes"])
    assert sum(r.stats["num_target_passes"] for r in results) == s["num_target_passes"]
    per_pos = s["acceptance_per_position"]
    assert len(per_pos) == 8 and all(0 <= a <= 1 for a in per_pos)
    # the synthetic clock charges c per draft step; rows capped near their end waste a little
    assert s["c"] == pytest.approx(0.1, rel=0.05)


def test_stop_strings_and_eos_through_the_pipeline(make_pipeline):
    pipe = make_pipeline("proposer=draft", *EOS, "draft.mismatch=0.2")
    plain = make_pipeline("proposer=none", *EOS)
    for prompt in PROMPTS:
        ref = plain.generate([prompt], max_new_tokens=60)[0]
        if len(ref.text) < 4:
            continue
        stop = ref.text[2:4]      # a stop string that appears early in the output
        got = pipe.generate([prompt], max_new_tokens=60, stop=[stop])[0]
        assert got.finish_reason == "stop"
        assert got.text == ref.text[:ref.text.index(stop)]
        assert stop not in got.text
        assert pipe.tokenizer.decode(got.token_ids) == got.text   # one char per token here


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_sampling_distribution_is_the_targets_with_and_without_speculation(make_pipeline, rule):
    """First-3-token histograms: speculative vs plain vs the exact target distribution, under
    either verifier rule."""
    small = ["model.vocab_size=6", "model.contexts=16"]
    n = 20_000

    def sample(proposer):
        k = ["proposer.k=3"] if proposer != "none" else []
        pipe = make_pipeline(f"proposer={proposer}", "logits=[temperature]", "draft.noise=0.6",
                             "max_batch_size=512", f"verifier.rule={rule}", *k, *small)
        res = pipe.generate(["a"] * n, max_new_tokens=3, seed=1 if proposer == "none" else 99_999)
        codes = np.array([r.token_ids[0] * 36 + r.token_ids[1] * 6 + r.token_ids[2] for r in res])
        return np.bincount(codes, minlength=216), pipe

    spec, pipe = sample("draft")
    plain, _ = sample("none")
    # exact probabilities from the synthetic target's tables
    target = pipe.target
    exact = np.zeros(216)
    start = target.tokenizer.encode("a")
    logp = {}
    for t1 in range(6):
        for t2 in range(6):
            for t3 in range(6):
                seq = torch.tensor([start + [t1, t2]])
                target.reset(0)
                key = (t1, t2)
                if key not in logp:
                    logp[key] = target.forward(torch.tensor([0]), seq, torch.tensor([3]))[0].softmax(-1)
                probs = logp[key]
                exact[t1 * 36 + t2 * 6 + t3] = probs[0, t1] * probs[1, t2] * probs[2, t3]
    assert exact.sum() == pytest.approx(1.0, abs=1e-5)
    keep = exact * n >= 5
    for counts in (spec, plain):
        chi = goodness_of_fit(counts[keep], exact[keep] / exact[keep].sum() * counts[keep].sum())
        assert chi.pvalue > 1e-3
    table = np.stack([spec, plain])[:, (spec + plain) >= 10]
    assert independence(table).pvalue > 1e-3


@pytest.mark.parametrize("prompts,kwargs,message", [
    ([], {}, "no prompts given"),
    (["ok", ""], {}, "prompt 1 is empty"),
    (["ok"], {"max_new_tokens": 0}, "max_new_tokens=0"),
    (["ok"], {"stop": ["\n", ""]}, "stop string is empty"),
    (["ok"], {"max_batch_size": 99}, "exceeds the pipeline's 8 slots"),
])
def test_bad_generate_arguments_are_one_clear_error(make_pipeline, prompts, kwargs, message):
    from specflow import InputError

    with pytest.raises(InputError, match=message):
        make_pipeline().generate(prompts, **kwargs)
