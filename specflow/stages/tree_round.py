"""A tree layout as a round uses it: the target pass over each row's tree, its verification
(greedy, rejection sampling, or the plain sample at each position) and the cache kept along the
accepted path. The structure itself is stages/tree.py's TreeLayout; a tree of single paths is
scored and verified as the chain it is."""
from __future__ import annotations

import dataclasses

import torch

from specflow.stages.chain import score_chain, verify_chain, verify_chain_by_position
from specflow.stages.sampling import position_weights
from specflow.stages.tree import TreeLayout, tree_layout
from specflow.stages.verify_tree import verify_tree
from specflow.state import VerifyOutput


class RoundTree(TreeLayout):
    """A TreeLayout with what the scorer, the verifier and the cache sync ask of a layout
    (ChainLayout answers the same)."""

    def score(self, scorer, batch, proposal, hidden: list) -> torch.Tensor:
        """One pass over each row's last committed token and its tree: [B, N+1, V]."""
        if self.is_chain:
            return score_chain(scorer, batch, proposal, hidden)
        return scorer.score_tree(batch, proposal.host_draft_token_ids(), self, hidden)

    def verify(self, batch, proposal, target_probs: torch.Tensor) -> VerifyOutput:
        """Multi-draft verification along the tree (greedy, or rejection sampling)."""
        if self.is_chain:
            return verify_chain(batch, proposal, target_probs)
        out, num_accepted, path = verify_tree(
            proposal.draft_token_ids, self.parents, target_probs, proposal.draft_probs,
            greedy=batch.greedy, generator=None if batch.greedy else batch.generators,
            layout=self)
        return VerifyOutput(out, num_accepted, path)

    def verify_by_position(self, batch, proposal, target_probs: torch.Tensor) -> VerifyOutput:
        """rule=coupled: a node's position is the committed length + its depth."""
        if self.is_chain:
            return verify_chain_by_position(batch, proposal, target_probs)
        starts = torch.tensor([len(ids) for ids in batch.token_ids], dtype=torch.long)  # [B]
        positions = (starts[:, None] + self.depth).to(target_probs.device)             # [B, N+1]
        weights = position_weights(target_probs, batch.seeds, positions)               # [B, N+1, V]
        out, num_accepted, path = verify_tree(proposal.draft_token_ids, self.parents, weights,
                                              greedy=True, layout=self)
        return VerifyOutput(out, num_accepted, path)

    def keep_cached(self, target, batch, result) -> None:
        """The pass cached the root (the last token before this round's commits) at
        len - committed - 1 and node i right after it: keep the accepted path's nodes."""
        target.keep_cached(batch.slots.tolist(), result.path_starts(batch.token_ids),
                           result.accepted_nodes)


def round_tree(parents: torch.Tensor, num_nodes: list[int]) -> RoundTree:
    """The round's layout of trees with these parents [B, N] (host) and node counts [B]."""
    layout = tree_layout(parents, num_nodes)
    return RoundTree(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)})
