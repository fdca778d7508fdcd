"""The verifier: exact greedy cases, the sampling rule against a NumPy reference, edge cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from specflow.experiments.chi_square import independence

from specflow import verify
from specflow.state import PAD


def reference_verify(draft_tokens, q_probs, p_probs, rng):
    """One sequence, article A's loop (docs/design.md §6): the rule in its plainest form."""
    out = []
    for i, tok in enumerate(draft_tokens):
        p, q = p_probs[i][tok], q_probs[i][tok]
        if rng.random() < min(1.0, p / q):
            out.append(int(tok))
            continue
        residual = np.maximum(p_probs[i] - q_probs[i], 0.0)
        residual /= residual.sum()
        out.append(int(rng.choice(len(residual), p=residual)))
        return out
    out.append(int(rng.choice(p_probs[-1].shape[0], p=p_probs[-1])))
    return out


def crafted_logits(argmaxes: list[list[int]], V: int = 6) -> torch.Tensor:
    """[B, K+1, V] probabilities with +100 logits at the intended argmax of each position."""
    logits = torch.zeros(len(argmaxes), len(argmaxes[0]), V)
    for b, row in enumerate(argmaxes):
        for j, a in enumerate(row):
            logits[b, j, a] = 100.0
    return logits.softmax(-1)


def tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


# --- greedy ------------------------------------------------------------------------------------

def test_greedy_exact_cases():
    target = crafted_logits([[1, 2, 3, 4],     # drafts 1 2 5: two accepted, recovered = 3
                             [1, 2, 3, 4],     # drafts 1 2 3: all accepted, bonus = 4
                             [0, 2, 3, 4],     # drafts 1 2 3: none accepted, recovered = 0
                             [5, 2, 3, 4]])    # no drafts (k = 0): plain decoding, token 5
    drafts = torch.tensor([[1, 2, 5], [1, 2, 3], [1, 2, 3], [PAD, PAD, PAD]])
    out, n = verify(drafts, target, greedy=True)
    assert n.tolist() == [2, 3, 0, 0]
    assert out.tolist() == [[1, 2, 3, PAD], [1, 2, 3, 4], [0, PAD, PAD, PAD], [5, PAD, PAD, PAD]]


def test_greedy_ragged_rows_stop_at_their_own_k():
    target = crafted_logits([[1, 2, 3], [1, 2, 3]])
    drafts = torch.tensor([[1, PAD], [1, 2]])   # row 0 drafted one token, row 1 two
    out, n = verify(drafts, target, greedy=True)
    assert n.tolist() == [1, 2]
    assert out.tolist() == [[1, 2, PAD], [1, 2, 3]]


def test_greedy_ignores_draft_probs_and_generator():
    target = crafted_logits([[1, 2, 3]])
    drafts = torch.tensor([[1, 2]])
    q = torch.full((1, 2, 6), 1 / 6)
    out1, _ = verify(drafts, target, q, greedy=True, generator=torch.Generator().manual_seed(1))
    out2, _ = verify(drafts, target, None, greedy=True)
    assert out1.tolist() == out2.tolist() == [[1, 2, 3]]


def test_pad_is_never_used_as_an_index():
    # if PAD (-1) indexed the vocabulary it would read the last token, which has p = 1 here
    V = 5
    target = torch.zeros(1, 3, V)
    target[..., V - 1] = 1.0
    drafts = torch.tensor([[PAD, PAD]])
    q = torch.zeros(1, 2, V)
    q[..., V - 1] = 1.0
    for greedy in (True, False):
        out, n = verify(drafts, target, q, greedy=greedy, generator=torch.Generator().manual_seed(0))
        assert n.tolist() == [0]
        assert out.tolist() == [[V - 1, PAD, PAD]]   # the bonus at position 0, nothing accepted


# --- sampling: edge cases ----------------------------------------------------------------------

def test_p_equal_q_accepts_everything_without_nan():
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(64, 5, 11, generator=gen).softmax(-1)           # [B, K+1, V]
    drafts = torch.multinomial(p[:, :4].reshape(-1, 11), 1, generator=gen).view(64, 4)
    out, n = verify(drafts, p, p[:, :4], generator=gen)
    assert n.tolist() == [4] * 64
    assert torch.equal(out[:, :4], drafts)
    assert ((out >= 0) & (out < 11)).all()


def test_zero_residual_still_returns_a_valid_token():
    # q over-covers p everywhere (unnormalised, as rounding can make it): a rejection leaves
    # max(0, p - q) == 0, and the verifier must still return a real token id
    p = torch.tensor([[[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]]]).repeat(4000, 1, 1)   # [B, 2, 3]
    q = torch.tensor([[[0.2, 0.3, 0.6]]]).repeat(4000, 1, 1)                    # [B, 1, 3]
    drafts = torch.full((4000, 1), 2)
    out, n = verify(drafts, p, q, generator=torch.Generator().manual_seed(0))
    rejected = n == 0
    assert rejected.any()                          # 1/6 of rows reject
    assert ((out[:, 0] >= 0) & (out[:, 0] < 3)).all()
    assert not torch.isnan(out.float()).any()


def test_deterministic_proposer_one_hot_q():
    # draft_probs=None: q is one-hot on the draft, so x is accepted with probability p(x)
    p = torch.tensor([0.1, 0.6, 0.3])
    target = p.repeat(50_000, 2, 1)                                                # [B, 2, 3]
    drafts = torch.full((50_000, 1), 1)
    out, n = verify(drafts, target, None, generator=torch.Generator().manual_seed(0))
    assert abs(n.float().mean().item() - 0.6) < 0.01
    first = np.bincount(out[:, 0].numpy(), minlength=3) / 50_000
    assert tv(first, p.numpy()) < 0.01


# --- sampling: distribution ----------------------------------------------------------------------

def _problem(seed: int, K: int = 3, V: int = 6):
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=gen).pow(3)
    q = torch.rand(K, V, generator=gen).pow(3)
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _batched_first_tokens(p, q, n, seed):
    gen = torch.Generator().manual_seed(seed)
    K, V = q.shape
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen)
                          for i in range(K)], 1)                                 # [n, K]
    out, _ = verify(drafts, p.expand(n, K + 1, V), q.expand(n, K, V), generator=gen)
    return out


def test_convergence_to_target_is_far_faster_than_to_unrelated():
    p, q = _problem(1)
    unrelated = {"draft q": q[0].numpy(), "uniform": np.full(6, 1 / 6),
                 "other": _problem(2)[0][0].numpy()}
    target = p[0].numpy()
    dist_target, dist_other = [], []
    for n in (10, 100, 1_000, 10_000, 100_000):
        out = _batched_first_tokens(p, q, n, seed=n)
        hist = np.bincount(out[:, 0].numpy(), minlength=6) / n
        dist_target.append(tv(hist, target))
        dist_other.append(min(tv(hist, u) for u in unrelated.values()))
    assert dist_target[-1] < 0.01
    assert dist_target[-1] < dist_target[0] / 10          # shrinks ~ 1/sqrt(n)
    assert min(dist_other[2:]) > 10 * dist_target[-1]      # unrelated ones stay far


def _outcome_counts(outs: list[tuple]) -> dict:
    counts: dict = {}
    for o in outs:
        counts[o] = counts.get(o, 0) + 1
    return counts


def test_batched_matches_numpy_reference_statistically():
    p, q = _problem(3, K=2, V=4)
    n = 20_000
    rng = np.random.default_rng(0)
    P, Q = p.double().numpy(), q.double().numpy()
    ref = []
    for _ in range(n):
        drafts = [int(rng.choice(4, p=Q[i])) for i in range(2)]
        ref.append(tuple(reference_verify(drafts, Q, P, rng)))
    ours = [tuple(t for t in row if t != PAD) for row in _batched_first_tokens(p, q, n, 7).tolist()]
    a, b = _outcome_counts(ref), _outcome_counts(ours)
    keys = sorted(set(a) | set(b))
    table = np.array([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]])
    table = table[:, table.sum(0) >= 10]                  # chi-square needs populated cells
    pvalue = independence(table).pvalue
    assert pvalue > 1e-3, f"batched and reference outcome distributions differ (p={pvalue:.2e})"


def test_each_committed_position_has_the_target_distribution():
    # lossless per position: out[0] ~ p0, and given x1 was accepted, out[1] ~ p1
    p, q = _problem(4, K=2, V=5)
    out = _batched_first_tokens(p, q, 200_000, seed=11)
    first = np.bincount(out[:, 0].numpy(), minlength=5) / len(out)
    assert tv(first, p[0].numpy()) < 0.01
    cont = out[out[:, 1] != PAD]
    # rows whose first token was an accepted draft continue; their second token is ~ p1
    second = np.bincount(cont[:, 1].numpy(), minlength=5) / len(cont)
    assert tv(second, p[1].numpy()) < 0.015


# --- randomness ----------------------------------------------------------------------------------

def test_seeded_runs_are_identical():
    p, q = _problem(5)
    a = _batched_first_tokens(p, q, 500, seed=3)
    b = _batched_first_tokens(p, q, 500, seed=3)
    assert torch.equal(a, b)


def test_batch_result_equals_solo_result_per_seeded_row():
    gen = torch.Generator().manual_seed(0)
    B, K, V = 6, 4, 7
    p = torch.rand(B, K + 1, V, generator=gen).softmax(-1)
    q = torch.rand(B, K, V, generator=gen).softmax(-1)
    drafts = torch.randint(0, V, (B, K), generator=gen)
    ks = [4, 0, 2, 4, 1, 3]                                   # ragged
    for b, k in enumerate(ks):
        drafts[b, k:] = PAD
    gens = [torch.Generator().manual_seed(100 + b) for b in range(B)]
    out, n = verify(drafts, p, q, generator=gens)
    for b, k in enumerate(ks):
        solo_out, solo_n = verify(drafts[b:b + 1, :k], p[b:b + 1, :k + 1], q[b:b + 1, :k],
                                  generator=[torch.Generator().manual_seed(100 + b)])
        assert n[b].item() == solo_n[0].item()
        assert out[b, :k + 1].tolist() == solo_out[0].tolist()


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="expected"):
        verify(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 5))


@pytest.mark.gpu
def test_cuda_matches_cpu_under_greedy_and_samples_target_on_cuda():
    target = crafted_logits([[1, 2, 3, 4], [0, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 5], [1, 2, 3]])
    out_cpu, n_cpu = verify(drafts, target, greedy=True)
    out_gpu, n_gpu = verify(drafts.cuda(), target.cuda(), greedy=True)
    assert out_gpu.cpu().tolist() == out_cpu.tolist() and n_gpu.cpu().tolist() == n_cpu.tolist()
    p, q = _problem(6)
    n = 100_000
    gen = torch.Generator(device="cuda").manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[i].cuda(), n, replacement=True, generator=gen)
                          for i in range(3)], 1)
    out, _ = verify(drafts, p.cuda().expand(n, 4, 6), q.cuda().expand(n, 3, 6), generator=gen)
    hist = np.bincount(out[:, 0].cpu().numpy(), minlength=6) / n
    assert tv(hist, p[0].numpy()) < 0.01


def test_greedy_verification_keeps_its_shapes_for_no_rows_and_narrow_drafts():
    out, n = verify(torch.empty(0, 3, dtype=torch.long), torch.rand(0, 4, 10), greedy=True)
    assert out.shape == (0, 4) and n.shape == (0,) and out.dtype == n.dtype == torch.long
    target = torch.zeros(1, 4, 5)
    target[0, 0, 1] = target[0, 1, 2] = target[0, 2, 4] = 1.0
    out, n = verify(torch.tensor([[1, 2, PAD]], dtype=torch.int32), target, greedy=True)
    assert out.tolist() == [[1, 2, 4, PAD]] and n.tolist() == [2] and out.dtype == torch.long
