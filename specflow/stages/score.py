"""The target pass: one forward over each row's uncached committed tokens followed by its drafts.

Where a stage asked for the target's hidden states (specflow_hidden_layers), the same forward
hands them out: the scorer returns them with the logits (state.Scores) and the pipeline passes
them on through specflow_target_states.
"""
from __future__ import annotations

import torch

from specflow.plugins import hookimpl
from specflow.stages.layout import layout_of
from specflow.stages.forward_inputs import catch_up, uncached_inputs
from specflow.state import HiddenStates, Scores


class TargetScorer:
    def __init__(self, target):
        self.target = target
        self.hidden_layers: tuple[int, ...] = ()    # set by the pipeline once it is built

    def _forward(self, slots: torch.Tensor, inputs: torch.Tensor, lens: torch.Tensor,
                 hidden: list, layout=None) -> torch.Tensor:
        """One target pass -> logits [B, T, V]; its hidden states (if asked for) join `hidden`."""
        layers = self.hidden_layers
        starts = [self.target.cache_length(s) for s in slots.tolist()] if layers else None
        extra = (layers,) if layers else ()
        out = self.target.forward(slots, inputs, lens, *extra) if layout is None \
            else self.target.forward_tree(slots, inputs, lens, layout, *extra)
        if not layers:
            return out
        logits, states = out
        hidden.append(HiddenStates(slots.tolist(), starts, lens.tolist(), states, layers))
        return logits

    @hookimpl
    def specflow_score(self, batch, proposal):
        hidden: list[HiddenStates] = []
        logits = layout_of(proposal).score(self, batch, proposal, hidden)         # [B, P, V]
        return Scores(logits, hidden) if self.hidden_layers else logits

    def score_chain(self, batch, drafts, counts: list[int], hidden):
        """Each row's uncached committed tokens and its drafts [B, K]: [B, K+1, V]."""
        B, K = drafts.shape
        cached = [self.target.cache_length(s) for s in batch.slots.tolist()]
        inputs, lens, last = uncached_inputs(batch.token_ids, cached, drafts, counts)  # [B, P+K]
        logits = self._forward(batch.slots, inputs, lens, hidden)                  # [B, P+K, V]
        if inputs.shape[1] == K + 1:    # steady state: each row lacked only its last token
            return logits                                                           # [B, K+1, V]
        # position j of the verifier = the last committed token (j = 0) or draft j
        pick = (last[:, None] + torch.arange(K + 1)[None, :]).clamp(max=inputs.shape[1] - 1)
        pick = pick.to(logits.device)                                               # [B, K+1]
        return logits.gather(1, pick[..., None].expand(B, K + 1, logits.shape[-1]))  # [B, K+1, V]

    def score_tree(self, batch, drafts, layout, hidden):
        """One pass over each row's last committed token and its tree (drafts [B, N] on the
        host): [B, N+1, V]. A row whose cache lags further (a plugin's doing; never in a steady
        round) is prefilled first."""
        _, states = catch_up(self.target, batch.slots.tolist(), batch.token_ids, 1,
                             self.hidden_layers)
        hidden.extend(states or ())
        inputs = torch.cat([batch.last_tokens()[:, None], drafts], 1)          # [B, N+1]
        lens = torch.tensor(layout.num_nodes) + 1                               # [B]
        return self._forward(batch.slots, inputs, lens, hidden, layout)         # [B, N+1, V]
