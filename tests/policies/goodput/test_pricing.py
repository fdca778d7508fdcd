"""What a token tree costs: the positions a depth-k tree scores, and the node price."""
from __future__ import annotations

import numpy as np
import pytest

from specflow.policies.goodput.pricing import RecentThroughput, TreeSize, node_price
from specflow.state import RoundResult


def test_a_node_is_priced_at_the_throughput_it_displaces():
    """price = tokens / s of recent rounds x what one more node costs (scoring it, and its share
    of a wider draft step); a busier round prices nodes higher, so trees shrink under load."""
    assert node_price(10.0, 0.01, 4, padded=False, branch_cost=0.0) == pytest.approx(0.1)
    assert node_price(50.0, 0.01, 4, padded=False, branch_cost=0.0) == pytest.approx(0.5)
    assert node_price(500.0, 0.01, 4, padded=False, branch_cost=0.0) == 1.0     # at most certain
    # with padded rows a branch lengthens one row, and the pass pads every row to it
    assert node_price(10.0, 0.01, 4, padded=True, branch_cost=0.0) == pytest.approx(0.4)
    assert node_price(10.0, 0.01, 4, padded=False, branch_cost=0.02) == pytest.approx(0.3)


def test_the_throughput_is_recent_rounds_and_a_new_run_starts_its_own():
    throughput = RecentThroughput(memory=0.5)
    assert throughput.rate is None
    throughput.add(10, 1.0)
    throughput.add(40, 1.0)
    assert throughput.rate == pytest.approx((0.5 * 10 + 40) / (0.5 + 1))
    throughput.reset()
    assert throughput.rate is None


def test_a_trees_positions_follow_the_nodes_per_level_it_scores_at_most_its_budget():
    size = TreeSize(max_nodes=16, ewma=0.1)
    assert size.positions(6).tolist() == [1, 2, 3, 4, 5, 6, 7]      # from a chain's width
    for _ in range(100):
        size.observe(nodes=32, levels=8)                             # four per level
    assert np.allclose(size.positions(6), [1, 5, 9, 13, 17, 17, 17], atol=1e-3)
    size.observe(nodes=0, levels=0)                                  # no tree: nothing learned
    assert size.width == pytest.approx(4.0, abs=1e-3)


def test_goodput_prices_a_tree_by_the_nodes_it_scores_per_level(make_pipeline):
    """A depth-k tree costs 1 + w k positions, w learned from the trees scored (a fixed 16-node
    n-gram tree: 4 per level); chains stay k + 1."""
    pipe = make_pipeline("proposer=ngram", "proposer.topk=4", "proposer.num_draft_tokens=16",
                         "policy=goodput", "policy.k_max=6")
    pol = pipe.pm.get_plugin("policy.goodput")
    assert pol.positions.tolist() == [1, 2, 3, 4, 5, 6, 7]
    for _ in range(100):
        pol.specflow_observe(RoundResult(0, [0, 1], [16, 16], [2, 0], [[1] * 3, [1]],
                                         [None] * 2, 2, tree_depths=[4, 4],
                                         num_examined=[3, 1]))
    assert np.allclose(pol.positions, [1, 5, 9, 13, 17, 17, 17], atol=1e-3)   # at most 16 nodes
    assert make_pipeline("proposer=ngram", "policy=goodput").pm.get_plugin(
        "policy.goodput").positions is None     # a chain: k + 1
