"""Exact verification of token trees (docs/trees.md).

Greedy: the longest root-to-node path whose every token equals the target's argmax after its
parent; then the target's argmax after the path's last node.

Sampling: multi-draft rejection sampling (SpecInfer's multi-step speculative sampling, Miao et
al. 2023; recursive rejection sampling, Jeon et al. 2024). At the current node with target
distribution p, its children are tried in order against a running residual r (r = p first): child
x with draft distribution q is accepted with probability min(1, r(x) / q(x)); on acceptance the
walk moves to the child, else r becomes norm(max(0, r - q)) and the next child is tried. When
every child is rejected (or the node is a leaf) the round ends with one token sampled from r.
This commits tokens distributed exactly as plain sampling from p, provided each node's children
are drawn independently from its q given the path (i.i.d. samples of the parent's draft
distribution, or fixed tokens: q = None, one-hot on each child, which is SGLang's
target-only tree sampling). Siblings may repeat a token: after a rejection r(x) = 0, so the
repeat is rejected with certainty and r stays as it is.

Randomness: row b draws one uniform per node (n_b in all) and then V exponentials for its final
token from its own generator, so a seeded request gets the same tokens whatever batch it shares.
"""
from __future__ import annotations

import torch

from specflow.backends.lean.native import argmax as last_argmax
from specflow.stages.tree import TreeLayout, tree_layout
from specflow.stages.sampling import Generators, row_uniforms, sample_categorical
from specflow.state import PAD


def verify_tree(draft_token_ids: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                draft_probs: torch.Tensor | None = None, greedy: bool = False,
                generator: Generators = None, layout: TreeLayout | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept one root-to-node path of each row's tree and append the recovered or bonus token.

    draft_token_ids: [B, N] long, each row's nodes first, PAD after
    parents:         [B, N] long, -1 = a child of the root (the last committed token), else the
                     index of an earlier node of the row
    target_probs:    [B, N+1, V] the target's shaped distributions (probabilities; greedy reads
                     only the argmax): position 0 after the committed prefix, i + 1 after node i
    draft_probs:     [B, N, V] the q each node's token was drawn from (siblings share their
                     parent's q), or None for fixed tokens (one-hot q)
    layout:          the host layout of these trees, when the caller has it
    returns (out_token_ids [B, N+1] long: the accepted path's tokens, then the recovered or
             bonus token, then PAD; num_accepted [B] long; path [B, N] long: the accepted nodes'
             indices, PAD after)
    """
    B, N = draft_token_ids.shape
    if target_probs.shape[:2] != (B, N + 1):
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}; expected "
                         f"[{B}, {N + 1}, V] for a tree of {N} nodes per row")
    device = target_probs.device
    host_ids, host_parents = draft_token_ids.cpu(), parents.cpu()
    if layout is None:
        counts = (host_ids != PAD).sum(-1).tolist()
        layout = tree_layout(host_parents, counts)
    counts = layout.num_nodes
    ids = draft_token_ids.to(device).clamp(min=0)                                   # [B, N]
    children = layout.children.to(device)                                           # [B, N+1, M]
    M = children.shape[-1]
    rows = torch.arange(B, device=device)                                           # [B]
    current = torch.full((B,), -1, dtype=torch.long, device=device)                 # node, -1 root
    going = torch.ones(B, dtype=torch.bool, device=device)                          # still walking
    path = torch.full((B, N), PAD, dtype=torch.long, device=device)                 # [B, N]
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)                  # [B]
    if greedy:
        argmax = last_argmax(target_probs)                                          # [B, N+1]
        for d in range(layout.max_depth):
            kids = children[rows, current + 1]                                      # [B, M]
            want = argmax[rows, current + 1]                                        # [B]
            match = (kids >= 0) & (ids.gather(1, kids.clamp(min=0)) == want[:, None]) \
                & going[:, None]                                                    # [B, M]
            found = match.any(-1)                                                   # [B]
            first = match.float().argmax(-1)                                        # [B] first match
            nxt = kids[rows, first]                                                 # [B]
            path[:, d] = torch.where(found, nxt, path[:, d])
            current = torch.where(found, nxt, current)
            num_accepted += found.long()
            going &= found
        final = argmax[rows, current + 1]                                           # [B]
    else:
        u = row_uniforms((B, N), counts, generator, device)                        # [B, N]
        final_dist = torch.zeros(B, target_probs.shape[-1], device=device)          # [B, V]
        for d in range(layout.max_depth + 1):
            r = target_probs[rows, current + 1].clone()                             # [B, V]
            moved = torch.zeros(B, dtype=torch.bool, device=device)
            for m in range(M if d < layout.max_depth else 0):
                c = children[rows, current + 1, m]                                  # [B]
                live = going & ~moved & (c >= 0)                                    # [B]
                cs = c.clamp(min=0)
                x = ids[rows, cs]                                                   # [B]
                if draft_probs is None:
                    q = torch.zeros_like(r)
                    q[rows, x] = 1.0                                                # one-hot
                else:
                    q = draft_probs[rows, cs].to(r.dtype)                           # [B, V]
                total = r.sum(-1)                                                   # [B] (r unnormalised)
                accept = live & (u[rows, cs] * q[rows, x] * total < r[rows, x])     # u < r(x)/(Z q(x))
                path[:, d] = torch.where(accept, c, path[:, d])
                current = torch.where(accept, c, current)
                num_accepted += accept.long()
                moved |= accept
                rejected = live & ~accept
                rest = (r / total.clamp_min(1e-30)[:, None] - q).clamp(min=0)       # [B, V]
                # a residual with no mass: rejection had probability 0; keep r (any choice is exact)
                keep = rest.sum(-1) <= 0
                r = torch.where((rejected & ~keep)[:, None], rest, r)
            stop = going & ~moved                                                   # [B]
            final_dist = torch.where(stop[:, None], r, final_dist)
            going &= moved
        final = sample_categorical(final_dist, generator)                           # [B]
    out = torch.full((B, N + 1), PAD, dtype=torch.long, device=device)              # [B, N+1]
    taken = path >= 0                                                               # [B, N]
    out[:, :N] = torch.where(taken, ids.gather(1, path.clamp(min=0)), out[:, :N])
    out[rows, num_accepted] = final
    return out, num_accepted, path
