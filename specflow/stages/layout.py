"""How a round's drafts are laid out: a chain per row, or a token tree per row.

A chain is the one-path case of a tree (node i's parent is i - 1), and both answer the same
questions for the round, so the round itself never asks which it has:
  - what is wrong with the proposal, if anything (one line naming the proposer's fault);
  - how the target's distributions are shaped (a chain: one shape() call over the K+1 positions;
    a tree: each root-to-leaf path as a row, so a node is shaped on its own prefix);
  - which scored positions the verifier's accepted path went through, and what the round
    records about it (RoundResult's accepted_nodes, num_examined, tree_depths).

What a round's pass may hold under a proposer config (`tree_width`, `scored_nodes`) is asked of
the layout too, so the pipeline and the policies size passes without reading tree code.

`ChainLayout` is here; `TreeLayout` (stages/tree.py) answers the same questions for trees. A tree
proposal whose every row is one path keeps its TreeLayout (so its proposer learns from the
verdicts) but is scored and shaped as the chain it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.stages.chain import score_chain, verify_chain, verify_chain_by_position
from specflow.state import PAD, Proposal, VerifyOutput


@dataclass
class ChainLayout:
    """A chain per row: draft i follows draft i - 1; target position j comes after j drafts."""

    num_nodes: list[int]          # [B] drafts per row

    is_chain = True               # scored as a chain (backend.forward, not forward_tree)

    @property
    def row_depths(self) -> list[int]:
        return self.num_nodes

    def check(self, ks: list[int], room: list[int | None]) -> str | None:
        """At most k drafts per row (the pipeline's caps keep a chain inside the context)."""
        for n, kb in zip(self.num_nodes, ks):
            if n > kb:
                return (f"returned {n} drafts for a row given k={kb}; a proposer may return "
                        f"fewer drafts than asked, never more")
        return None

    def shape(self, shape, logits: torch.Tensor, batch, drafts: torch.Tensor) -> torch.Tensor:
        """The target's K+1 positions through the pipeline's shape(): [B, K+1, V]."""
        return shape(logits, batch.token_ids, drafts, 0, batch.request_ids, "target",
                     sampling=batch.sampling, greedy=batch.greedy)

    def accepted_paths(self, verified: VerifyOutput) -> list[list[int]] | None:
        """The accepted node indices per row, for the round's record: None for a chain (its
        accepted drafts are its first num_accepted)."""
        return None

    def shaped_on_path(self, accepted: list[list[int]] | None) -> list[list[int]] | None:
        """Which shaped rows the empty-row check follows (None: position j = after j drafts)."""
        return None

    def round_fields(self, accepted: list[list[int]] | None) -> dict:
        """RoundResult's tree fields: none for a chain."""
        return {"accepted_nodes": None, "num_examined": None, "tree_depths": None}

    # --- what the stages ask of a layout ------------------------------------------------------

    def score(self, scorer, batch, proposal, hidden: list) -> torch.Tensor:
        """The target pass over each row's uncached tokens and its drafts: [B, K+1, V]."""
        return score_chain(scorer, batch, proposal, hidden)

    def verify(self, batch, proposal, target_probs: torch.Tensor) -> VerifyOutput:
        return verify_chain(batch, proposal, target_probs)

    def verify_by_position(self, batch, proposal, target_probs: torch.Tensor) -> VerifyOutput:
        return verify_chain_by_position(batch, proposal, target_probs)

    def keep_cached(self, target, batch, result) -> None:
        """After the round: a chain's pass cached the accepted drafts where they belong."""


def check_proposal(proposal: Proposal, batch, ks: list[int], target):
    """Check the drafts: on the host (the round's first host sync: the drafts are read), or for
    a chain whose proposer counted its drafts (`Proposal.draft_counts`), on the device, read
    with the verifier's output (`deferred_problem` then says what was wrong).

    -> (the proposal to score (a tree of single paths becomes its chain), its layout, the
    number of drafts or nodes per row, and what is wrong with it or None). Checks: drafts packed
    at the front of each row (PAD only after them), inside the vocabulary, at most k per row
    (a tree: depth at most k, parents before children, nodes within the context left)."""
    counts, B = proposal.draft_counts, len(batch.token_ids)
    if proposal.draft_token_ids.shape == (B, 0) and proposal.parents is None and \
            (counts is None or list(counts) == [0] * B):
        # no drafts at all (plain decoding, or nothing to propose): nothing to check or read
        proposal.layout = ChainLayout([0] * B)
        return proposal, proposal.layout, [0] * B, None
    if proposal.draft_counts is not None and proposal.parents is None:
        return _check_counted(proposal, ks, target.vocab_size)
    return _check_on_host(proposal, batch, ks, target)


def _check_counted(proposal: Proposal, ks: list[int], vocab_size: int):
    """A counted chain: the counts are checked against k here, the drafts against the counts
    and the vocabulary on their device, without a read. The round scores the drafts clamped
    into the vocabulary (a bad id fails the round at its end, not inside the pass)."""
    counts = list(proposal.draft_counts)
    ids = proposal.draft_token_ids                                                    # [B, K]
    B, K = ids.shape
    if len(counts) != B or any(not 0 <= n <= K for n in counts):
        problem = (f"returned draft_counts={counts} for {B} rows of at most {K} drafts; "
                   f"give each row's number of drafts, or None")
        return proposal, None, [0] * B, problem
    layout = ChainLayout(counts)
    problem = layout.check(ks, [])
    if problem is None:
        expected = torch.arange(K)[None, :] < torch.tensor(counts)[:, None]            # [B, K]
        bad = ((ids != PAD) != expected.to(ids.device)) | (ids < PAD) | (ids >= vocab_size)
        proposal._unchecked = (bad.any(-1), ids)                                      # [B]
        proposal.draft_token_ids = ids.clamp(PAD, vocab_size - 1)                    # [B, K]
        proposal.layout = layout
    return proposal, layout, counts, problem


def deferred_problem(proposal: Proposal, flagged: list[bool], batch, ks: list[int],
                     target) -> str:
    """What the device check of a counted chain found (`flagged`: its rows, read to the host),
    in the words the host check uses."""
    _, raw = proposal._unchecked
    host = Proposal(raw, proposal.draft_probs, proposal.skip_reasons)
    _, _, num_drafts, problem = _check_on_host(host, batch, ks, target)
    if problem is None:
        rows = [b for b, bad in enumerate(flagged) if bad]
        problem = (f"said its rows {rows} hold {[proposal.draft_counts[b] for b in rows]} "
                   f"drafts (draft_counts) but returned {[num_drafts[b] for b in rows]}")
    return problem


def _check_on_host(proposal: Proposal, batch, ks: list[int], target):
    from specflow.stages.tree import check_parents

    vocab_size, limit = target.vocab_size, target.max_length
    ids = proposal.host_draft_token_ids()                                      # [B, K] host
    valid = ids != PAD                                                         # [B, K]
    counts = torch.stack([valid.sum(-1), valid.long().cumprod(-1).sum(-1),
                          ((ids < PAD) | (ids >= vocab_size)).sum(-1)])        # [3, B]
    num_drafts, at_front, out_of_vocab = counts.tolist()
    what = "drafts" if proposal.parents is None else "nodes"
    problem = None if proposal.parents is None else \
        check_parents(proposal.parents.cpu(), num_drafts)
    if problem is None and at_front != num_drafts:
        problem = f"returned a row with padding (-1) between {what}; pad only after them"
    if problem is None and any(out_of_vocab):
        problem = f"returned token ids outside the vocabulary [0, {vocab_size})"
    if problem is None and proposal.parents is not None and not target.supports_trees:
        problem = (f"returned a tree, but the target backend {type(target).__name__} cannot "
                   f"score trees; propose chains (parents=None)")
    layout = None
    if problem is None:
        layout = layout_of(proposal)
        room = [None if limit is None else limit - len(ids) for ids in batch.token_ids]
        problem = layout.check(ks, room)
    if problem is None and proposal.parents is not None and layout.is_chain:
        proposal = proposal.as_chain()       # trees that are chains: scored as one (cheaper)
        proposal.layout = layout
    return proposal, layout, num_drafts, problem


def layout_of(proposal: Proposal):
    """The proposal's layout (a ChainLayout, or a TreeLayout for one with parents, checked
    beforehand: the pipeline does), built on the host once and kept on the proposal."""
    if proposal.layout is None:
        num_nodes = proposal.host_counts() if proposal.parents is None else \
            (proposal.host_draft_token_ids() != PAD).sum(-1).tolist()
        if proposal.parents is None:
            proposal.layout = ChainLayout(num_nodes)
        else:
            from specflow.stages.tree_round import round_tree

            proposal.layout = round_tree(proposal.parents.cpu(), num_nodes)
    return proposal.layout


def along_paths(shaped: torch.Tensor, accepted_nodes: list[list[int]] | None) -> torch.Tensor:
    """A round's shaped distributions [B, P, V] read along each row's accepted path: position j
    = after the path's first j drafts (a chain's positions as they are)."""
    if accepted_nodes is None:
        return shaped
    from specflow.stages.tree import along_path

    width = shaped.shape[1] - 1
    nodes = torch.tensor([a + [PAD] * (width - len(a)) for a in accepted_nodes],
                         dtype=torch.long).view(len(accepted_nodes), width)
    return along_path(shaped, nodes)                                              # [B, N+1, V]


def tree_width(proposer) -> int:
    """Most children per node under a proposer config (proposer.topk; 1 = chains, also for a
    proposer without the setting or no proposer)."""
    return 1 if proposer is None else int(proposer.get("topk", 1) or 1)


def scored_nodes(proposer) -> int:
    """Draft nodes a row may score in one pass under a proposer config: its node budget for a
    tree (topk > 1), else k."""
    k = int(proposer.get("k", 0) or 0)
    if tree_width(proposer) <= 1:
        return k
    return int(proposer.get("num_draft_tokens") or k)
