"""`proposer=draft`: a smaller model sharing the target's tokenizer drafts k tokens autoregressively.

The draft caches a row only when the row drafts: its prompt (and whatever was committed while
the policy kept it at k = 0) is prefilled in one batched call before its first draft step. Each
draft step feeds every row's tokens that the draft has not cached yet (the committed tokens
after its cache, then the previous draft), shapes the logits with the pipeline's shape() exactly
as the target's will be shaped, and samples the draft from that shaped q; that same q goes to the
verifier. The draft cache is rolled back to the committed length in specflow_sync_cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.proposers.draft_tree import Calibration, DraftTree, build_trees, keep_path
from specflow.stages.tree import node_budgets, tree_budget
from specflow.stages.sampling import sample_categorical
from specflow.state import PAD, Proposal


@dataclass
class DraftProposerConfig:
    name: str = "draft"
    k: int = 4                 # most tokens drafted per round (a tree's depth)
    topk: int = 1              # > 1: an EAGLE-2 tree, each node's topk likeliest children
    num_draft_tokens: int | None = None   # nodes per row in a tree (default k)

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        self.nodes = tree_budget(self.k, self.topk, self.num_draft_tokens)


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
        self.target_length = ctx.target.max_length
        if cfg.topk > 1 and not getattr(self.model, "supports_trees", False):
            raise ConfigError(f"proposer.topk={cfg.topk}: the draft backend "
                              f"{type(self.model).__name__} cannot score trees; use topk=1")
        self.trees: dict[int, DraftTree] = {}       # by slot, this round's tree rows
        self.calibration = Calibration(cfg.topk)    # draft q -> acceptance, learned online

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.model.reset(slot)

    def _room(self, batch, k: torch.Tensor) -> list[int]:
        """k per row, cut where the draft's own context ends (it may be shorter than the
        target's); a tree writes up to topk entries per level."""
        ks = k.tolist()
        limit = self.model.max_length
        if limit is None:
            return ks
        return [max(0, min(kb, (limit - len(ids)) // self.cfg.topk))
                for kb, ids in zip(ks, batch.token_ids)]

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
        caught_up = self._catch_up(sub)
        if self.cfg.topk > 1:
            proposal = self._tree(batch, sub, rows, [ks[b] for b in rows], full_context)
        else:
            drafts, probs = self._draft(sub, [ks[b] for b in rows], K)
            proposal = spread(batch.size, rows, drafts, probs, full_context)
        proposal.catch_up_seconds = caught_up
        return proposal

    def _tree(self, batch, sub, rows: list[int], ks: list[int], reasons) -> Proposal:
        """EAGLE-2 trees for the drafting rows (draft_tree.py), placed into the whole batch."""
        room = [None if self.target_length is None else self.target_length - len(ids)
                for ids in sub.token_ids]
        budgets = node_budgets(ks, self.cfg.k, self.cfg.nodes, room)
        cached = [self.model.cache_length(s) for s in sub.slots.tolist()]
        inputs, lens = pending_inputs(sub.token_ids, cached)                # [R, T], [R]
        logits = self.model.forward(sub.slots, inputs, lens)                # [R, T, V_draft]
        last = align_vocab(logits[torch.arange(len(rows)), lens.to(logits.device) - 1],
                           self.vocab_size)                                 # [R, V]
        tokens, parents, trees = build_trees(
            self.model, sub, ks, budgets, self.cfg.topk, last,
            lambda x: align_vocab(x, self.vocab_size), self.calibration)
        self.trees = dict(zip(sub.slots.tolist(), trees))
        N = tokens.shape[1]
        ids = torch.full((batch.size, N), PAD, dtype=torch.long)
        par = torch.full((batch.size, N), PAD, dtype=torch.long)
        ids[rows], par[rows] = tokens, parents
        return Proposal(ids, None, reasons, parents=par)

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

    def _catch_up(self, batch) -> float:
        """Rows whose draft cache lags by more than a round's worth (a new request: its prompt;
        a row the policy kept at k = 0 for a while: those rounds' tokens) are cached first by
        the model's batched prefill, up to their last committed token. The draft runs only for
        rows that draft: under load, when the policy sets k = 0, it costs nothing at all, and
        the first step below feeds every row one or two tokens instead of padding all rows to
        the longest lag. -> the seconds it took (0.0 when no row lagged)."""
        slots = batch.slots.tolist()
        lagging = [(s, ids[n:-1]) for s, ids in zip(slots, batch.token_ids)
                   if len(ids) - (n := self.model.cache_length(s)) > self.CATCH_UP]
        if not lagging:
            return 0.0
        start = time.perf_counter()
        self.model.prefill_many([s for s, _ in lagging], [ids for _, ids in lagging])
        return time.perf_counter() - start

    CATCH_UP = 2        # tokens a row may lag and still be fed by the first draft step

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        if self.trees:
            if result.accepted_nodes is not None:
                keep_path(self.model, batch.slots.tolist(), self.trees, result.accepted_nodes,
                          self.calibration, batch.greedy)
            self.trees = {}
        keep = [len(ids) - 1 for ids in batch.token_ids]
        self.model.truncate(batch.slots, keep)
