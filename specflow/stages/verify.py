"""The verifier: which draft tokens the target keeps (docs/design.md §1).

Glossary (Leviathan et al. 2023, Chen et al. 2023), per row, with p the target's shaped
distributions at the K+1 positions and q the proposer's at the K drafted ones:
- accepted:  draft x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), left to right;
             the first rejection ends the round (greedy: kept iff x_i == argmax p_i).
- recovered: at the first rejection j, a token from norm(max(0, p_j - q_j)) (greedy: argmax p_j).
- bonus:     when all k drafts are accepted, a token from p_{k+1} (greedy: argmax p_{k+1}).
Every committed token is then distributed exactly as under plain sampling from p.

Randomness: `generator` may be one torch.Generator for the batch, or a list with one per row. With
a list, row b consumes exactly k_b uniforms and V exponentials from its own generator, so a seeded
request gets the same tokens whatever batch it shares (the per-row draws are the only loop).

The pipeline's verifier stage (`StandardVerifier`, stages/verifier.py) uses this rule under `verifier.rule=rejection`.
Its default, `rule=coupled`, keys every draw to (seed, position) instead (`specflow.stages.sampling`):
the token committed at a position is the one plain sampling draws there, drafts are sampled with
the same draws, and a draft is accepted when it is that token. That is exact by construction and
makes a seeded request's tokens independent of the draft length; a deterministic proposer (n-gram,
token trees of fixed children) keeps exactly its acceptance under rejection sampling, p(x), while
a sampled draft model accepts P(argmax q/E = argmax p/E) >= (1 - TV) / (1 + TV) of the time
against rejection sampling's 1 - TV (Daliri et al. 2024, "Coupling without communication and
drafter-invariant speculative decoding").
"""
from __future__ import annotations


import torch

from specflow.backends.lean.native import argmax
from specflow.stages.sampling import Generators, row_uniforms, sample_categorical
from specflow.state import PAD

def verify(draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
           draft_probs: torch.Tensor | None = None, greedy: bool = False,
           generator: Generators = None, num_drafts: list[int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and append the recovered or bonus token.

    draft_token_ids: [B, K] long, PAD (-1) after a row's own k drafts
    target_probs:    [B, K+1, V] float, the target's shaped distributions (probabilities)
    draft_probs:     [B, K, V] float or None (None: deterministic proposer, q one-hot on the draft)
    num_drafts:      [B] drafts per row, when the caller already has them on the host (saves a
                     device read with per-row generators)
    returns (out_token_ids [B, K+1] long, PAD-padded; num_accepted [B] long)
    """
    B, K = draft_token_ids.shape
    if target_probs.shape[:2] != (B, K + 1):
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}; expected "
                         f"[{B}, {K + 1}, V] for draft_token_ids of shape [{B}, {K}]")
    device = target_probs.device
    draft_token_ids = draft_token_ids.to(device)     # proposers may build drafts elsewhere
    if draft_probs is not None:
        draft_probs = draft_probs.to(device)
    if K == 0:   # plain decoding: the bonus token only
        p0 = target_probs[:, 0]                                                # [B, V]
        final = argmax(p0) if greedy else sample_categorical(p0, generator)
        return final[:, None], torch.zeros(B, dtype=torch.long, device=device)
    if greedy and device.type == "cpu":
        return _greedy_on_host(draft_token_ids, argmax(target_probs))
    rows = torch.arange(B, device=device)                                      # [B]
    valid = draft_token_ids != PAD                                             # [B, K]
    k = valid.sum(-1)                                                          # [B]
    safe_ids = draft_token_ids.clamp(min=0)                                    # [B, K] PAD never indexes

    if greedy:
        target_argmax = argmax(target_probs)                                   # [B, K+1]
        accept = (safe_ids == target_argmax[:, :K]) & valid                    # [B, K]
    else:
        p_draft = target_probs[:, :K].gather(-1, safe_ids[..., None]).squeeze(-1)   # [B, K]
        if draft_probs is None:
            q_draft = torch.ones_like(p_draft)                                 # one-hot q
        else:
            q_draft = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, K]
        if num_drafts is None and not (generator is None or isinstance(generator, torch.Generator)):
            num_drafts = k.tolist()
        u = row_uniforms((B, K), num_drafts, generator, device)               # [B, K]
        accept = (u * q_draft < p_draft) & valid       # u < min(1, p/q) without dividing by q

    # accepted is a prefix: count leading ones
    num_accepted = accept.long().cumprod(-1).sum(-1)                           # [B]
    rejected = num_accepted < k                                                # [B]
    final_pos = num_accepted                                                   # [B] in [0, K]

    if greedy:
        final = target_argmax[rows, final_pos]                                 # [B]
    else:
        p_final = target_probs[rows, final_pos]                                # [B, V]
        q_pos = final_pos.clamp(max=K - 1)                                     # [B] (K >= 1 here)
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final[rows, safe_ids[rows, q_pos]] = 1.0                         # one-hot on x_j
        else:
            q_final = draft_probs[rows, q_pos]                                 # [B, V]
        residual = torch.where(rejected[:, None], (p_final - q_final).clamp(min=0), p_final)
        # a zero residual means rejection had probability 0 (p == q up to rounding): any valid
        # token keeps the distribution; p itself is the natural one
        empty = residual.sum(-1, keepdim=True) <= 0                            # [B, 1]
        residual = torch.where(empty, p_final, residual)                       # [B, V]
        final = sample_categorical(residual, generator)                        # [B]

    positions = torch.arange(K + 1, device=device)[None, :]                    # [1, K+1]
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), PAD)], 1)
    out = torch.where(positions < num_accepted[:, None], padded_drafts,
                      torch.full_like(padded_drafts, PAD))                     # [B, K+1]
    out[rows, final_pos] = final
    return out, num_accepted


def _greedy_on_host(draft_token_ids: torch.Tensor, best: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of CPU tensors, as verify() computes it on a device, read into lists:
    a round's few rows cost ~15 small torch ops there (~0.18 ms), a few microseconds here.
    draft_token_ids [B, K] (PAD-padded), best [B, K+1] the target's argmax at each position."""
    drafts, top = draft_token_ids.tolist(), best.tolist()                      # cpu only
    K = draft_token_ids.shape[1]
    out, accepted = [], []
    for row, want in zip(drafts, top):
        n = 0
        while n < K and row[n] != PAD and row[n] == want[n]:    # the accepted prefix
            n += 1
        out.append(row[:n] + [want[n]] + [PAD] * (K - n))
        accepted.append(n)
    return (torch.tensor(out, dtype=torch.long).view(len(out), K + 1),         # [B, K+1]
            torch.tensor(accepted, dtype=torch.long))                           # [B]

