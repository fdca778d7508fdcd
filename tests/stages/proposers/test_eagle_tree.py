"""proposer=eagle with proposer.topk > 1: the head drafts token trees (the shipped demo head)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specflow import Pipeline, hookimpl
from specflow.stages.proposers.eagle import EagleProposer

PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(",
           "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(",
           "import os\nimport", "class Stack:\n    def __init__(self):\n        self",
           "x = [i * i for i in", "def add(a, b):\n    return", "# read the file\nwith open(",
           "while True:\n    line ="]
COMMON = ["threads=1", "max_new_tokens=40"]
TREE = ["proposer=eagle", "proposer.topk=4", "proposer.num_draft_tokens=16"]


def head_of(pipe) -> EagleProposer:
    return next(p for p in pipe.pm.get_plugins() if isinstance(p, EagleProposer))


@pytest.fixture(scope="module")
def plain_ids():
    pipe = Pipeline.from_config(["proposer=none", *COMMON])
    return [r.token_ids for r in pipe.generate(PROMPTS, max_batch_size=8)]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_eagle_trees_equal_plain_decoding_and_accept_more_than_chains(plain_ids, batch):
    got, n = {}, 4 if batch == 1 else len(PROMPTS)       # batch 1: the slower case, fewer
    for name, arm in (("chain", ["proposer=eagle"]), ("tree", TREE)):
        pipe = Pipeline.from_config([*arm, *COMMON])
        out = pipe.generate(PROMPTS[:n], max_batch_size=batch)
        assert [r.token_ids for r in out] == plain_ids[:n]
        s = pipe.last_stats
        got[name] = s["num_accepted_tokens"] / s["num_target_passes"]
        prop = head_of(pipe)
        assert prop.pending == {} and all(n == 0 for n in prop.cache.lengths)   # released
    assert s["num_tree_drafts"] > 0
    # the demo head's runner-up tokens are often the target's: a tree accepts more per pass
    assert got["tree"] > 1.1 * got["chain"]


def test_after_each_round_the_head_holds_the_target_states_of_the_committed_tokens():
    """A tree pass hands out the target's states in node order; after the round the head's
    pending states are those a plain forward over the committed tokens computes, at their
    own positions (the accepted path's moved into place, the rejected nodes' dropped)."""
    pipe = Pipeline.from_config([*TREE, *COMMON])
    prop, target = head_of(pipe), pipe.target
    seen = []

    class Record:
        @hookimpl(trylast=True)
        def specflow_sync_cache(self, batch, result):
            if result.num_examined is None:
                return
            for slot, ids, path in zip(batch.slots.tolist(), batch.token_ids,
                                       result.accepted_nodes):
                chunks = prop.pending.get(slot)
                if chunks and path != list(range(len(path))):    # a branch was accepted
                    first = chunks[0][0]
                    states = torch.cat([c for _, c in chunks])
                    seen.append((list(ids), first, states.clone()))
    pipe.register(Record())
    pipe.generate(PROMPTS, max_batch_size=4)
    assert len(seen) > 5
    layers = list(prop.layers)
    for ids, first, states in seen:
        assert first + len(states) == len(ids) - 1          # every committed position but the last
        with torch.inference_mode():
            hidden = target.model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        want = torch.cat([hidden[i][0, first:] for i in layers], -1)
        torch.testing.assert_close(states, want, atol=1e-4, rtol=1e-4)


def test_goodput_prices_eagle_trees_from_the_head_s_timed_steps(linear_clock):
    pipe = Pipeline.from_config([*TREE, *COMMON, "policy=goodput", "max_batch_size=4"])
    pol = pipe.pm.get_plugin("policy.goodput")
    # a wider head step, timed at build: what one more frontier node adds
    assert pol.tree and pol.branch_cost == pytest.approx(linear_clock["head"][1])
    prop = head_of(pipe)
    assert all(n == 0 for n in prop.cache.lengths)
    out = pipe.generate(PROMPTS[:4], max_batch_size=4)
    assert [r.token_ids for r in out] == [r.token_ids for r in Pipeline.from_config(
        ["proposer=none", *COMMON]).generate(PROMPTS[:4], max_batch_size=4)]


@pytest.mark.slow
def test_sampled_eagle_trees_keep_the_first_two_tokens_distributions():
    from specflow.experiments.chi_square import independence

    common = ["threads=2", "logits=[temperature,top_p]", "logits.temperature.value=1.0",
              "logits.top_p.p=0.9", "max_batch_size=32"]
    prompt = "def add(a, b):\n    return"
    n = 2000
    out = {}
    for name in ("plain", "tree"):
        # seeds from disjoint ranges: the two arms' samples are independent
        pipe = Pipeline.from_config([*(TREE + ["proposer.k=3", f"seed={n}"] if name == "tree"
                                       else ["proposer=none", "seed=0"]), *common])
        res = pipe.generate([prompt] * n, max_new_tokens=3)
        out[name] = np.array([(r.token_ids + [-1, -1])[:2] for r in res])   # -1: ended early
        if name == "tree":
            s = pipe.last_stats
            assert s["num_accepted_tokens"] > n / 2 and s["num_tree_drafts"] > 0
    for pos in (0, 1):
        values = np.unique(np.concatenate([out["plain"][:, pos], out["tree"][:, pos]]))
        table = np.stack([[np.sum(out[a][:, pos] == v) for v in values] for a in ("plain", "tree")])
        table = table[:, table.sum(0) >= 10]
        assert independence(table).pvalue > 1e-3
