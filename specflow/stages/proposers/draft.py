"""`proposer=draft`: a smaller model sharing the target's tokenizer drafts k tokens autoregressively.

The draft caches a row only when the row drafts: its prompt (and whatever was committed while
the policy kept it at k = 0) is prefilled in one batched call before its first draft step. Each
draft step feeds every row's tokens that the draft has not cached yet (the committed tokens
after its cache, then the previous draft), shapes the logits with the pipeline's shape() exactly
as the target's will be shaped, and samples the draft from that shaped q; that same q goes to the
verifier. The draft cache is rolled back to the committed length in specflow_sync_cache.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from specflow.backends.lean.native import argmax
from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.proposers.draft_tree import Calibration, DraftTree, draft_trees, keep_accepted_path, learn
from specflow.stages.forward_inputs import catch_up, uncached_inputs, uncached_tokens
from specflow.stages.tree import no_branch_pays, tree_budget
from specflow.state import PAD, Proposal


def check_min_confidence(value: float | None, topk: int) -> None:
    """proposer.min_confidence: null, or a probability strictly between 0 and 1, for a chain."""
    if value is not None and not 0 < value < 1:
        raise ConfigError(f"proposer.min_confidence={value} must lie between 0 and 1 (e.g. 0.4), "
                          f"or be null for k drafts a row")
    if value is not None and topk > 1:
        raise ConfigError(f"proposer.min_confidence={value} stops a chain; with topk={topk} the "
                          f"tree keeps its likeliest nodes already: set one of them")


AUTO_VOCAB_FROM = 32768        # draft_vocab=auto cuts vocabularies from this size to their half


def draft_rows(setting, vocab: int) -> int | None:
    """proposer.draft_vocab as the count of first token ids the draft proposes among, or None
    for every token: auto halves a vocabulary of AUTO_VOCAB_FROM or more (there the LM head is
    a large share of a small draft's bytes; SmolLM2's 49,152-row head is 34 MB of the ~100
    its Q4_1 draft reads a step), keeps a smaller one whole."""
    if setting is None:
        return None
    if setting == "auto":
        return -(-vocab // 32) * 16 if vocab >= AUTO_VOCAB_FROM else None
    return setting if setting < vocab else None


@dataclass
class DraftProposerConfig:
    name: str = "draft"
    k: int = 4                 # most tokens drafted per round (a tree's depth)
    topk: int = 1              # > 1: an EAGLE-2 tree, each node's topk likeliest children
    num_draft_tokens: int | None = None   # nodes per row in a tree (default k)
    min_confidence: float | None = None   # a chain row stops after its first draft the draft
                               # model gives less than this probability (kept); null: k drafts
    draft_vocab: str | int | None = "auto"   # the draft proposes among the vocabulary's first
                               # this many token ids (its LM head reads those rows): auto (half
                               # a vocabulary of 32768 or more) | null (every token)

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        check_min_confidence(self.min_confidence, self.topk)
        if self.draft_vocab != "auto" and self.draft_vocab is not None and (
                isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                or self.draft_vocab < 1):
            raise ConfigError(f"proposer.draft_vocab={self.draft_vocab!r}; use auto, null (every "
                              f"token) or a count (>= 1) of the vocabulary's first token ids")
        self.nodes = tree_budget(self.k, self.topk, self.num_draft_tokens)


def draft_steps(batch, ks: list[int], K: int, vocab_size: int, device, step,
                min_confidence: float | None = None):
    """K autoregressive draft steps, shared by the proposers that run a model: a row stops being
    computed once it has its own ks[b] drafts (the cost follows sum(k), not rows x max(k)).

    step(i, sub, still_live, previous) -> the live rows' logits [L, V] on the target's vocabulary, where
    sub = the rows still drafting, still_live = their indices among the previous step's live rows (to
    cut a proposer's own per-row state), previous [L] = the tokens they drafted at step i - 1
    (None at i = 0). Each step's logits go through the pipeline's shape() and the draft is
    sampled from that very q. `min_confidence`: a row also stops after its first draft whose
    probability under q is below it (that draft kept; PAD after it).
    -> (drafts [B, K] long, q [B, K, V] or None under greedy)."""
    B = batch.size
    ks = list(ks)                            # a row that stops early gets a smaller k here
    drafts = torch.full((B, K), PAD, dtype=torch.long, device=device)              # [B, K]
    probs = None if batch.greedy else torch.zeros(B, K, vocab_size, device=device)
    live = list(range(B))                    # rows still drafting, as indices into batch
    sub = batch
    for i in range(K):
        still_live = [j for j, b in enumerate(live) if ks[b] > i]
        if not still_live:                         # every row stopped early (min_confidence)
            break
        if len(still_live) < len(live):            # some rows are done: drop them from the step
            live = [live[j] for j in still_live]
            sub = batch.select(live)
        idx = torch.tensor(live, device=device)                                     # [L]
        logits = step(i, sub, still_live, drafts[idx, i - 1] if i else None)             # [L, V]
        shaped = sub.shape(logits[:, None], drafts[idx, :i], first_draft_index=i,
                           source="draft")[:, 0]
        if batch.greedy:
            x = argmax(shaped)                                                      # [L]
        else:
            q = shaped.softmax(-1)                                                  # [L, V]
            x = sub.sample(q, i)                                                    # [L]
            probs[idx, i] = q
        drafts[idx, i] = x
        if min_confidence is not None and i + 1 < K:
            p = (shaped.softmax(-1) if batch.greedy else q).gather(1, x[:, None])[:, 0]  # [L]
            for b, low in zip(live, (p < min_confidence).tolist()):       # the round's read
                if low:
                    ks[b] = i + 1
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
        if cfg.topk > 1 and not self.model.supports_trees:
            raise ConfigError(f"proposer.topk={cfg.topk}: the draft backend "
                              f"{type(self.model).__name__} cannot score trees; use topk=1")
        self.trees: dict[int, DraftTree] = {}       # by slot, this round's tree rows
        # a backend's one-call steps that take min_confidence (a plugin's older greedy_steps
        # may not: its rounds then step through forward())
        self.steps_stop = "min_confidence" in inspect.signature(self.model.greedy_steps).parameters
        self.calibration = Calibration(cfg.topk)    # draft q -> acceptance, learned online
        self._cut_head(cfg.draft_vocab, ctx.target.vocab_size)

    def _cut_head(self, setting, V: int) -> None:
        """The draft's LM head cut to the vocabulary's first token ids (draft_vocab; V the
        target's vocabulary): a draft step reads those rows only. Byte-level BPE vocabularies
        list their tokens in merge order, the most frequent pieces first, so the first half
        holds nearly every token text needs (SmolLM2's own Q4_1 draft, 24,576 of 49,152:
        acceptance 0.978 -> 0.955, a draft step 17% fewer bytes). A draft can never propose a
        token past them; the verifier decides as always, so the output is unchanged (each
        draft is sampled from the q it is scored by: zero past the first ids)."""
        n = draft_rows(setting, V)
        if n is None:
            return
        lean = getattr(self.model, "lean", None)
        if lean is None or not lean.first_tokens(n):
            if setting == "auto":
                return
            raise ConfigError(f"proposer.draft_vocab={setting}: the draft's LM head is held in a "
                              f"layout it cannot be cut from (ATen's packed int4, oneDNN's packed "
                              f"rows, or no lean forward); use proposer.draft_vocab=null")
        note = f"drafting among the first {lean.lm_head.shape[0]} of {V} tokens " \
               f"(proposer.draft_vocab)"
        self.model.weights = note if self.model.weights is None else \
            f"{self.model.weights}; {note}"

    @hookimpl
    def specflow_draft_step_seconds(self, rows, positions):
        """A draft model's pass, timed now on its device (policy=goodput's prior); None for a
        simulated one (the synthetic model: its clock prices passes)."""
        if self.model.clock is not None:
            return None
        return self.model.time_pass(rows=rows, positions=positions)

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
        # rows whose draft cache lags by more than a round's worth (a new request: its prompt;
        # a row the policy kept at k = 0: those rounds' tokens) are prefilled first, so the
        # draft costs nothing while no row drafts and the first step feeds each row one or two
        # tokens instead of padding every row to the longest lag
        caught_up, _ = catch_up(self.model, sub.slots.tolist(), sub.token_ids, self.CATCH_UP)
        sub_ks = [ks[b] for b in rows]
        if self.cfg.topk > 1 and not no_branch_pays(sub):
            tokens, parents, trees = draft_trees(
                self.model, sub, sub_ks, self.cfg, self._first_logits(sub),
                lambda x: align_vocab(x, self.vocab_size), self.calibration, self.target_length)
            self.trees = dict(zip(sub.slots.tolist(), trees))
            proposal = Proposal.for_rows(batch.size, rows, tokens, None, full_context, parents)
        else:
            drafts, probs = self._draft(sub, sub_ks, K)
            proposal = Proposal.for_rows(batch.size, rows, drafts, probs, full_context)
            if self.cfg.min_confidence is None:
                proposal.draft_counts = ks   # each row drafted its k: the round reads no drafts
        proposal.catch_up_seconds = caught_up
        return proposal

    CATCH_UP = 2        # tokens a row may lag and still be fed by the first draft step

    @hookimpl
    def specflow_catch_up_tokens(self, batch):
        # per row, the tokens its draft cache lags beyond those the first step feeds for free:
        # what catch_up prefills before the row drafts (a new prompt, rounds kept at k = 0)
        return [max(0, len(ids) - self.model.cache_length(slot) - self.CATCH_UP)
                for slot, ids in zip(batch.slots.tolist(), batch.token_ids)]

    def _first_logits(self, batch) -> torch.Tensor:
        """The draft's logits after each row's committed tokens, feeding the ones it has not
        cached (at most CATCH_UP after catch_up): [B, V] on the target's vocabulary."""
        cached = [self.model.cache_length(s) for s in batch.slots.tolist()]
        inputs, lens, last = uncached_inputs(batch.token_ids, cached)     # [B, T], [B], [B]
        logits = self.model.forward(batch.slots, inputs, lens)             # [B, T, V_draft]
        rows = torch.arange(len(lens), device=logits.device)
        return align_vocab(logits[rows, last.to(logits.device)], self.vocab_size)   # [B, V]

    def _draft(self, batch, ks: list[int], K: int):
        """K autoregressive draft steps; a row stops being computed once it has its own k
        (the draft's cost follows sum(k), not rows x max(k)). -> ([B, K], [B, K, V] or None).
        Where shape() leaves every row's argmax alone (a greedy round with no bias, penalty or
        grammar on its rows), every step runs in one call of the backend's greedy_steps where
        it has one (the same tokens, without Python between the steps)."""
        stop = self.cfg.min_confidence
        if batch.shaping_keeps_argmax() and (stop is None or self.steps_stop):
            cached = [self.model.cache_length(s) for s in batch.slots.tolist()]
            extra = {} if stop is None else {"min_confidence": stop}
            drafts = self.model.greedy_steps(batch.slots.tolist(),
                                             uncached_tokens(batch.token_ids, cached), ks,
                                             self.vocab_size, **extra)             # [B, K]
            if drafts is not None:
                return drafts.to(self.model.device), None

        def step(i, sub, still_live, previous):
            if i == 0:     # every row, fed its uncached committed tokens
                return self._first_logits(sub)                             # [L, V]
            # each row's last draft
            logits = self.model.forward(sub.slots, previous[:, None],
                                        torch.ones(len(still_live), dtype=torch.long))  # [L, 1, V_d]
            return align_vocab(logits[:, 0], self.vocab_size)              # [L, V]
        return draft_steps(batch, ks, K, self.vocab_size, self.model.device, step, stop)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        if self.trees:
            if result.accepted_nodes is not None:
                slots = batch.slots.tolist()
                learn(self.calibration, self.trees, slots, result.accepted_nodes,
                      batch.greedy or batch.draws_by_position)
                keep_accepted_path(self.model, slots, self.trees, result.accepted_nodes)
            self.trees = {}
        keep = [len(ids) - 1 for ids in batch.token_ids]
        self.model.truncate(batch.slots, keep)
