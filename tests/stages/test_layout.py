"""Layouts (stages/layout.py): a chain and a tree answer the round's questions alike."""
from __future__ import annotations

import torch

from specflow.stages.layout import ChainLayout, check_proposal
from specflow.stages.tree import TreeLayout
from specflow.state import PAD, Proposal


class Target:
    vocab_size, max_length, supports_trees = 50, 100, True



class Rows:
    token_ids = [[1, 2, 3], [4, 5]]


def check(ids, parents=None, ks=(3, 3)):
    proposal = Proposal(torch.tensor(ids), parents=None if parents is None
                        else torch.tensor(parents))
    return check_proposal(proposal, Rows(), list(ks), Target())


def test_a_chain_is_checked_and_laid_out_as_one():
    proposal, layout, n, problem = check([[7, 8, PAD], [9, PAD, PAD]])
    assert problem is None and isinstance(layout, ChainLayout) and n == [2, 1]
    assert layout.round_fields(None) == {"accepted_nodes": None, "num_examined": None,
                                         "tree_depths": None}
    assert "never more" in check([[7, 8, 9], [9, PAD, PAD]], ks=(2, 3))[3]
    assert "padding (-1) between drafts" in check([[7, PAD, 9], [9, PAD, PAD]])[3]
    assert "outside the vocabulary [0, 50)" in check([[7, 80, PAD], [9, PAD, PAD]])[3]


def test_a_tree_of_single_paths_is_scored_as_a_chain_but_keeps_its_tree_record():
    proposal, layout, n, problem = check([[7, 8], [9, PAD]], parents=[[-1, 0], [-1, PAD]])
    assert problem is None and isinstance(layout, TreeLayout) and layout.is_chain
    assert proposal.parents is None and proposal.layout is layout     # scored as a chain
    assert layout.shaped_on_path([[0, 1], [0]]) is None
    assert layout.round_fields([[0, 1], [0]])["tree_depths"] == [2, 1]


def test_a_branching_tree_is_checked_against_depth_and_context():
    parents = [[-1, -1, 0], [-1, PAD, PAD]]
    proposal, layout, n, problem = check([[7, 8, 9], [9, PAD, PAD]], parents=parents)
    assert problem is None and not layout.is_chain and proposal.parents is not None
    assert n == [3, 1] and layout.row_depths == [2, 1]
    assert "depth 2 for a row given k=1" in check([[7, 8, 9], [9, PAD, PAD]], parents,
                                                  ks=(1, 3))[3]
    assert "parent 2" in check([[7, 8, 9], [9, PAD, PAD]], [[-1, 2, 0], [-1, PAD, PAD]])[3]
