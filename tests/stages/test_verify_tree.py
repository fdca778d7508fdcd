"""Tree verification: exact greedy paths, lossless multi-draft rejection sampling (NumPy reference
and chi-square tests), chains equal to specflow.verify token for token."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from specflow.experiments.chi_square import goodness_of_fit

from specflow import verify, verify_tree
from specflow.stages.tree import chain_parents, check_parents, tree_layout
from specflow.state import PAD

V = 5


# --- a NumPy reference ------------------------------------------------------------------------

def reference_verify_tree(tokens, parents, p, q, rng, greedy=False):
    """One row. tokens/parents: lists over nodes; p: [N+1, V] target distributions (0 = after the
    committed prefix, i + 1 = after node i); q: [N, V] per node, or None (fixed tokens).
    -> committed tokens (the accepted path, then the final token)."""
    kids = {-1: []}
    for i, par in enumerate(parents):
        kids.setdefault(par, []).append(i)
        kids.setdefault(i, [])
    out, node = [], -1
    while True:
        dist = np.asarray(p[node + 1], dtype=np.float64)
        if greedy:
            want = int(dist.argmax())
            nxt = next((c for c in kids[node] if tokens[c] == want), None)
            if nxt is None:
                return out + [want]
            out.append(tokens[nxt])
            node = nxt
            continue
        r = dist / dist.sum()
        nxt = None
        for c in kids[node]:
            x = tokens[c]
            qc = np.eye(V)[x] if q is None else np.asarray(q[c], dtype=np.float64)
            if rng.random() < min(1.0, r[x] / qc[x]):
                nxt = c
                break
            rest = np.clip(r - qc, 0, None)
            if rest.sum() > 0:
                r = rest / rest.sum()
        if nxt is None:
            return out + [int(rng.choice(V, p=r))]
        out.append(x)
        node = nxt


# --- a toy target and draft: distributions depend on the last two tokens ------------------------

def tables(seed):
    g = np.random.default_rng(seed)
    P = g.dirichlet(np.full(V, 0.7), size=(V + 1, V + 1))        # [prev2, prev1] -> p
    Q = 0.5 * P + 0.5 * g.dirichlet(np.full(V, 0.7), size=(V + 1, V + 1))   # a related draft
    return P, Q


def dist_after(T, context):
    a = context[-2] if len(context) > 1 else V
    b = context[-1] if context else V
    return T[a, b]


def sample_tree(g, context, Q, widths, sampled):
    """Children of the root and of each node up to len(widths) levels: widths[d] per node. With
    `sampled`, i.i.d. draws from the draft's q (tokens may repeat); else fixed tokens (repeats on
    purpose: the two likeliest, then the likeliest again)."""
    tokens, parents, q = [], [], []
    frontier = [(-1, list(context))]
    for w in widths:
        nxt = []
        for par, ctx in frontier:
            qd = dist_after(Q, ctx)
            if sampled:
                picks = [int(g.choice(V, p=qd)) for _ in range(w)]
            else:
                order = list(np.argsort(-qd))
                picks = (order[:2] + order[:1] + order[2:])[:w]
            for x in picks:
                tokens.append(int(x))
                parents.append(par)
                q.append(qd)
                nxt.append((len(tokens) - 1, ctx + [int(x)]))
        frontier = nxt
    return tokens, parents, np.array(q)


def target_rows(P, context, tokens, parents):
    ctxs = [list(context)]
    for x, par in zip(tokens, parents):
        ctxs.append(ctxs[par + 1] + [x])
    return np.array([dist_after(P, c) for c in ctxs])            # [N+1, V]


def two_tokens(verifier, P, Q, widths, sampled, n, seed):
    """The first two committed tokens of n independent sequences, a new tree each round."""
    g = np.random.default_rng(seed)
    P, Q = tables(seed)
    context0 = [1]
    firsts = verifier(P, Q, [context0] * n, widths, sampled, g)
    need = [i for i, f in enumerate(firsts) if len(f) < 2]
    more = verifier(P, Q, [context0 + firsts[i][:1] for i in need], widths, sampled, g)
    for i, m in zip(need, more):
        firsts[i] = firsts[i][:1] + m[:1]
    pairs = np.array([f[:2] for f in firsts])
    exact = np.array([[dist_after(P, context0)[a] * dist_after(P, context0 + [a])[b]
                       for b in range(V)] for a in range(V)]).ravel()
    return pairs, exact


def torch_verifier(P, Q, contexts, widths, sampled, g):
    rows = [sample_tree(g, c, Q, widths, sampled) for c in contexts]
    N = max(len(t) for t, _, _ in rows)
    B = len(rows)
    ids = torch.full((B, N), PAD)
    par = torch.full((B, N), PAD)
    q = torch.zeros(B, N, V, dtype=torch.float64)
    p = torch.zeros(B, N + 1, V, dtype=torch.float64)
    for b, ((t, pa, qq), c) in enumerate(zip(rows, contexts)):
        ids[b, :len(t)] = torch.tensor(t)
        par[b, :len(t)] = torch.tensor(pa)
        q[b, :len(t)] = torch.from_numpy(qq)
        p[b, :len(t) + 1] = torch.from_numpy(target_rows(P, c, t, pa))
    gen = torch.Generator().manual_seed(int(g.integers(1 << 30)))
    out, acc, _ = verify_tree(ids, par, p, q if sampled else None, generator=gen)
    return [row[row != PAD].tolist() for row in out]


def numpy_verifier(P, Q, contexts, widths, sampled, g):
    res = []
    for c in contexts:
        t, pa, q = sample_tree(g, c, Q, widths, sampled)
        res.append(reference_verify_tree(t, pa, target_rows(P, c, t, pa),
                                         q if sampled else None, g))
    return res


CASES = [((3, 2), True), ((4,), True), ((2, 2, 1), True), ((3, 2), False), ((4, 1), False)]


@pytest.mark.parametrize("widths,sampled", CASES)
@pytest.mark.parametrize("verifier", [torch_verifier, numpy_verifier], ids=["torch", "numpy"])
def test_the_first_two_tokens_are_distributed_as_plain_sampling(verifier, widths, sampled):
    n = 6000 if verifier is torch_verifier else 2500
    pairs, exact = two_tokens(verifier, None, None, widths, sampled, n, seed=len(widths) * 7 + 1)
    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    keep = exact * n >= 5
    expected = exact[keep] / exact[keep].sum() * counts[keep].sum()
    assert counts[~keep].sum() <= max(5, 3 * exact[~keep].sum() * n)
    assert goodness_of_fit(counts[keep], expected).pvalue > 1e-3


def test_siblings_that_repeat_a_token_are_never_both_counted():
    # root children: token 2 twice (fixed tokens); the target puts all mass on 2
    p = torch.zeros(1, 3, V)
    p[0, :, 2] = 1.0
    out, acc, path = verify_tree(torch.tensor([[2, 2]]), torch.tensor([[-1, -1]]), p,
                                 generator=torch.Generator().manual_seed(0))
    assert acc.tolist() == [1] and path[0].tolist() == [0, PAD]
    assert out[0].tolist() == [2, 2, PAD]          # the first sibling, then the bonus after it
    # the target never picks 2: both repeats are rejected, the final token avoids 2
    p = torch.full((1, 3, V), 1.0 / (V - 1))
    p[0, :, 2] = 0.0
    for seed in range(20):
        out, acc, _ = verify_tree(torch.tensor([[2, 2]]), torch.tensor([[-1, -1]]), p,
                                  generator=torch.Generator().manual_seed(seed))
        assert acc.item() == 0 and out[0, 0].item() != 2


def _random_tree(g, n):
    parents = [-1] + [int(g.integers(-1, i)) for i in range(1, n)]
    return parents


def test_greedy_takes_the_longest_matching_path_as_the_reference_does():
    g = np.random.default_rng(5)
    for _ in range(200):
        n = int(g.integers(1, 9))
        parents = _random_tree(g, n)
        tokens = [int(x) for x in g.integers(0, 3, n)]
        logits = torch.from_numpy(g.normal(size=(n + 1, 3)))
        out, acc, path = verify_tree(torch.tensor([tokens]), torch.tensor([parents]),
                                     logits[None], greedy=True)
        want = reference_verify_tree(tokens, parents, logits.softmax(-1).numpy(), None, None,
                                     greedy=True)
        assert out[0, :len(want)].tolist() == want and acc.item() == len(want) - 1
        assert (out[0, len(want):] == PAD).all()
        nodes = path[0, :acc.item()].tolist()
        assert [tokens[i] for i in nodes] == want[:-1]
        assert all(parents[b] == a for a, b in zip([-1] + nodes, nodes))


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("per_row", [True, False])
def test_a_chain_verifies_exactly_as_specflow_verify(greedy, per_row):
    g = torch.Generator().manual_seed(1)
    B, K = 6, 4
    k = [4, 0, 2, 3, 1, 4]
    ids = torch.randint(0, V, (B, K), generator=g)
    ids[torch.arange(K)[None, :] >= torch.tensor(k)[:, None]] = PAD
    p = torch.rand(B, K + 1, V, generator=g).softmax(-1)
    q = torch.rand(B, K, V, generator=g).softmax(-1)

    def gens():
        if greedy:
            return None
        return [torch.Generator().manual_seed(10 + b) for b in range(B)] if per_row \
            else torch.Generator().manual_seed(3)
    for _ in range(5):
        want, want_acc = verify(ids, p, None if greedy else q, greedy=greedy, generator=gens(),
                                num_drafts=k)
        out, acc, path = verify_tree(ids, chain_parents(k, K), p, None if greedy else q,
                                     greedy=greedy, generator=gens())
        assert torch.equal(acc, want_acc) and torch.equal(out, want)
        for b in range(B):
            assert path[b, :acc[b]].tolist() == list(range(acc[b].item()))


def test_layout_depths_paths_and_ancestors():
    parents = torch.tensor([[-1, -1, 0, 0, 2, PAD], [-1, 0, 1, PAD, PAD, PAD]])
    lay = tree_layout(parents, [5, 3])
    assert lay.depth[0].tolist() == [0, 1, 1, 2, 2, 3, 0]
    assert lay.max_depth == 3
    assert lay.paths[0] == [[1], [0, 3], [0, 2, 4]] and lay.paths[1] == [[0, 1, 2]]
    see = lay.ancestors()
    # node 4 (position 5) sees the root, node 0, node 2 and itself
    assert see[0, 5].nonzero().flatten().tolist() == [0, 1, 3, 5]
    assert see[0, 2].nonzero().flatten().tolist() == [0, 2]          # node 1: root + itself
    assert check_parents(parents, [5, 3]) is None
    assert "parent 3" in check_parents(torch.tensor([[-1, 3]]), [2])
    assert "parent -2" in check_parents(torch.tensor([[-2]]), [1])
