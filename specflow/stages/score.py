"""The target pass: one forward over each row's uncached committed tokens followed by its drafts."""
from __future__ import annotations

import torch

from specflow.plugins import hookimpl
from specflow.stages.proposers.draft import catch_up, pending_inputs
from specflow.stages.tree import layout_of
from specflow.state import PAD


class TargetScorer:
    def __init__(self, target):
        self.target = target

    @hookimpl
    def specflow_score(self, batch, proposal):
        drafts = proposal.host_draft_token_ids()                           # [B, K] inputs are
                                                                           # built on the host
        B, K = drafts.shape
        if proposal.parents is not None:
            return self._score_tree(batch, proposal, drafts)
        cached = [self.target.cache_length(s) for s in batch.slots.tolist()]
        k = (drafts != PAD).sum(-1)                                        # [B]
        if all(len(ids) - n == 1 for ids, n in zip(batch.token_ids, cached)):
            # steady state: every row's cache lacks only its last committed token
            inputs = torch.cat([batch.last_tokens()[:, None], drafts], 1)  # [B, 1+K]
            return self.target.forward(batch.slots, inputs, k + 1)        # [B, K+1, V]
        pending, n_pending = pending_inputs(batch.token_ids, cached)       # [B, P], [B]
        P = pending.shape[1]
        inputs = torch.full((B, P + K), PAD, dtype=torch.long)             # [B, P+K]
        inputs[:, :P] = pending
        # drafts go right after each row's own pending tokens
        cols = n_pending[:, None] + torch.arange(K)[None, :]               # [B, K]
        inputs.scatter_(1, cols, drafts)
        logits = self.target.forward(batch.slots, inputs, n_pending + k)   # [B, P+K, V]
        # position j of the verifier = the last pending token (j = 0) or draft j
        pick = (n_pending - 1)[:, None] + torch.arange(K + 1)[None, :]     # [B, K+1]
        pick = pick.clamp(max=P + K - 1)
        return logits.gather(1, pick[..., None].expand(B, K + 1, logits.shape[-1]))  # [B, K+1, V]

    def _score_tree(self, batch, proposal, drafts):
        """One pass over each row's last committed token and its tree: [B, N+1, V]. A row whose
        cache lags further (a plugin's doing; never in a steady round) is prefilled first."""
        catch_up(self.target, batch.slots.tolist(), batch.token_ids, 1)
        layout = layout_of(proposal)
        inputs = torch.cat([batch.last_tokens()[:, None], drafts], 1)          # [B, N+1]
        lens = torch.tensor(layout.num_nodes) + 1                               # [B]
        return self.target.forward_tree(batch.slots, inputs, lens, layout)      # [B, N+1, V]

