"""`proposer=draft`: a smaller model sharing the target's tokenizer drafts k tokens autoregressively.

Each draft step feeds every row's tokens that the draft has not cached yet (the committed tokens
after its cache, then the previous draft), shapes the logits with the pipeline's shape() exactly
as the target's will be shaped, and samples the draft from that shaped q; that same q goes to the
verifier. The draft cache is rolled back to the committed length in specflow_sync_cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.verify import sample_categorical
from specflow.state import PAD, Proposal


@dataclass
class DraftProposerConfig:
    name: str = "draft"
    k: int = 4                 # most tokens drafted per round
    fault_keep_rejected: bool = False  # test-only fault: never roll the draft cache back

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")


def pending_inputs(token_ids: list[list[int]], cached: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's committed tokens not yet in a cache, right-padded: ([B, T] long, lens [B] long)."""
    # a cache is never ahead of the committed tokens, except under the test-only fault, where it
    # still has to be fed the last committed token
    pending = [ids[min(n, len(ids) - 1):] for ids, n in zip(token_ids, cached)]
    lens = torch.tensor([len(p) for p in pending], dtype=torch.long)       # [B]
    out = torch.full((len(pending), int(lens.max())), PAD, dtype=torch.long)
    for b, p in enumerate(pending):
        out[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    return out, lens


class DraftModelProposer:
    def __init__(self, cfg: DraftProposerConfig, ctx):
        if ctx.draft is None:
            raise ConfigError("proposer=draft needs a draft model: set draft=<option> "
                              "(e.g. draft=synthetic for model=synthetic)")
        self.cfg = cfg
        self.model = ctx.draft

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.model.reset(slot)
        self.model.prefill(slot, request.prompt_ids[:-1])

    @hookimpl
    def specflow_propose(self, batch, k):
        B = batch.size
        K = int(k.max()) if B else 0
        if K == 0:
            return Proposal.empty(B)
        cached = [self.model.cache_length(s) for s in batch.slots.tolist()]
        inputs, lens = pending_inputs(batch.token_ids, cached)             # [B, T], [B]
        drafts = torch.full((B, K), PAD, dtype=torch.long)                 # [B, K]
        probs = None if batch.greedy else torch.zeros(B, K, self.model.vocab_size)  # [B, K, V]
        rows = torch.arange(B)
        for i in range(K):
            logits = self.model.forward(batch.slots, inputs, lens)         # [B, T, V]
            last = logits[rows, lens - 1][:, None]                          # [B, 1, V]
            shaped = batch.shape(last, drafts[:, :i], first_draft_index=i, source="draft")[:, 0]
            active = k > i                                                  # [B]
            if batch.greedy:
                x = shaped.argmax(-1)                                       # [B]
            else:
                q = shaped.softmax(-1)                                      # [B, V]
                x = sample_categorical(q, batch.generators, active=active)
                probs[:, i] = q
            drafts[:, i] = torch.where(active, x, torch.full_like(x, PAD))
            inputs, lens = x[:, None], torch.ones(B, dtype=torch.long)     # [B, 1], [B]
        return Proposal(drafts, probs)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        if self.cfg.fault_keep_rejected:
            return
        keep = [len(ids) - 1 for ids in batch.token_ids]
        self.model.truncate(batch.slots, keep)
