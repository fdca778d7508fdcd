"""Property tests (hypothesis) for the verifier: shapes, prefixes, greedy rule, p == q, zeros, rows.

Cases are random batches: B rows, a padded width K, each row's own k_b (PAD after it), a vocabulary
of V tokens, target probabilities p [B, K+1, V] and draft probabilities q [B, K, V] (None: a
deterministic proposer; random; or p itself, possibly scaled past 1 as rounding can leave it) built
from small integer weights, so exact zeros and exact ties occur.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specflow import verify
from specflow.state import PAD

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _normalise(w: torch.Tensor) -> torch.Tensor:
    """Integer weights -> probabilities along the last axis; an all-zero row gets weight on token 0."""
    w = w.clone().float()
    empty = w.sum(-1) == 0
    w[..., 0] = torch.where(empty, torch.ones_like(w[..., 0]), w[..., 0])
    return w / w.sum(-1, keepdim=True)


@st.composite
def cases(draw, with_q=None, greedy=None):
    B = draw(st.integers(1, 4))
    K = draw(st.integers(0, 5))
    V = draw(st.integers(2, 7))
    ks = draw(st.lists(st.integers(0, K), min_size=B, max_size=B))
    weights = st.integers(0, 4)
    p = _normalise(torch.tensor(draw(st.lists(weights, min_size=B * (K + 1) * V,
                                              max_size=B * (K + 1) * V))).view(B, K + 1, V))
    kind = draw(st.sampled_from(["none", "random", "target"])) if with_q is None else with_q
    q = None
    if kind == "random":
        q = _normalise(torch.tensor(draw(st.lists(weights, min_size=B * K * V,
                                                  max_size=B * K * V))).view(B, K, V))
    elif kind == "target":
        # q = p, or q over-covering p everywhere (unnormalised, as rounding can leave it): a
        # rejection then leaves max(0, p - q) == 0 and the verifier must still pick a real token
        q = p[:, :K] * draw(st.sampled_from([1.0, 1.25]))
    # drafts: often the target's argmax or a token q supports, so long prefixes get accepted
    drafts = torch.full((B, K), PAD, dtype=torch.long)
    for b in range(B):
        for j in range(ks[b]):
            how = draw(st.sampled_from(["argmax", "support", "any"]))
            if how == "argmax":
                tok = int(p[b, j].argmax())
            elif how == "support":
                dist = q[b, j] if q is not None else p[b, j]
                tok = draw(st.sampled_from((dist > 0).nonzero().flatten().tolist()))
            else:
                tok = draw(st.integers(0, V - 1))
            drafts[b, j] = tok
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    seeds = draw(st.lists(st.integers(0, 2**31 - 1), min_size=B, max_size=B))
    return dict(B=B, K=K, V=V, ks=ks, p=p, q=q, drafts=drafts, greedy=is_greedy, seeds=seeds)


def _run(c, rows=None, trim=False):
    """verify() on the case (or a subset of its rows) with one generator per row, seeded per row."""
    rows = list(range(c["B"])) if rows is None else rows
    drafts, p = c["drafts"][rows], c["p"][rows]
    q = None if c["q"] is None else c["q"][rows]
    if trim:    # only as wide as these rows need
        width = max(c["ks"][b] for b in rows)
        drafts, p = drafts[:, :width], p[:, :width + 1]
        q = None if q is None else q[:, :width]
    gens = None if c["greedy"] else [torch.Generator().manual_seed(c["seeds"][b]) for b in rows]
    return verify(drafts, p, q, greedy=c["greedy"], generator=gens)


@SETTINGS
@given(cases())
def test_output_is_accepted_prefix_plus_one_valid_token_then_padding(c):
    out, n = _run(c)
    B, K, V = c["B"], c["K"], c["V"]
    assert out.shape == (B, K + 1) and out.dtype == torch.long
    assert n.shape == (B,)
    for b in range(B):
        nb, kb = int(n[b]), c["ks"][b]
        row = out[b].tolist()
        assert 0 <= nb <= kb
        # exactly nb + 1 real tokens, then trailing PAD only
        assert all(0 <= t < V for t in row[:nb + 1]), row
        assert row[nb + 1:] == [PAD] * (K - nb), row
        # the accepted part is the drafts' own prefix
        assert row[:nb] == c["drafts"][b, :nb].tolist()
        # every committed token is one the target gives positive probability (shaping masks hold)
        if not c["greedy"]:
            for j, t in enumerate(row[:nb + 1]):
                assert c["p"][b, j, t] > 0, (b, j, t)


@SETTINGS
@given(cases(greedy=True))
def test_greedy_keeps_drafts_equal_to_the_argmax_and_appends_the_argmax(c):
    out, n = _run(c)
    argmax = c["p"].argmax(-1)                                                     # [B, K+1]
    for b in range(c["B"]):
        nb, kb = int(n[b]), c["ks"][b]
        drafts = c["drafts"][b].tolist()
        assert all(drafts[j] == argmax[b, j] for j in range(nb))
        if nb < kb:                              # stopped at the first draft that is not the argmax
            assert drafts[nb] != argmax[b, nb]
        assert out[b, nb] == argmax[b, nb]


@SETTINGS
@given(cases(greedy=False), st.booleans())
def test_sampling_with_p_equal_q_accepts_every_supported_draft(c, one_hot):
    K = c["K"]
    p = c["p"]
    # drafts the target supports: q == p means the acceptance ratio is exactly 1
    drafts = c["drafts"].clone()
    for b in range(c["B"]):
        for j in range(c["ks"][b]):
            if p[b, j, drafts[b, j]] == 0:
                drafts[b, j] = int(p[b, j].argmax())
    if one_hot:   # a deterministic proposer whose draft has p = 1: p == the one-hot q
        p = p.clone()
        for b in range(c["B"]):
            for j in range(c["ks"][b]):
                p[b, j] = 0.0
                p[b, j, drafts[b, j]] = 1.0
        q = None
    else:
        q = p[:, :K].clone()
    gens = [torch.Generator().manual_seed(s) for s in c["seeds"]]
    out, n = verify(drafts, p, q, greedy=False, generator=gens)
    assert n.tolist() == c["ks"]
    for b in range(c["B"]):
        kb = c["ks"][b]
        assert out[b, :kb].tolist() == drafts[b, :kb].tolist()
        assert p[b, kb, out[b, kb]] > 0                                            # the bonus


@SETTINGS
@given(cases(greedy=False))
def test_a_draft_the_target_gives_zero_probability_is_never_accepted(c):
    out, n = _run(c)
    for b in range(c["B"]):
        for j in range(int(n[b])):
            assert c["p"][b, j, c["drafts"][b, j]] > 0
        # and a row whose first draft has p = 0 accepts nothing
        if c["ks"][b] and c["p"][b, 0, c["drafts"][b, 0]] == 0:
            assert n[b] == 0


@SETTINGS
@given(cases(greedy=False))
def test_recovered_token_comes_from_the_residual(c):
    """After a rejection the token is drawn from max(0, p - q): p(x) > q(x) (unless that is empty)."""
    out, n = _run(c)
    for b in range(c["B"]):
        nb, kb = int(n[b]), c["ks"][b]
        if nb == kb:
            continue
        x = int(out[b, nb])
        p = c["p"][b, nb]
        if c["q"] is None:
            q = torch.zeros_like(p)
            q[c["drafts"][b, nb]] = 1.0
        else:
            q = c["q"][b, nb]
        residual = (p - q).clamp(min=0)
        if residual.sum() > 0:
            assert residual[x] > 0, (p.tolist(), q.tolist(), x)
        else:
            assert p[x] > 0


@SETTINGS
@given(cases(), st.data())
def test_a_rows_output_does_not_depend_on_the_other_rows(c, data):
    out, n = _run(c)
    for b in range(c["B"]):
        for trim in (False, True):
            alone, n_alone = _run(c, rows=[b], trim=trim)
            width = alone.shape[1]
            assert n_alone.tolist() == [int(n[b])]
            assert alone[0].tolist() == out[b, :width].tolist()
            assert (out[b, width:] == PAD).all()
    # any other batch containing the row (a permutation of a subset) gives it the same tokens
    rows = data.draw(st.permutations(list(range(c["B"]))))
    rows = rows[:data.draw(st.integers(1, c["B"]))]
    sub, n_sub = _run(c, rows=rows)
    for i, b in enumerate(rows):
        assert sub[i].tolist() == out[b].tolist() and n_sub[i] == n[b]


@SETTINGS
@given(cases(greedy=False))
def test_same_seeds_same_tokens(c):
    a, na = _run(c)
    b, nb = _run(c)
    assert torch.equal(a, b) and torch.equal(na, nb)


@settings(max_examples=40, deadline=None)
@given(cases(greedy=False))
def test_greedy_ignores_generators_and_draft_probs(c):
    out_greedy, n_greedy = verify(c["drafts"], c["p"], None, greedy=True)
    gens = [torch.Generator().manual_seed(s) for s in c["seeds"]]
    out2, n2 = verify(c["drafts"], c["p"], c["q"], greedy=True, generator=gens)
    assert torch.equal(out_greedy, out2) and torch.equal(n_greedy, n2)
