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


def test_a_counted_chain_is_checked_without_reading_its_drafts():
    """draft_counts: the layout comes from the counts, the drafts are checked on their device
    (flags read later with the verifier's output) and scored clamped into the vocabulary."""
    from specflow.stages.layout import deferred_problem

    good = Proposal(torch.tensor([[7, 8, PAD], [9, PAD, PAD]]), draft_counts=[2, 1])
    proposal, layout, n, problem = check_proposal(good, Rows(), [3, 3], Target())
    assert problem is None and layout.num_nodes == [2, 1] and n == [2, 1]
    assert proposal._host is None                         # nothing was read to the host
    assert proposal._unchecked[0].tolist() == [False, False]
    bad = Proposal(torch.tensor([[7, 80, PAD], [9, PAD, PAD]]), draft_counts=[2, 1])
    proposal, layout, n, problem = check_proposal(bad, Rows(), [3, 3], Target())
    assert problem is None and proposal._unchecked[0].tolist() == [True, False]
    assert proposal.draft_token_ids.tolist() == [[7, 49, PAD], [9, PAD, PAD]]
    assert "outside the vocabulary [0, 50)" in deferred_problem(proposal, [True, False], Rows(),
                                                                [3, 3], Target())
    short = Proposal(torch.tensor([[7, 8, PAD], [9, PAD, PAD]]), draft_counts=[1, 1])
    proposal, *_ = check_proposal(short, Rows(), [3, 3], Target())
    assert proposal._unchecked[0].tolist() == [True, False]
    assert "rows [0] hold [1] drafts (draft_counts) but returned [2]" in deferred_problem(
        proposal, [True, False], Rows(), [3, 3], Target())
    assert "never more" in check_proposal(
        Proposal(torch.tensor([[7, 8, 9], [9, PAD, PAD]]), draft_counts=[3, 1]), Rows(), [2, 3],
        Target())[3]


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
