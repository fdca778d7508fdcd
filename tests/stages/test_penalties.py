"""Prefix-reading processors, position by position, against transformers' own processors.

Each shaped position must see its own prefix (committed tokens + the drafts before it): a version
that used the committed prefix for every position (pitfall 12 in docs/design.md) fails these tests.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                          NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor)

from specflow.stages import penalties as P
from specflow.state import PAD, ShapingBatch

V, EOS = 12, 11
CTX = SimpleNamespace(target=SimpleNamespace(vocab_size=V, eos_token_id=EOS,
                                                ends=lambda: frozenset({EOS})),
                      tokenizer=SimpleNamespace(encode=lambda w, add_special_tokens=True: [
                          int(c) for c in w.split()]))


def shaping(first_draft_index: int, positions: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    committed = [[1, 2, 3, 1, 2, 5, 6], [4, 4, 7, 8, 9]]
    prompts = [[1, 2, 3], [4, 4]]
    drafts = torch.tensor([[10, 3, 0, 2, 9], [0, 8, PAD, PAD, PAD]])[:, :first_draft_index + positions - 1]
    logits = torch.randn(2, positions, V, generator=gen) * 3
    return ShapingBatch(logits, committed, drafts, first_draft_index, [0, 1], "target"), prompts


def run(processor, batch, prompts):
    for rid, (_ids, prompt) in enumerate(zip(batch.token_ids, prompts)):
        req = SimpleNamespace(request_id=rid, prompt_ids=prompt)
        if hasattr(processor, "specflow_request_start"):
            processor.specflow_request_start(slot=rid, request=req)
    if hasattr(processor, "specflow_sync_cache"):
        processor.specflow_sync_cache(batch=SimpleNamespace(request_ids=[0, 1],
                                                            token_ids=batch.token_ids), result=None)
    before = batch.logits.clone()
    processor.specflow_process_logits(shaping=batch)
    return before, batch.logits


def reference(hf, batch, before, prompt_lens=None):
    out = torch.empty_like(before)
    for b in range(before.shape[0]):
        for p in range(before.shape[1]):
            ids = torch.tensor([batch.prefix(b, p)])
            if prompt_lens is not None:    # HF's min_new_tokens counts from the prompt length
                hf.prompt_length_to_skip = prompt_lens[b]
            out[b, p] = hf(ids, before[b, p][None].clone())[0]
    return out


@pytest.mark.parametrize("first,positions", [(0, 1), (0, 5), (2, 1), (3, 3)])
def test_repetition_penalty_matches_transformers_at_every_position(first, positions):
    batch, prompts = shaping(first, positions)
    proc = P.RepetitionPenalty(P.RepetitionPenaltyConfig(penalty=1.7), CTX)
    before, got = run(proc, batch, prompts)
    assert torch.allclose(got, reference(RepetitionPenaltyLogitsProcessor(1.7), batch, before))


@pytest.mark.parametrize("first,positions", [(0, 5), (2, 3)])
def test_no_repeat_ngram_matches_transformers_at_every_position(first, positions):
    batch, prompts = shaping(first, positions)
    proc = P.NoRepeatNgram(P.NoRepeatNgramConfig(size=2), CTX)
    before, got = run(proc, batch, prompts)
    assert torch.equal(got, reference(NoRepeatNGramLogitsProcessor(2), batch, before))
    assert torch.isinf(got).any()


@pytest.mark.parametrize("first,positions", [(0, 5), (1, 2)])
def test_bad_words_match_transformers_at_every_position(first, positions):
    batch, prompts = shaping(first, positions)
    proc = P.BadWords(P.BadWordsConfig(words=["3 1"], token_ids=[[10], [2, 9]]), CTX)
    before, got = run(proc, batch, prompts)
    hf = NoBadWordsLogitsProcessor([[3, 1], [10], [2, 9]], eos_token_id=EOS)
    assert torch.equal(got, reference(hf, batch, before))


def test_min_new_tokens_counts_drafts_as_generated_tokens():
    batch, prompts = shaping(0, 5)
    proc = P.MinNewTokens(P.MinNewTokensConfig(min_tokens=6), CTX)
    before, got = run(proc, batch, prompts)
    # row 0 has 4 generated tokens: EOS banned at positions 0-1 (generated 4, 5), allowed from 2
    assert torch.isinf(got[0, :2, EOS]).all() and not torch.isinf(got[0, 2:, EOS]).any()
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=0, min_new_tokens=6,
                                           eos_token_id=EOS)
    assert torch.equal(got, reference(hf, batch, before, prompt_lens=[len(p) for p in prompts]))


def test_frequency_and_presence_count_only_generated_tokens_and_visible_drafts():
    batch, prompts = shaping(0, 3)
    freq = P.FrequencyPenalty(P.FrequencyPenaltyConfig(value=0.5), CTX)
    before, got = run(freq, batch, prompts)
    # row 0 generated [1, 2, 5, 6]; position 2 also sees drafts 10, 3
    expected = torch.zeros(V)
    for t in [1, 2, 5, 6, 10, 3]:
        expected[t] += 0.5
    assert torch.allclose(before[0, 2] - got[0, 2], expected)
    batch, prompts = shaping(0, 3)
    pres = P.PresencePenalty(P.PresencePenaltyConfig(value=0.5), CTX)
    before, got = run(pres, batch, prompts)
    assert torch.allclose(before[0, 2] - got[0, 2], (expected > 0).float() * 0.5)


def test_logit_bias_and_its_bad_input():
    batch, prompts = shaping(0, 2)
    before, got = run(P.LogitBias(P.LogitBiasConfig(bias={3: -100.0, 4: 2.5}), CTX), batch, prompts)
    assert torch.allclose(got[..., 3], before[..., 3] - 100) and torch.allclose(
        got[..., 4], before[..., 4] + 2.5)
    from specflow import ConfigError
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        P.LogitBias(P.LogitBiasConfig(bias={99: 1.0}), CTX)


def test_counts_follow_every_committed_token_not_one_per_round():
    proc = P.RepetitionPenalty(P.RepetitionPenaltyConfig(), CTX)
    proc.specflow_request_start(slot=0, request=SimpleNamespace(request_id=7, prompt_ids=[1, 2]))
    ids = [1, 2]
    for chunk in ([3, 3, 4], [5], [3, 6, 6, 6]):          # rounds committing several tokens
        ids += chunk
        proc.specflow_sync_cache(batch=SimpleNamespace(request_ids=[7], token_ids=[ids]), result=None)
    assert proc.tokens.counts[7].tolist() == torch.bincount(torch.tensor(ids), minlength=V).float().tolist()
