"""Property tests (hypothesis) for n-gram lookup: NgramIndex fed in chunks == ngram_draft == brute force."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specflow import ngram_draft
from specflow.stages.proposers.ngram import NgramIndex, NgramProposer, NgramProposerConfig
from specflow.state import PAD, DecodeBatch

SETTINGS = settings(max_examples=200, deadline=None)


def reference(ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule by enumeration: every (n, end) with ids[end-n+1 : end+1] == the last n tokens and
    end < len-1; the largest n wins, then the largest end; propose what followed, up to k tokens."""
    L = len(ids)
    if k <= 0:
        return []
    matches = [(n, end)
               for n in range(min_n, max_n + 1)
               for end in range(n - 1, L - 1)
               if ids[end - n + 1:end + 1] == ids[L - n:]]
    if not matches:
        return []
    n, end = max(matches)
    return ids[end + 1:end + 1 + k]


params = st.integers(1, 4).flatmap(
    lambda lo: st.tuples(st.just(lo), st.integers(lo, 6)))             # (min_n, max_n)
streams = st.lists(st.integers(0, 3), max_size=40)


@SETTINGS
@given(streams, params, st.integers(0, 7))
def test_ngram_draft_equals_the_enumerated_rule(ids, nn, k):
    min_n, max_n = nn
    assert ngram_draft(ids, min_n, max_n, k) == reference(ids, min_n, max_n, k)


@SETTINGS
@given(st.integers(1, 4).flatmap(
           lambda a: st.lists(st.lists(st.integers(0, a - 1), max_size=6), max_size=12)),
       params, st.lists(st.integers(0, 7), min_size=12, max_size=12))
def test_index_fed_in_chunks_agrees_after_every_chunk(chunks, nn, ks):
    min_n, max_n = nn
    index = NgramIndex(min_n, max_n)
    ids: list[int] = []
    for chunk, k in zip(chunks, ks):
        index.extend(chunk)
        ids += chunk
        assert index.tokens == ids
        got = index.propose(k)
        assert got == ngram_draft(ids, min_n, max_n, k) == reference(ids, min_n, max_n, k)
        # what the rule means: at most k tokens that followed an earlier copy of the suffix
        assert len(got) <= k
        if got:
            n = next(n for n in range(max_n, min_n - 1, -1) if n < len(ids)
                     and any(ids[s:s + n] == ids[len(ids) - n:] and ids[s + n:s + n + len(got)] == got
                             for s in range(len(ids) - n)))
            assert min_n <= n <= max_n


@SETTINGS
@given(streams, params, st.integers(0, 40), st.integers(0, 7))
def test_chunking_does_not_matter(ids, nn, split, k):
    min_n, max_n = nn
    whole, parts = NgramIndex(min_n, max_n), NgramIndex(min_n, max_n)
    whole.extend(ids)
    parts.extend(ids[:split])
    parts.extend([])
    parts.extend(ids[split:])
    assert whole.last_end == parts.last_end
    assert whole.propose(k) == parts.propose(k)


@settings(max_examples=60, deadline=None)
@given(st.data(), params, st.integers(1, 3))
def test_proposer_after_sync_equals_a_fresh_index_and_pads_ragged_rows(data, nn, B):
    """The proposer's per-slot index, kept up to date by specflow_sync_cache over rounds of
    committed tokens, proposes what a fresh lookup over the committed tokens proposes."""
    min_n, max_n = nn
    cfg = NgramProposerConfig(k=4, min_n=min_n, max_n=max_n)
    prop = NgramProposer(cfg)
    tokens = st.integers(0, 3)
    token_ids = []
    for slot in range(B):
        prompt = data.draw(st.lists(tokens, min_size=1, max_size=12))
        prop.specflow_request_start(slot=slot, request=SimpleNamespace(prompt_ids=prompt))
        token_ids.append(list(prompt))
    batch = DecodeBatch(slots=torch.arange(B), request_ids=list(range(B)), token_ids=token_ids,
                        prompt_lens=[len(t) for t in token_ids], max_new_tokens=[99] * B,
                        generators=[None] * B, greedy=True, max_batch_size=B)
    for _ in range(data.draw(st.integers(1, 6))):
        ks = data.draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
        proposal = prop.specflow_propose(batch, torch.tensor(ks))
        drafts = proposal.draft_token_ids
        assert proposal.draft_probs is None
        for b in range(B):
            expected = ngram_draft(token_ids[b], min_n, max_n, ks[b])
            row = drafts[b].tolist() if drafts.numel() else []
            assert row[:len(expected)] == expected
            assert all(t == PAD for t in row[len(expected):])
            # commit: an accepted prefix of the drafts plus one new token
            n_acc = data.draw(st.integers(0, len(expected)))
            token_ids[b].extend(expected[:n_acc] + [data.draw(tokens)])
        prop.specflow_sync_cache(batch, None)
        for b in range(B):
            assert prop.index[b].tokens == token_ids[b]
