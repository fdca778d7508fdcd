"""The logit processors' tensor work (specflow.stages.logits): top-p against a sort of every row
in float64, whichever width decides a row, and each row's result independent of the rows beside
it (the target shapes K+1 positions of B rows at once, plain decoding one: they must agree)."""
from __future__ import annotations

import pytest
import torch

from specflow.stages import logits as L

NEG_INF = float("-inf")


def reference_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """The i-th most likely token stays iff the mass before it is < p; float64, whole sort."""
    x = logits.double()
    s, order = x.sort(dim=-1, descending=True)
    probs = s.softmax(-1)
    drop = (probs.cumsum(-1) - probs) >= p
    return x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), NEG_INF)


def near_the_cut(logits: torch.Tensor, p: float, tol: float = 1e-5) -> torch.Tensor:
    """Rows whose boundary token has a mass before it within `tol` of p (float rounding may
    put it either side)."""
    probs = logits.double().softmax(-1).sort(dim=-1, descending=True).values
    before = probs.cumsum(-1) - probs
    return ((before - p).abs() < tol).any(-1)


def needed(x: torch.Tensor, p: float = 0.9) -> torch.Tensor:
    """How many of each row's most likely tokens its top-p set holds."""
    return ((x.softmax(-1).sort(dim=-1, descending=True).values.cumsum(-1)) < p).sum(-1) + 1


def leaders(sizes: list[int], V: int, gen) -> torch.Tensor:
    """A row per size m: m near-equal leaders (spread over the vocabulary) over a tail that
    holds ~0.1% of the mass, so its top-0.9 set holds ~0.9 m tokens."""
    rows = []
    for m in sizes:
        x = torch.randn(V, generator=gen) * 0.5 - 16.0
        x[torch.randperm(V, generator=gen)[:m]] = torch.rand(m, generator=gen) * 0.5
        rows.append(x)
    return torch.stack(rows)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p_whichever_width_decides(p):
    gen = torch.Generator().manual_seed(0)
    V = 10000
    few, some, many = [1, 5, 20, 40, 50], [100, 300, 700, 900], [1300, 2500, 4000]
    x = leaders([max(1, int(n / p)) for n in few + some + many], V, gen)   # ~n tokens each
    need = needed(x, p)
    assert need[:5].max() <= 64 < need[5:9].min() and need[5:9].max() <= 1024 < need[9:].min()
    x = x[torch.randperm(len(x), generator=gen)]            # the widths mixed in one batch
    x[3, :100] = NEG_INF                                    # an earlier processor's mask
    got, want = L.apply_top_p(x, p), reference_top_p(x, p)
    ok = ~near_the_cut(x, p)
    assert ok.sum() >= 10
    assert torch.equal(got.isinf()[ok], want.isinf()[ok])
    kept = ~got.isinf()
    assert torch.equal(got[kept], x[kept])                  # kept logits are unchanged
    assert (kept.sum(-1) >= 1).all()                        # the most likely always stays


def test_top_p_of_each_row_is_the_same_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(1)
    V = 3000
    x = leaders([3, 30, 200, 900, 1500, 40, 2500, 500], V, gen).view(2, 4, V)  # [B, P, V]
    batched = L.apply_top_p(x, 0.9)
    assert batched.shape == x.shape
    for b in range(2):
        for q in range(4):
            alone = L.apply_top_p(x[b, q:q + 1], 0.9)                         # [1, V]
            assert torch.equal(alone[0], batched[b, q])


def test_top_p_edges():
    x = torch.tensor([[5.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    assert L.apply_top_p(x, 1.0) is x                                        # p = 1: untouched
    one_hot = torch.tensor([[0.0, NEG_INF, NEG_INF, NEG_INF]])
    assert torch.equal(L.apply_top_p(one_hot, 0.5), one_hot)
    got = L.apply_top_p(x, 0.5)
    assert (~got[0].isinf()).sum() == 1 and got[0, 0] == 5.0                 # 0.98 alone
    assert (~got[1].isinf()).sum() == 2                                      # 0.25 + 0.25
    # where the sort path runs (on an accelerator), the same sets
    assert torch.equal(L._top_p_sorted(x, 0.5).isinf(), got.isinf())
