"""What a model must be fed before it can score a row: the committed tokens its cache lacks.

The target scorer and the draft model's proposer share these: a cache holds a prefix of a row's
committed tokens, and a pass feeds the rest (normally only the last committed token) ahead of
the round's own inputs (the drafts, for the target). The backend then turns the inputs into its
ForwardPlan (backends/plan.py).
"""
from __future__ import annotations

import time

import torch

from specflow.state import PAD


def uncached_tokens(token_ids: list[list[int]], cached: list[int]) -> list[list[int]]:
    """Each row's committed tokens a cache holding cached[b] of them lacks (at least the last:
    a cache is never ahead of the committed tokens, and one that was never rolled back, the
    fault the tests inject, still has to be fed the last committed token)."""
    return [ids[min(n, len(ids) - 1):] for ids, n in zip(token_ids, cached)]


def uncached_inputs(token_ids: list[list[int]], cached: list[int],
                    drafts: torch.Tensor | None = None, counts: list[int] | None = None):
    """A pass's inputs: each row's committed tokens not yet in a cache (at least its last one),
    then its drafts ([B, K], PAD after each row's own; on the host, or on the device with
    `counts`, each row's number of drafts, so that nothing is read), right-padded.

    -> (inputs [B, T] long, on the drafts' device; lens [B] long and last [B] long on the host:
    last is the index of each row's last committed token, whose output predicts the first
    draft; output last + j follows draft j)."""
    pending = uncached_tokens(token_ids, cached)
    K = 0 if drafts is None else drafts.shape[1]
    if all(len(p) == 1 for p in pending):   # the steady state: only the last token each
        if K and counts is not None:    # counted drafts, maybe on the device: not read
            first = torch.tensor([p[0] for p in pending], dtype=torch.long)[:, None]  # [B, 1]
            inputs = torch.cat([first.to(drafts.device), drafts], 1)                  # [B, 1+K]
        else:                           # host lists: one tensor, no cat
            drafted = drafts.tolist() if K else [[]] * len(pending)                  # [B][K]
            counts = [sum(t != PAD for t in d) for d in drafted]
            inputs = torch.tensor([[p[0]] + d for p, d in zip(pending, drafted)],
                                  dtype=torch.long).view(len(pending), 1 + K)         # [B, 1+K]
        lens = torch.tensor([n + 1 for n in counts], dtype=torch.long)                # [B]
        return inputs, lens, torch.zeros(len(pending), dtype=torch.long)
    n_pending = torch.tensor([len(p) for p in pending], dtype=torch.long)            # [B]
    if drafts is None:
        k = torch.zeros_like(n_pending)                                              # [B]
    elif counts is not None:
        k = torch.tensor(counts, dtype=torch.long)                                   # [B]
    else:
        k = (drafts != PAD).sum(-1)                                                  # [B] host
    inputs = torch.full((len(pending), int(n_pending.max()) + K), PAD, dtype=torch.long)
    for b, p in enumerate(pending):
        inputs[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    if K:      # drafts go right after each row's own pending tokens
        at = n_pending[:, None] + torch.arange(K)[None, :]                           # [B, K]
        inputs = inputs.to(drafts.device).scatter_(1, at.to(drafts.device), drafts)  # [B, P+K]
    return inputs, n_pending + k, n_pending - 1


def catch_up(model, slots: list[int], token_ids: list[list[int]], lag: int,
             hidden_layers: tuple[int, ...] = ()):
    """Rows whose cache in `model` lags their committed tokens by more than `lag` are cached up
    to their last committed token by the model's batched prefill (one call for all of them).
    -> (the seconds it took, 0.0 when no row lagged; the prefill's HiddenStates list with
    hidden_layers, else None)."""
    lagging = [(s, ids[n:-1]) for s, ids in zip(slots, token_ids)
               if len(ids) - (n := model.cache_length(s)) > lag]
    if not lagging:
        return 0.0, None
    start = time.perf_counter()
    states = model.prefill_many([s for s, _ in lagging], [ids for _, ids in lagging],
                                *([hidden_layers] if hidden_layers else []))
    return time.perf_counter() - start, states
