"""The transformers backend on tiny models: exact against HF generate, speculation exact, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from specflow.experiments.chi_square import independence

from specflow import ConfigError, InputError, Pipeline, hookimpl

PROMPTS = ["def fib(n):\n    ", "import os", "class Stack:\n    def __init__(self):\n        self",
           "x", "for i in range(10):\n", "return {", "# utilities for json", "with open(path) as f:"]


def pipeline(models, *overrides, target="llama", draft="llama_draft", **kw):
    return Pipeline.from_config(["model=hf", f"model.path={models[target]}", "draft=hf",
                                 f"draft.path={models[draft]}", "max_batch_size=8", *overrides],
                                **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "gpt_neox"])
def test_plain_decoding_equals_hf_generate(hf_models, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pipe = Pipeline.from_config(["model=hf", f"model.path={hf_models[arch]}", "draft=none",
                                 "proposer=none", "model.forward=hf"])
    model = AutoModelForCausalLM.from_pretrained(hf_models[arch], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(hf_models[arch])
    for prompt in PROMPTS[:3]:
        ids = tok(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        got = pipe.generate([prompt], max_new_tokens=24, max_batch_size=1)[0]
        assert got.token_ids == expected[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama_bias"])
def test_lean_forward_matches_transformers(hf_models, arch):
    from specflow.backends.hf.backend import HFBackend, HFModelConfig

    backends = [HFBackend(HFModelConfig(path=str(hf_models[arch]), forward=f), torch.device("cpu"), 2)
                for f in ("hf", "lean")]
    assert backends[0].lean is None and backends[1].lean is not None
    ids = torch.tensor([[5, 17, 42, 99, 7, 3], [8, 9, 10, 11, -1, -1]])
    lens = torch.tensor([6, 4])
    outs = []
    for b in backends:
        b.reset(0)
        b.reset(1)
        first = b.forward(torch.tensor([0, 1]), ids, lens)
        b.truncate(torch.tensor([0, 1]), [3, 4])                       # roll back row 0
        second = b.forward(torch.tensor([0, 1]), torch.tensor([[1, 2], [3, -1]]), torch.tensor([2, 1]))
        outs.append((first, second))
    for (a, b), valid in zip(zip(*outs), ([6, 4], [2, 1])):
        for row, n in enumerate(valid):       # padded positions are garbage in both
            assert torch.allclose(a[row, :n], b[row, :n], atol=1e-4, rtol=1e-4)


def test_draft_with_a_padded_vocabulary_samples_in_the_targets(hf_models):
    pipe = pipeline(hf_models, "proposer=draft", "logits=[temperature]", draft="llama_wide_vocab")
    assert pipe.draft.vocab_size == pipe.target.vocab_size + 64
    out = pipe.generate(PROMPTS[:4], max_new_tokens=24)
    assert all(t < pipe.target.vocab_size for r in out for t in r.token_ids)
    assert pipe.last_stats["alpha"] > 0.3


def test_a_row_far_longer_than_its_neighbour_stays_inside_the_context(hf_models):
    # gpt2 has absolute position embeddings: a padding position past the context would crash
    plain = Pipeline.from_config(["model=hf", f"model.path={hf_models['gpt2']}", "draft=none",
                                  "proposer=none"])
    long_prompt = "x " * 120
    n = len(plain.tokenizer.encode(long_prompt))
    pipe = Pipeline.from_config(["model=hf", f"model.path={hf_models['gpt2']}", "draft=none",
                                 "proposer=ngram", "proposer.k=6"])
    limit = pipe.target.max_length
    got = pipe.generate([long_prompt, "x y x y x y x y"], max_new_tokens=limit)
    assert len(got[0].token_ids) == limit - n and got[0].finish_reason == "length"
    expected = [plain.generate([p], max_new_tokens=limit)[0].token_ids
                for p in (long_prompt, "x y x y x y x y")]
    assert [r.token_ids for r in got] == expected


def test_draft_with_a_shorter_context_than_the_target(hf_models):
    pipe = pipeline(hf_models, "proposer=draft", draft="llama_short")     # draft context 48
    plain = pipeline(hf_models, "proposer=none")
    got = pipe.generate(PROMPTS[:2], max_new_tokens=80)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain.generate(PROMPTS[:2],
                                                                              max_new_tokens=80)]
    # the record says why those rounds ran without drafts (no silent fallback)
    assert pipe.last_stats["rounds_without_drafts"].get("draft context full", 0) > 0
    assert all(r.stats["speculation"] == "partly" for r in got)
    assert {r.stats["speculation_off_reason"] for r in got} <= {"draft context full", "length cap"}


def test_lean_forward_is_refused_where_it_cannot_compute_the_same(hf_models):
    with pytest.raises(ConfigError, match="model.forward=lean does not support.*gpt2"):
        Pipeline.from_config(["model=hf", f"model.path={hf_models['gpt2']}", "model.forward=lean",
                              "draft=none", "proposer=ngram"])


def _stop_token(results):
    """A token that some rows emit early and others late or never: rows end at different times."""
    counts = {}
    for r in results:
        for pos, t in enumerate(r.token_ids[:20]):
            counts.setdefault(t, []).append(pos)
    return max(counts, key=lambda t: (len(set(counts[t])) > 1, -min(counts[t])))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_speculation_equals_greedy_plain(hf_models, proposer, batch):
    free = pipeline(hf_models, "proposer=none").generate(PROMPTS, max_new_tokens=32)
    stop_id = _stop_token(free)
    pipe = pipeline(hf_models, f"proposer={proposer}", f"stop.token_ids=[{stop_id}]")
    plain_stop = pipeline(hf_models, "proposer=none", f"stop.token_ids=[{stop_id}]")
    expected = [plain_stop.generate([p], max_new_tokens=32, max_batch_size=1)[0] for p in PROMPTS]
    got = pipe.generate(PROMPTS, max_new_tokens=32, max_batch_size=batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert len({len(r.token_ids) for r in got}) > 2             # rows finished at different times
    assert "stop" in {r.finish_reason for r in got} and len({r.finish_reason for r in got}) >= 2
    assert pipe.last_stats["num_draft_tokens"] > 0


def test_draft_identical_to_target_accepts_every_draft(hf_models):
    pipe = pipeline(hf_models, "proposer=draft", draft="llama")
    pipe.generate(PROMPTS, max_new_tokens=40)
    s = pipe.last_stats
    assert s["alpha"] == 1.0 and s["num_examined_draft_tokens"] > 100


def test_draft_cache_that_keeps_rejected_tokens_lowers_acceptance(hf_models, monkeypatch):
    from fake_plugins import leak_draft_cache

    alphas = []
    for fault in (False, True):
        if fault:
            leak_draft_cache(monkeypatch)
        pipe = pipeline(hf_models, "proposer=draft")
        pipe.generate(PROMPTS, max_new_tokens=48)
        alphas.append(pipe.last_stats["alpha"])
    assert 0.3 < alphas[0] < 1.0
    assert alphas[1] < alphas[0] - 0.1


def test_caches_hold_exactly_the_committed_tokens_and_stay_bounded(hf_models):
    class Probe:
        rounds = 0

        @hookimpl(trylast=True)
        def specflow_sync_cache(self, batch, result):
            for b, slot in enumerate(batch.slots.tolist()):
                n = len(batch.token_ids[b])
                assert pipe.target.cache_length(slot) == n - 1
                # never ahead of the committed tokens; behind only by what the next draft step
                # feeds (two tokens after a fully accepted round, more after rounds without drafts)
                assert pipe.draft.cache_length(slot) <= n - 1
                if result.num_drafts[b] > 0:
                    assert pipe.draft.cache_length(slot) >= n - 2
            self.rounds += 1

    pipe = pipeline(hf_models, "proposer=draft", "proposer.k=6", "logits=[temperature]")
    pipe.register(Probe())
    pipe.generate(PROMPTS * 2, max_new_tokens=150, max_batch_size=4)
    capacity = pipe.target.cache.keys[0].shape[2]
    longest = max(len(pipe.tokenizer.encode(p)) for p in PROMPTS) + 150
    assert capacity <= 2 * (longest + 7)       # grows with the longest row, not with rejections


@pytest.mark.slow
def test_sampling_distribution_is_unchanged_by_speculation(hf_models):
    """Histograms of the first two tokens, with and without speculation (chi-square)."""
    def histogram(proposer, seed):
        pipe = pipeline(hf_models, f"proposer={proposer}", "logits=[temperature]",
                        "logits.temperature.value=0.3", "max_batch_size=64")
        res = pipe.generate(["def"] * 3000, max_new_tokens=2, seed=seed)
        pairs = [tuple(r.token_ids) for r in res]
        return pairs, pipe.last_stats

    spec, s = histogram("draft", 0)
    plain, _ = histogram("none", 10_000)
    assert s["num_accepted_tokens"] > 300
    keys = sorted(set(spec) | set(plain))
    table = np.array([[spec.count(k) for k in keys], [plain.count(k) for k in keys]])
    table = table[:, table.sum(0) >= 10]
    assert table.shape[1] >= 5
    assert independence(table).pvalue > 1e-3


# --- bad input ---------------------------------------------------------------------------------

def test_tokenizer_mismatch_names_both_models(hf_models):
    with pytest.raises(ConfigError, match=r"draft '.*other_tok'.*target '.*llama'.*vocabulary"):
        pipeline(hf_models, "proposer=draft", draft="other_tokenizer")


def test_recurrent_models_are_refused(hf_models):
    with pytest.raises(ConfigError, match="model_type=mamba.*cannot be rolled back"):
        pipeline(hf_models, "proposer=draft", target="mamba")


def test_missing_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory; set model.path"):
        Pipeline.from_config(["model=hf", f"model.path={tmp_path}/nope", "draft=none",
                              "proposer=ngram"])


def test_prompt_longer_than_the_context(hf_models):
    pipe = pipeline(hf_models, "proposer=ngram", target="llama_short", draft="llama_short")
    with pytest.raises(InputError, match="the model's context is 48"):
        pipe.generate(["x " * 60])


def test_generation_stops_at_the_context_with_length(hf_models):
    pipe = pipeline(hf_models, "proposer=draft", target="llama_short", draft="llama_short")
    prompt = "x " * 20
    n_prompt = len(pipe.tokenizer.encode(prompt))
    r = pipe.generate([prompt], max_new_tokens=500)[0]
    assert r.finish_reason == "length" and n_prompt + len(r.token_ids) == 48


def test_k_larger_than_the_context_is_refused(hf_models):
    with pytest.raises(ConfigError, match="proposer.k=60.*48"):
        pipeline(hf_models, "proposer=ngram", "proposer.k=60", target="llama_short",
                 draft="llama_short")
