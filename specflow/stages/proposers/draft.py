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

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")


def pending_inputs(token_ids: list[list[int]], cached: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's committed tokens not yet in a cache, right-padded: ([B, T] long, lens [B] long)."""
    # a cache is never ahead of the committed tokens; one that was never rolled back (the fault
    # the tests inject) still has to be fed the last committed token
    pending = [ids[min(n, len(ids) - 1):] for ids, n in zip(token_ids, cached)]
    lens = torch.tensor([len(p) for p in pending], dtype=torch.long)       # [B]
    out = torch.full((len(pending), int(lens.max())), PAD, dtype=torch.long)
    for b, p in enumerate(pending):
        out[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    return out, lens


def spread(batch_size: int, rows: list[int], drafts: torch.Tensor, probs: torch.Tensor | None,
           reasons: list[str | None]) -> Proposal:
    """The drafts of the rows that drafted ([R, K], q [R, K, V] or None) placed into a proposal
    for the whole batch (PAD and zero q elsewhere, with each skipped row's reason)."""
    if len(rows) == batch_size:
        return Proposal(drafts, probs)
    full = Proposal.empty(batch_size, drafts.shape[1], device=drafts.device)
    full.skip_reasons = reasons
    full.draft_token_ids[rows] = drafts
    if probs is not None:
        full.draft_probs = probs.new_zeros(batch_size, *probs.shape[1:])
        full.draft_probs[rows] = probs
    return full


def draft_steps(batch, ks: list[int], K: int, vocab_size: int, device, step):
    """K autoregressive draft steps, shared by the proposers that run a model: a row stops being
    computed once it has its own ks[b] drafts (the cost follows sum(k), not rows x max(k)).

    step(i, sub, keep, previous) -> the live rows' logits [L, V] on the target's vocabulary, where
    sub = the rows still drafting, keep = their indices among the previous step's live rows (to
    cut a proposer's own per-row state), previous [L] = the tokens they drafted at step i - 1
    (None at i = 0). Each step's logits go through the pipeline's shape() and the draft is
    sampled from that very q. -> (drafts [B, K] long, q [B, K, V] or None under greedy)."""
    B = batch.size
    drafts = torch.full((B, K), PAD, dtype=torch.long, device=device)              # [B, K]
    probs = None if batch.greedy else torch.zeros(B, K, vocab_size, device=device)
    live = list(range(B))                    # rows still drafting, as indices into batch
    sub = batch
    for i in range(K):
        keep = [j for j, b in enumerate(live) if ks[b] > i]
        if len(keep) < len(live):            # some rows are done: drop them from the step
            live = [live[j] for j in keep]
            sub = batch.select(live)
        idx = torch.tensor(live, device=device)                                     # [L]
        logits = step(i, sub, keep, drafts[idx, i - 1] if i else None)             # [L, V]
        shaped = sub.shape(logits[:, None], drafts[idx, :i], first_draft_index=i,
                           source="draft")[:, 0]
        if batch.greedy:
            x = shaped.argmax(-1)                                                   # [L]
        else:
            q = shaped.softmax(-1)                                                  # [L, V]
            x = sample_categorical(q, sub.generators)
            probs[idx, i] = q
        drafts[idx, i] = x
    return drafts, probs


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [..., V_draft] on the target's vocabulary [..., V_target]: checkpoints of one
    family pad their embedding tables differently; rows past the tokenizer are never real tokens."""
    V = logits.shape[-1]
    if V > vocab_size:
        return logits[..., :vocab_size]
    if V < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - V), float("-inf"))
        return torch.cat([logits, pad], -1)
    return logits


class DraftModelProposer:
    def __init__(self, cfg: DraftProposerConfig, ctx):
        if ctx.draft is None:
            raise ConfigError("proposer=draft needs a draft model: set draft=<option> "
                              "(e.g. draft=synthetic for model=synthetic)")
        self.cfg = cfg
        self.model = ctx.draft
        self.vocab_size = ctx.target.vocab_size

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.model.reset(slot)

    @hookimpl
    def specflow_prefill(self, slots, requests):
        self.model.prefill_many(slots, [r.prompt_ids[:-1] for r in requests])

    def _room(self, batch, k: torch.Tensor) -> list[int]:
        """k per row, cut where the draft's own context ends (it may be shorter than the target's)."""
        ks = k.tolist()
        limit = self.model.max_length
        if limit is None:
            return ks
        return [max(0, min(kb, limit - len(ids))) for kb, ids in zip(ks, batch.token_ids)]

    @hookimpl
    def specflow_propose(self, batch, k):
        ks = self._room(batch, k)
        rows = [b for b, kb in enumerate(ks) if kb > 0]
        K = max(ks, default=0)
        full_context = ["draft context full" if asked > 0 and kb == 0 else None
                        for asked, kb in zip(k.tolist(), ks)]
        if K == 0:
            return Proposal(Proposal.empty(batch.size).draft_token_ids, None, full_context)
        sub = batch.select(rows) if len(rows) < batch.size else batch   # only rows that draft run
        drafts, probs = self._draft(sub, [ks[b] for b in rows], K)
        return spread(batch.size, rows, drafts, probs, full_context)

    def _draft(self, batch, ks: list[int], K: int):
        """K autoregressive draft steps; a row stops being computed once it has its own k
        (the draft's cost follows sum(k), not rows x max(k)). -> ([B, K], [B, K, V] or None)."""
        cached = [self.model.cache_length(s) for s in batch.slots.tolist()]
        inputs, lens = pending_inputs(batch.token_ids, cached)             # [B, T], [B]
        device = self.model.device

        def step(i, sub, keep, previous):
            nonlocal inputs, lens
            if i > 0:      # each row's last draft (step 0 feeds its uncached committed tokens)
                inputs, lens = previous[:, None], torch.ones(len(keep), dtype=torch.long)
            logits = self.model.forward(sub.slots, inputs, lens)           # [L, T, V_draft]
            rows = torch.arange(len(keep), device=device)
            return align_vocab(logits[rows, lens.to(device) - 1], self.vocab_size)   # [L, V]
        return draft_steps(batch, ks, K, self.vocab_size, device, step)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        keep = [len(ids) - 1 for ids in batch.token_ids]
        self.model.truncate(batch.slots, keep)
