"""Priced trees: a policy's node price (specflow_node_price) decides which draft nodes are worth
scoring; trees that come out as chains are scored as chains; goodput's price follows the load."""
from __future__ import annotations

import pytest
import torch

from specflow import PluginError, Proposal, hookimpl
from specflow.policies.goodput import LineFit, ModeChooser
from specflow.stages.proposers.draft import DraftModelProposer
from specflow.state import PAD, RoundResult

from tests.stages.test_tree import REPEATING

DRAFT_TREE = ["proposer=draft", "proposer.topk=3", "proposer.num_draft_tokens=10", "proposer.k=4"]


class FixedPrice:
    """A plugin policy's node price: the same for every row."""

    def __init__(self, price):
        self.price = price

    @hookimpl
    def specflow_node_price(self, batch, k):
        return torch.full((batch.size,), self.price)


def _proposed(pipe):
    """Every round's proposed trees (the draft proposer's record, read before the sync)."""
    proposer = next(p for p in pipe.pm.get_plugins() if isinstance(p, DraftModelProposer))
    seen = []

    class Record:
        @hookimpl(tryfirst=True)
        def specflow_sync_cache(self, batch, result):
            seen.extend(proposer.trees.values())
    pipe.register(Record())
    return seen


def _on_own_chain(tree) -> list[bool]:
    """Per node: it is on the draft's own chain (the likeliest child of a node on it)."""
    main = []
    for parent, rank in zip(tree.parents, tree.rank):
        main.append(rank == 0 and (parent == -1 or main[parent]))
    return main


@pytest.mark.parametrize("price", [0.0, 0.05, 0.3])
def test_a_priced_tree_proposes_only_branches_worth_the_price(make_pipeline, price):
    plain = make_pipeline("proposer=none", "max_batch_size=4")
    want = [r.token_ids for r in plain.generate(REPEATING, max_new_tokens=60)]
    pipe = make_pipeline(*DRAFT_TREE, "max_batch_size=4", plugins=[FixedPrice(price)])
    trees = _proposed(pipe)
    got = pipe.generate(REPEATING, max_new_tokens=60)
    assert [r.token_ids for r in got] == want            # exact whatever the price
    nodes = [(v, main) for t in trees for v, main in zip(t.value, _on_own_chain(t))]
    assert nodes and all(v >= price - 1e-9 or main for v, main in nodes)
    sizes = [len(t.parents) for t in trees]
    if price == 0.0:      # every node is worth it: the budget (not scaled down by k) caps it
        assert max(sizes) == 10
    else:
        assert sum(sizes) / len(sizes) < 10


@pytest.mark.parametrize("proposer, greedy", [("draft", True), ("draft", False),
                                              ("ngram", True)])
def test_at_a_price_of_one_a_tree_proposer_drafts_its_own_chain_as_a_chain(make_pipeline,
                                                                          proposer, greedy):
    """No branch can be worth a price of 1, so the tree would be the proposer's own chain: the
    chain path drafts it (no tree is built, none is scored) and the output stays exact."""
    sampling = [] if greedy else ["logits=[temperature]", "logits.temperature.value=1.0", "seed=3"]
    tree = [f"proposer={proposer}", *DRAFT_TREE[1:]]
    pipe = make_pipeline(*tree, "max_batch_size=2", *sampling, plugins=[FixedPrice(1.0)])
    trees = _proposed(pipe) if proposer == "draft" else []
    tree_passes = []
    original = pipe.target.forward_tree
    pipe.target.forward_tree = lambda *a, **kw: tree_passes.append(1) or original(*a, **kw)
    chain = make_pipeline(f"proposer={proposer}", "proposer.k=4", "max_batch_size=2", *sampling)
    got = pipe.generate(REPEATING[:4], max_new_tokens=30)
    want = chain.generate(REPEATING[:4], max_new_tokens=30)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]   # the chain's very drafts
    if greedy:
        plain = make_pipeline("proposer=none", "max_batch_size=2")
        assert [r.token_ids for r in got] == [r.token_ids for r in
                                              plain.generate(REPEATING[:4], max_new_tokens=30)]
    assert sum(r.stats["num_draft_tokens"] for r in got) > 0
    assert not trees and not tree_passes
    assert sum(r.stats["num_tree_drafts"] for r in got) == 0


@pytest.mark.parametrize("price, message", [([0.1, 0.2, 0.3], "returned 3 values for 2 rows"),
                                            ([0.1, 1.5], "a price of 1.5"),
                                            ([0.1, float("nan")], "a price of nan")])
def test_a_bad_node_price_is_one_line_naming_the_policy(make_pipeline, price, message):
    class Bad:
        @hookimpl
        def specflow_node_price(self, batch, k):
            return torch.tensor(price)
    pipe = make_pipeline(*DRAFT_TREE, "max_batch_size=2", plugins=[Bad()])
    with pytest.raises(PluginError) as err:
        pipe.generate(REPEATING[:2], max_new_tokens=8)
    line = str(err.value)
    assert "\n" not in line and message in line and "specflow_node_price" in line


class ChainTrees:
    """A tree proposer whose trees are chains (every node the only child of the one before)."""

    @hookimpl(tryfirst=True)
    def specflow_propose(self, batch, k):
        B, K = batch.size, int(k.max())
        ids = torch.full((B, K), PAD, dtype=torch.long)
        parents = torch.full((B, K), PAD, dtype=torch.long)
        for b, kb in enumerate(k.tolist()):
            ids[b, :kb] = batch.token_ids[b][-1]          # the last token again (often right)
            parents[b, :kb] = torch.arange(-1, kb - 1)
        return Proposal(ids, None, parents=parents)


def test_trees_that_are_chains_are_scored_as_chains(make_pipeline):
    plain = make_pipeline("proposer=none", "max_batch_size=4")
    want = [r.token_ids for r in plain.generate(REPEATING, max_new_tokens=40)]
    pipe = make_pipeline("proposer=ngram", "proposer.k=3", "max_batch_size=4",
                         plugins=[ChainTrees()])
    tree_passes = []
    original = pipe.target.forward_tree
    pipe.target.forward_tree = lambda *a, **kw: tree_passes.append(1) or original(*a, **kw)
    rounds = []

    class Record:
        @hookimpl
        def specflow_observe(self, result):
            rounds.append(result)
    pipe.register(Record())
    got = pipe.generate(REPEATING, max_new_tokens=40)
    assert [r.token_ids for r in got] == want
    assert not tree_passes                            # one causal pass, as for a chain
    drafted = [r for r in rounds if any(r.num_drafts)]
    assert drafted and all(r.accepted_nodes == [list(range(a)) for a in r.num_accepted]
                           for r in drafted)          # the tree's record: paths of nodes
    assert all(r.tree_depths == r.num_drafts for r in drafted)


def test_goodput_prices_nodes_by_the_throughput_they_displace(make_pipeline):
    """price = measured tokens / s x the fitted cost of one more scored position; a busier
    round (higher throughput) prices nodes higher, so trees shrink under load."""
    from specflow.state import DecodeBatch

    pipe = make_pipeline(*DRAFT_TREE, "policy=goodput", "max_batch_size=16")
    pol = pipe.pm.get_plugin("policy.goodput")
    assert pol.tree and pol.branch_cost == 0.0      # a simulated draft: no timing
    pol.target_fit = LineFit(0.05, 1.0, 0.01)       # a scored position costs 1% of a pass
    batch = DecodeBatch.make_dummy(4)
    pol.throughput.add(10.0, 1.0)                   # 10 tokens per (simulated) second
    pol.specflow_draft_length(batch)
    assert pol.specflow_node_price(batch, None).tolist() == pytest.approx([0.1] * 4)
    pol.throughput.reset()
    pol.throughput.add(50.0, 1.0)                   # five times the throughput
    pol.specflow_draft_length(batch)
    assert pol.specflow_node_price(batch, None).tolist() == pytest.approx([0.5] * 4)
    pol.throughput.reset()
    pol.throughput.add(500.0, 1.0)                  # ten times more
    pol.specflow_draft_length(batch)
    assert pol.specflow_node_price(batch, None).tolist() == [1.0] * 4     # at most certain
    chain = make_pipeline("proposer=draft", "policy=goodput").pm.get_plugin("policy.goodput")
    assert chain.specflow_node_price(batch, None) is None                  # chains: no price


class TreesOnly(ModeChooser):
    """Every drafting round a tree."""

    def choose(self, plain_seconds):
        return "tree"


def test_goodput_prices_nodes_higher_under_load_and_stays_exact(make_pipeline):
    prompts = REPEATING * 2
    plain = make_pipeline("proposer=none", "max_batch_size=16")
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=80)]
    prices = {}
    for batch in (1, 16):      # each scored position costs 5% of a pass
        pipe = make_pipeline(*DRAFT_TREE, "policy=goodput", f"max_batch_size={batch}",
                             "model.token_cost=0.05")
        pol = pipe.pm.get_plugin("policy.goodput")
        pol.modes = TreesOnly(0.05)         # every round a tree (a chain round's price is 1)
        got = pipe.generate(prompts, max_new_tokens=80)
        assert [r.token_ids for r in got] == want
        prices[batch] = pol.price
    # sixteen rows commit several times the tokens per second: a node must be surer to pay
    assert 0 < prices[1] < prices[16] / 2


def _round(mode_tree: bool, tree_seconds: float = 0.03) -> RoundResult:
    """A drafting round of one row: a tree commits 3 tokens in 30 ms (by default), a chain 2 in
    10 ms."""
    result = RoundResult.make_dummy([6 if mode_tree else 2], [2 if mode_tree else 1])
    result.seconds = {"target": tree_seconds * 2 / 3 if mode_tree else 0.006,
                      "draft": tree_seconds / 3 if mode_tree else 0.004}
    if mode_tree:
        result.tree_depths, result.accepted_nodes, result.num_examined = [3], [[0, 2]], [3]
    return result


@pytest.mark.parametrize("tree_ms,every", [(15.5, 10), (20, 50), (30, 100)])
def test_goodput_runs_trees_or_chains_whichever_commits_more_per_second(make_pipeline, tree_ms,
                                                                        every):
    """A tree proposer's rounds run as trees or as chains (price 1), each MODE_FIRST rounds
    first, then the one measured faster, with one round in MODE_EXPLORE given to the other
    until it has MODE_SURE rounds; then still one in MODE_EXPLORE while the two are within
    MODE_NOISE, proportionally fewer the further behind it measured (a tree round of 3 tokens
    in 15.5 ms is 3% behind a chain's 2 in 10 ms: 1 in 10; in 20 ms 25% behind: 1 in 50; in
    30 ms 50%: 1 in 100, the most)."""
    from specflow.state import DecodeBatch

    pol = make_pipeline(*DRAFT_TREE, "policy=goodput").pm.get_plugin("policy.goodput")
    batch = DecodeBatch.make_dummy(1)
    first, sure, explore = ModeChooser.MODE_FIRST, ModeChooser.MODE_SURE, ModeChooser.MODE_EXPLORE
    settle = 2 * first + explore * (sure - first)
    modes, prices = [], []
    for _ in range(settle + 200):
        pol.specflow_draft_length(batch)
        modes.append(pol.mode)
        prices.append(float(pol.specflow_node_price(batch, None)[0]))
        pol.specflow_observe(_round(pol.mode == "tree", tree_ms / 1000))
    assert modes[:2 * first] == ["tree", "chain"] * first
    assert modes[2 * first:settle].count("tree") == sure - first     # a gap on few rounds: noise
    later = modes[settle:]
    assert later.count("tree") == len(later) // every      # explored, no more
    assert all(p == 1.0 for p, m in zip(prices, modes) if m == "chain")
    assert all(p < 1.0 for p, m in zip(prices, modes) if m == "tree")
    # the acceptance each mode learned is its own: a tree's levels, a chain's tokens
    counts = pol.estimates.counts_by_mode
    assert counts["tree"][0][0, 1] > 0 and counts["chain"][0][0, 1] == 0
