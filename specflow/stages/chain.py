"""A round's drafts as one chain per row: the target pass over them and their verification,
what ChainLayout (stages/layout.py) answers with, and a tree of single paths too."""
from __future__ import annotations

import torch

from specflow.stages.sampling import position_weights
from specflow.stages.verify import verify
from specflow.state import VerifyOutput


def score_chain(scorer, batch, proposal, hidden: list) -> torch.Tensor:
    """Drafts a proposer counted stay where it made them; else the host copy: [B, K+1, V]."""
    return scorer.score_chain(batch, proposal.round_drafts(), proposal.host_counts(), hidden)


def verify_chain(batch, proposal, target_probs: torch.Tensor) -> VerifyOutput:
    """Greedy exact match, or rejection sampling with the rows' generators."""
    num_drafts = None if batch.greedy else proposal.host_counts()    # host: no device read
    out, num_accepted = verify(proposal.draft_token_ids, target_probs, proposal.draft_probs,
                               greedy=batch.greedy,
                               generator=None if batch.greedy else batch.generators,
                               num_drafts=num_drafts)
    return VerifyOutput(out, num_accepted)


def verify_chain_by_position(batch, proposal, target_probs: torch.Tensor) -> VerifyOutput:
    """verifier.rule=coupled under sampling: greedy matching against each position's plain
    sample; position j of a chain is the committed length + j."""
    starts = torch.tensor([len(ids) for ids in batch.token_ids], dtype=torch.long)      # [B]
    offsets = torch.arange(target_probs.shape[1])[None, :]                             # [1, K+1]
    positions = (starts[:, None] + offsets).to(target_probs.device)                    # [B, K+1]
    weights = position_weights(target_probs, batch.seeds, positions)                   # [B, K+1, V]
    out, num_accepted = verify(proposal.draft_token_ids, weights, greedy=True)
    return VerifyOutput(out, num_accepted)
