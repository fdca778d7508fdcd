"""Sampling draws keyed by (seed, position): the hash against an exact reference, the draws'
distribution, and the promise they exist for: a seeded request gives the same tokens whatever the
draft length, the policy, the batch and the load (and exactly plain sampling's tokens)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from specflow.experiments.chi_square import goodness_of_fit

from specflow.stages.sampling import position_choice, position_exponentials, position_weights

M = 0xFFFFFFFF


def mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & M
    return x ^ (x >> 16)


def reference(seed: int, position: int, token: int) -> float:
    """The same draw in plain Python integers, with every wrap written out."""
    key = mix(mix(mix(seed & M) ^ position) ^ (seed >> 32))
    x = (key + token * 0x9E3779B1) & M
    x = mix(x)
    w = ((x >> 8) + 0.5) / 2 ** 24
    return -math.log1p(-w)


@pytest.mark.parametrize("seed", [0, 7, 2 ** 40 + 3, 2 ** 63 - 1])
def test_draws_equal_an_exact_reference(seed):
    positions = torch.tensor([[0, 1, 5, 1023, 2 ** 20]])
    got = position_exponentials(torch.tensor([seed]), positions, 300)              # [1, 5, 300]
    for j, pos in enumerate(positions[0].tolist()):
        for v in (0, 1, 2, 137, 299):
            assert got[0, j, v].item() == pytest.approx(reference(seed, pos, v), rel=1e-5, abs=1e-7)


def test_draws_are_independent_exponentials():
    seeds = torch.tensor([3, 4])
    e = position_exponentials(seeds, torch.arange(512).expand(2, 512), 257)        # [2, 512, 257]
    flat = e.flatten().double().numpy()
    # 50 bins of equal probability under Exp(1): edges -log(1 - i/50)
    edges = np.concatenate([-np.log1p(-np.arange(50) / 50), [np.inf]])
    counts = np.histogram(flat[::7], bins=edges)[0]
    assert goodness_of_fit(counts, np.full(50, counts.sum() / 50)).pvalue > 1e-3
    assert e.min() > 0 and torch.isfinite(e).all()
    # neighbours in token, position and seed are uncorrelated
    for a, b in ((e[..., :-1], e[..., 1:]), (e[:, :-1], e[:, 1:]), (e[0], e[1])):
        r = np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1]
        assert abs(r) < 0.01


def test_a_sparse_round_draws_only_its_support_and_gets_the_same_weights_bit_for_bit():
    """After top-p / top-k most tokens weigh 0: their draws are skipped, nothing else moves."""
    gen = torch.Generator().manual_seed(0)
    B, P, V = 3, 4, 4000
    seeds = torch.tensor([7, 2 ** 40 + 3, 12345])
    positions = torch.arange(P)[None, :] + torch.tensor([[0], [50], [999]])   # [B, P]
    probs = torch.zeros(B, P, V)
    for b in range(B):                          # each row its own few tokens, one row one-hot
        for q in range(P):
            ids = torch.randperm(V, generator=gen)[:1 if b == 2 else 40]
            probs[b, q, ids] = torch.rand(len(ids), generator=gen).softmax(0)
    dense = probs / position_exponentials(seeds, positions, V)
    got = position_weights(probs, seeds, positions)
    assert torch.equal(got, dense) and got.abs().sum() > 0
    assert torch.equal(position_choice(probs, seeds, positions), dense.argmax(-1))
    ids = torch.tensor([0, 5, 3999])
    assert torch.equal(position_exponentials(seeds, positions, V, ids),
                       position_exponentials(seeds, positions, V)[..., ids])
    full = probs + 1e-3                          # a dense round: every token drawn, as before
    assert torch.equal(position_weights(full, seeds, positions),
                       full / position_exponentials(seeds, positions, V))


def test_choice_is_categorical_and_a_function_of_seed_and_position():
    p = torch.tensor([0.45, 0.3, 0.15, 0.1, 0.0])
    n = 40_000
    picks = position_choice(p.expand(1, n, 5), torch.tensor([11]), torch.arange(n)[None])[0]
    counts = torch.bincount(picks, minlength=5).numpy()
    assert counts[4] == 0
    assert goodness_of_fit(counts[:4], p[:4].numpy() * n).pvalue > 1e-3
    again = position_choice(p.expand(1, n, 5), torch.tensor([11]), torch.arange(n)[None])[0]
    assert torch.equal(picks, again)


PROMPTS = ["ab", "hello", "x", "spec", "flow!", "zz"]


def tokens(make_pipeline, *overrides, batch=3, prompts=PROMPTS, tokens=40):
    pipe = make_pipeline("logits=[temperature]", "draft.noise=0.4", *overrides)
    return [r.token_ids for r in pipe.generate(prompts, max_new_tokens=tokens, seed=5,
                                               max_batch_size=batch)]


ARMS = [
    ("proposer=draft", "proposer.k=1"),
    ("proposer=draft", "proposer.k=6"),
    ("proposer=draft", "policy=adaptive"),
    ("proposer=draft", "policy=heuristic"),
    ("proposer=draft", "policy=goodput"),
    ("proposer=ngram",),
    ("proposer=draft", "proposer.topk=3", "proposer.num_draft_tokens=8"),
]


PLAIN: dict[str, list] = {}


@pytest.mark.parametrize("arm", ARMS, ids=lambda a: " ".join(a))
def test_a_seeded_request_gives_plain_sampling_s_tokens_whatever_the_draft_length(make_pipeline, arm):
    if "plain" not in PLAIN:
        PLAIN["plain"] = tokens(make_pipeline, "proposer=none", batch=1)
    batch = 1 if "policy=goodput" in arm else 4
    assert tokens(make_pipeline, *arm, batch=batch) == PLAIN["plain"]


def test_a_seeded_request_on_the_demo_pair_under_goodput():
    """The case a trial found: policy=goodput's k follows measured timings, which used to change
    the random draws a row consumed; the demo pair's draft model and EAGLE head."""
    from specflow import Pipeline

    sampling = ["logits=[temperature,top_p]", "logits.top_p.p=0.95", "pack=false"]
    prompts = ["def fib(n):", "import os\n"]
    plain = Pipeline.from_config(overrides=["proposer=none", *sampling]).generate(
        prompts, max_new_tokens=24, seed=3)
    for arm in (["proposer=draft", "policy=goodput"], ["proposer=eagle", "proposer.k=6"],
                ["proposer=eagle", "proposer.k=6", "proposer.min_confidence=0.5"]):
        spec = Pipeline.from_config(overrides=[*arm, *sampling]).generate(prompts, max_new_tokens=24, seed=3)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_load_does_not_change_a_seeded_request(make_pipeline):
    """Other requests joining between rounds (a server's load) change the batch and the policy's
    k, not the seeded request's tokens."""
    pipe = make_pipeline("logits=[temperature]", "proposer=draft", "policy=goodput", "draft.noise=0.4")
    alone = pipe.generate(["hello"], max_new_tokens=40, seed=77)[0].token_ids
    engine = pipe.engine(4)
    rid = engine.add_request("hello", 40, seed=77)
    done = {}
    for step in range(200):
        if step % 3 == 0 and step < 30:
            engine.add_request(PROMPTS[step % len(PROMPTS)], 20, seed=step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.result
        if not engine.has_unfinished():
            break
    engine.close()
    assert done[rid].token_ids == alone


def test_rejection_rule_stays_available_and_exactness_holds(make_pipeline):
    """rule=rejection keeps Leviathan/Chen sampling (per-request streams): reproducible for a
    fixed draft length, and never lower acceptance than the coupled rule on a sampled draft."""
    a = tokens(make_pipeline, "proposer=draft", "verifier.rule=rejection")
    b = tokens(make_pipeline, "proposer=draft", "verifier.rule=rejection")
    assert a == b
    alphas = {}
    for rule in ("coupled", "rejection"):
        pipe = make_pipeline("logits=[temperature]", "proposer=draft", "draft.noise=0.4",
                             f"verifier.rule={rule}")
        pipe.generate(PROMPTS * 4, max_new_tokens=60, seed=1)
        alphas[rule] = pipe.last_stats["alpha"]
    assert alphas["rejection"] > alphas["coupled"] > 0.3


def test_an_unknown_rule_is_one_line(make_pipeline):
    from specflow.errors import ConfigError

    with pytest.raises(ConfigError, match="verifier.rule='fast' is not a rule"):
        make_pipeline("verifier.rule=fast")
