"""ngram_draft: the longest matching suffix, its most recent earlier occurrence, up to k tokens."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specflow import ngram_draft
from specflow.stages.proposers.ngram import NgramIndex, NgramProposer, NgramProposerConfig
from specflow.state import DecodeBatch, PAD


def brute_force(ids, min_n, max_n, k):
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        hits = [s for s in range(len(ids) - n) if ids[s:s + n] == suffix]
        if hits:
            s = max(hits)
            return ids[s + n:s + n + k]
    return []


@pytest.mark.parametrize("ids,kwargs,expected", [
    ([1, 2, 3, 1, 2], dict(k=5), [3, 1, 2]),                    # continuation may run into the suffix
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], dict(k=2), [9, 2]),       # longest n (3) beats the recent 2-gram
    ([5, 1, 8, 1, 9, 1], dict(k=3), [9, 1]),                   # most recent occurrence of "1"
    ([1, 2, 3, 4], dict(k=3), []),                             # no earlier occurrence
    ([7, 7, 7], dict(k=4), [7]),                               # the 2-gram [7, 7] at 0 -> one token left
    ([1, 2, 1, 2], dict(k=0), []),
    ([4, 5, 6, 4, 5], dict(min_n=3, max_n=4, k=2), []),        # only a 2-gram matches
])
def test_ngram_draft_cases(ids, kwargs, expected):
    assert ngram_draft(ids, **kwargs) == expected


def test_ngram_draft_agrees_with_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        min_n = rng.randrange(1, 3)
        max_n = rng.randrange(min_n, 5)
        k = rng.randrange(0, 6)
        assert ngram_draft(ids, min_n, max_n, k) == brute_force(ids, min_n, max_n, k)


def test_index_agrees_with_the_rule_as_tokens_arrive():
    rng = random.Random(1)
    for _ in range(100):
        min_n = rng.randrange(1, 3)
        max_n = rng.randrange(min_n, 5)
        index = NgramIndex(min_n, max_n)
        ids: list[int] = []
        while len(ids) < 60:
            chunk = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
            ids += chunk
            index.extend(chunk)
            k = rng.randrange(0, 6)
            assert index.propose(k) == ngram_draft(ids, min_n, max_n, k)


def test_proposer_pads_ragged_rows():
    batch = DecodeBatch.make_dummy(batch_size=3)
    prop = NgramProposer(NgramProposerConfig(k=3))
    for slot, ids in enumerate([[1, 2, 3, 1, 2], [4, 5, 6], [1, 1, 1, 1]]):
        prop.specflow_request_start(slot=slot, request=SimpleNamespace(prompt_ids=ids))
    prop = prop.specflow_propose(batch, torch.tensor([3, 3, 1]))
    assert prop.draft_token_ids.tolist() == [[3, 1, 2], [PAD, PAD, PAD], [1, PAD, PAD]]
    assert prop.draft_probs is None
