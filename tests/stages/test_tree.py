"""Token trees through the pipeline: greedy output equals plain decoding's, the target cache
keeps exactly the accepted path, shaping sees each node's own prefix, bad trees are refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specflow import ConfigError, PluginError, Pipeline, Proposal, hookimpl
from specflow.state import PAD

REPEATING = ["ab ab ac ab ad ab ab ac a", "x = f(x) + f(y) + f(x) + f", "def f(a): return f(a) + f(",
             "1, 2, 3, 1, 2, 4, 1, 2, 3, 1", "aa ab aa ac aa ab aa", "if x: y\nif x: z\nif x",
             "print(a)\nprint(b)\nprint(a)\npr", "zz"]
TREE = ["proposer=ngram", "proposer.topk=4", "proposer.num_draft_tokens=16"]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_draft_model_trees_equal_plain_decoding(make_pipeline, batch):
    # the synthetic draft builds its tree level by level with tree attention over its own cache
    plain = make_pipeline("proposer=none", f"max_batch_size={batch}")
    want = [r.token_ids for r in plain.generate(REPEATING, max_new_tokens=120)]
    pipe = make_pipeline("proposer=draft", "proposer.topk=3", "proposer.num_draft_tokens=10",
                         f"max_batch_size={batch}")
    draft, checked = pipe.draft, []

    class Check:        # after each sync the draft's cache is a prefix of the committed tokens
        @hookimpl(trylast=True)
        def specflow_sync_cache(self, batch, result):
            for slot, ids in zip(batch.slots.tolist(), batch.token_ids):
                cached = draft.tokens(slot)
                checked.append(cached == ids[:len(cached)] and len(cached) < len(ids))
    pipe.register(Check())
    got = pipe.generate(REPEATING, max_new_tokens=120)
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["num_accepted_tokens"] for r in got) > len(REPEATING) * 60
    assert checked and all(checked)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_trees_equal_plain_decoding_on_the_synthetic_pair(make_pipeline, batch):
    # the synthetic target's greedy text falls into cycles after a few hundred tokens, which
    # the n-gram trees then predict: both rejected and accepted branches are exercised
    plain = make_pipeline("proposer=none", f"max_batch_size={batch}")
    want = [r.token_ids for r in plain.generate(REPEATING, max_new_tokens=300)]
    pipe = make_pipeline(*TREE, f"max_batch_size={batch}")
    got = pipe.generate(REPEATING, max_new_tokens=300)
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["num_accepted_tokens"] for r in got) > 100
    # the chain formula is not offered for trees; acceptance per position is per tree level
    assert got[0].stats["num_tree_drafts"] > 0 and got[0].stats["predicted_speedup"] is None
    assert len(got[0].stats["acceptance_per_position"]) <= 4


def test_the_target_cache_keeps_exactly_the_accepted_path(make_pipeline):
    pipe = make_pipeline(*TREE, "max_batch_size=4")
    target = pipe.target
    checked = []

    class Check:
        @hookimpl(trylast=True)
        def specflow_sync_cache(self, batch, result):
            for slot, ids in zip(batch.slots.tolist(), batch.token_ids):
                checked.append(target.tokens(slot) == ids[:-1])
    pipe.register(Check())
    out = pipe.generate(REPEATING[:4], max_new_tokens=300)
    assert checked and all(checked)
    assert sum(r.stats["num_accepted_tokens"] for r in out) > 50       # trees were accepted


@pytest.mark.parametrize("proposer", ["ngram", "eagle"])
def test_greedy_trees_equal_plain_decoding_on_the_demo_pair_with_penalties_and_stops(proposer):
    common = ["threads=1", "max_new_tokens=48", "max_batch_size=3",
              "logits=[repetition_penalty,no_repeat_ngram]", "logits.repetition_penalty.penalty=1.2",
              "logits.no_repeat_ngram.size=4", "stop.strings=['\\n\\n\\n']"]
    prompts = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(",
               "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(", "import os\nimport"]
    want = [r.token_ids for r in Pipeline.from_config(["proposer=none", *common]).generate(prompts)]
    pipe = Pipeline.from_config([f"proposer={proposer}", *TREE[1:], *common])
    got = pipe.generate(prompts)
    assert [r.token_ids for r in got] == want
    assert sum(r.stats["num_accepted_tokens"] for r in got) > 0


def test_a_tree_shapes_each_node_with_its_own_root_path():
    # no_repeat_ngram bans a token by the n-gram that would repeat: siblings with different
    # paths must get different bans (a chain's prefix would be wrong for all but one path)
    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic", *TREE,
                                 "logits=[no_repeat_ngram]", "logits.no_repeat_ngram.size=2"])
    from specflow.stages.tree import shape_tree, tree_layout
    from specflow.state import DecodeBatch

    from specflow.stages.penalties import NoRepeatNgram

    ids = [[3, 4, 5, 3]]
    next(p for p in pipe.pm.get_plugins() if isinstance(p, NoRepeatNgram))._index(0, ids[0])
    batch = DecodeBatch(slots=torch.tensor([0]), request_ids=[0], token_ids=ids, prompt_lens=[4],
                        max_new_tokens=[8], generators=[None], greedy=True, max_batch_size=1,
                        shaper=pipe.shape)
    drafts = torch.tensor([[4, 6, 5]])              # node 0: 4, node 1: 6 (siblings), node 2 under 1
    parents = torch.tensor([[-1, -1, 1]])
    layout = tree_layout(parents, [3])
    logits = torch.zeros(1, 4, pipe.target.vocab_size)
    shaped = shape_tree(pipe.shape, logits, batch, drafts, layout)
    banned = [set(torch.isinf(shaped[0, p]).nonzero().flatten().tolist()) for p in range(4)]
    assert banned[0] == {4}              # after ...3: "3 4" was seen
    assert banned[1] == {5}              # after 3, 4: "4 5" was seen
    assert banned[2] == set()            # after 3, 6: "6 x" never seen
    assert banned[3] == {3}              # after 3, 6, 5: "5 3" was seen (path 6 -> 5)
    pipe.empty_rows.clear()


def _plugin_tree(parents, tokens):
    class Bad:
        @hookimpl
        def specflow_propose(self, batch, k):
            B = batch.size
            return Proposal(torch.tensor([tokens] * B), None,
                            parents=torch.tensor([parents] * B))
    return Bad()


@pytest.mark.parametrize("parents,tokens,message", [
    ([-1, 1], [1, 2], "row 0 node 1 has parent 1; a parent is -1"),
    ([-1, 0, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6], "returned a tree of depth 6 for a row given k=4"),
    ([-1, 0, PAD, 1], [1, 2, PAD, 3], "padding \\(-1\\) between nodes"),
])
def test_a_bad_tree_from_a_plugin_is_refused_in_one_line(make_pipeline, parents, tokens, message):
    pipe = make_pipeline("proposer=ngram", plugins=[_plugin_tree(parents, tokens)])
    with pytest.raises(PluginError, match=message):
        pipe.generate(["ab"], max_new_tokens=20)


@pytest.mark.parametrize("overrides,message", [
    (["proposer.topk=0"], "proposer.topk=0 must be >= 1"),
    (["proposer.topk=2", "proposer.num_draft_tokens=3"],
     "proposer.num_draft_tokens=3 is smaller than the depth proposer.k=4"),
    (["proposer.num_draft_tokens=8"], "with proposer.topk=1: a chain scores k=4 nodes"),
])
def test_bad_tree_settings_are_one_line(make_pipeline, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_pipeline("proposer=ngram", *overrides)


def test_a_node_budget_past_the_context_is_refused():
    with pytest.raises(ConfigError, match="proposer.num_draft_tokens=5000 leaves no room"):
        Pipeline.from_config([*TREE[:2], "proposer.num_draft_tokens=5000", "threads=1"])


class TopTree:
    """A tree of the synthetic draft's likeliest tokens: 3 children of the root, 2 under each,
    1 under those (fixed tokens, so one-hot q): accepted often, rejected often."""

    def __init__(self, draft):
        self.draft = draft

    def likeliest(self, prev: int, cur: int, n: int) -> list[int]:
        probs = self.draft.probs[self.draft.context_of[prev, cur]]
        return probs.topk(n).indices.tolist()

    @hookimpl
    def specflow_propose(self, batch, k):
        trees = []
        for ids, kb in zip(batch.token_ids, k.tolist()):
            tokens, parents = [], []
            frontier = [(-1, ids[-2] if len(ids) > 1 else self.draft.vocab_size, ids[-1])]
            for width in (3, 2, 1)[:kb]:
                nxt = []
                for node, prev, cur in frontier:
                    for x in self.likeliest(prev, cur, width):
                        tokens.append(x)
                        parents.append(node)
                        nxt.append((len(tokens) - 1, cur, x))
                frontier = nxt
            trees.append((tokens, parents))
        N = max(len(t) for t, _ in trees)
        ids = torch.full((batch.size, N), PAD)
        par = torch.full((batch.size, N), PAD)
        for b, (t, p) in enumerate(trees):
            if t:
                ids[b, :len(t)] = torch.tensor(t)
                par[b, :len(t)] = torch.tensor(p)
        return Proposal(ids, None, parents=par)


@pytest.mark.slow
def test_sampled_trees_keep_the_first_two_tokens_distributions(make_pipeline):
    from specflow.experiments.chi_square import independence

    common = ["logits=[temperature,top_p]", "logits.temperature.value=1.0", "logits.top_p.p=0.9",
              "max_batch_size=32"]
    prompt = "def f(x): return x"
    n = 4000
    out = {}
    for name in ("plain", "tree"):
        # seeds from disjoint ranges: the two arms' samples are independent
        pipe = make_pipeline(*(["proposer=ngram", "proposer.k=3", f"seed={n}"] if name == "tree"
                               else ["proposer=none", "seed=0"]), *common)
        if name == "tree":
            pipe.register(TopTree(pipe.draft))
        res = pipe.generate([prompt] * n, max_new_tokens=4)
        out[name] = np.array([(r.token_ids + [-1, -1])[:2] for r in res])   # -1: ended early
        if name == "tree":
            accepted = sum(r.stats["num_accepted_tokens"] for r in res)
            rejected = sum(r.stats["num_target_passes"] for r in res) - n
            assert accepted > n / 2 and rejected > n / 4          # both paths well exercised
    for pos in (0, 1):
        values = np.unique(np.concatenate([out["plain"][:, pos], out["tree"][:, pos]]))
        table = np.stack([[np.sum(out[a][:, pos] == v) for v in values] for a in ("plain", "tree")])
        table = table[:, table.sum(0) >= 10]
        assert independence(table).pvalue > 1e-3


def test_logprobs_and_streaming_with_trees_equal_plain_decoding(make_pipeline):
    plain = make_pipeline("proposer=none", "max_batch_size=2")
    want = plain.generate(REPEATING[:2], max_new_tokens=200, logprobs=2)
    pipe = make_pipeline(*TREE, "max_batch_size=2")
    got = pipe.generate(REPEATING[:2], max_new_tokens=200, logprobs=2)
    assert sum(r.stats["num_accepted_tokens"] for r in got) > 20
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert [sorted(d) for d in a.top_logprobs] == [sorted(d) for d in b.top_logprobs]
    pieces = list(pipe.stream(REPEATING[0], max_new_tokens=200))
    assert "".join(pieces) == want[0].text


def test_the_calibration_learns_per_sibling_rank_whatever_the_tree_order():
    # the tree orders siblings by value, which may put a rank-1 child first: its verdicts must
    # still count for rank 1 (counting by tree order fed the calibration its own choices back)
    from specflow.stages.proposers.draft_tree import Calibration, DraftTree

    cal = Calibration(ranks=2)
    before = cal.log_rate(torch.tensor([[0.05, 0.04]])).exp()
    assert torch.allclose(before, torch.tensor([[0.05, 0.04]]), atol=1e-6)    # starts at q
    tree = DraftTree(base=0, entries=[-1, -1], parents=[-1, -1], q=[0.04, 0.05], rank=[1, 0])
    for _ in range(200):
        cal.decay()
        cal.observe(tree, [1], greedy=True)        # the rank-0 child (listed second) is accepted
    rate = cal.log_rate(torch.tensor([[0.05, 0.04]])).exp()[0]
    assert rate[0] > 0.9 and rate[1] < 0.1


def test_the_calibrations_device_tables_give_its_shrunk_rates():
    # the tree is built on the device from two [ranks, bins] tables: each cell's rate is
    # (accepted + prior x pooled) / (tried + prior), pooled = the rank's rate shrunk towards q
    import math
    import random

    from specflow.stages.proposers.draft_tree import Calibration

    rng = random.Random(0)
    cal = Calibration(ranks=3, bins=10, prior=2.0)
    cal.tried = [[rng.uniform(0, 20) for _ in range(10)] for _ in range(3)]
    cal.accepted = [[t * rng.random() for t in row] for row in cal.tried]
    q = torch.tensor([[0.93, 0.41, 0.05, 0.0], [0.5, 0.25, 0.1, 0.099]])
    got = cal.log_rate(q)
    for b in range(2):
        for r in range(4):
            rank, x = min(r, 2), float(q[b, r])
            cell = min(int(x * 10), 9)
            pooled = (sum(cal.accepted[rank]) + 2 * x) / (sum(cal.tried[rank]) + 2)
            want = (cal.accepted[rank][cell] + 2 * pooled) / (cal.tried[rank][cell] + 2)
            assert float(got[b, r]) == pytest.approx(math.log(want), abs=1e-5)
