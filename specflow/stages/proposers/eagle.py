"""`proposer=eagle`: an EAGLE-3 head drafts from the target's own hidden states.

The head asks for the inputs of its layers (usually three; distinct, in layer order) through
specflow_hidden_layers; every target pass the pipeline runs (prefill and scoring) then hands
them out through specflow_target_states (no extra forward); they wait here per slot until their
position is committed. Each round the head first reads the pairs (target
state at t, committed token t + 1) it has not seen — the prompt after prefill, then the accepted
drafts and the bonus token of the last round — into its own slot cache, then drafts k tokens
feeding back its own state. Its draft steps are dropped from its cache after the round's
drafting (they rest on its own states, not the target's), so rollback is only a length change.

Draft logits live on a reduced vocabulary; they are placed into the target's vocabulary (-inf
elsewhere) before the pipeline's shape() call, so processors, penalties and grammar masks apply
to the head's q exactly as to the target's, and the draft is sampled from the very q the
verifier receives.

With proposer.topk > 1 the head drafts a token tree, EAGLE-2 style (draft_tree.build_trees, as
for a draft model): each frontier node is fed its parent's head state with its own token, under
tree attention over the head's cache. After a target tree pass the target's states arrive in
node order; the accepted path's are moved into place (as the target's cache is), so the next
round reads the states of the committed tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.backends.plan import make_plan
from specflow.backends.slot_cache import SlotKVCache
from specflow.plugins import hookimpl
from specflow.stages.proposers.draft import check_min_confidence, draft_steps
from specflow.stages.proposers.draft_tree import Calibration, DraftTree, draft_trees, learn
from specflow.stages.tree import no_branch_pays, tree_budget
from specflow.state import Proposal


# proposer.dtype: None = the head's weights as saved (draft numerics never change the output's
# distribution, only how often drafts are accepted)
HEAD_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16, "int8": None, "int4": None}
HEAD_BITS = {"int8": 8, "int4": 4}     # weights in GGUF blocks: the native step only
# auto beside a float32 target, where the native step runs: Q8_0 blocks (half of float16's bytes a
# step reads; acceptance as the saved weights', docs/heads.md), else the head as saved
AUTO_BITS = 8


def head_dtype(setting: str, target) -> torch.dtype | None:
    """proposer.dtype -> the head's dtype (None: as saved). auto follows a 16-bit target (a GPU's
    usual case, as vLLM and SGLang run a head: no mixed float16 / bfloat16 ranges), and otherwise
    keeps the head as saved: beside a float32 target on a CPU, a float16 head's step reads half
    the bytes."""
    chosen = HEAD_DTYPES[setting]
    if chosen is None and target.dtype in (torch.float16, torch.bfloat16):
        return target.dtype
    return chosen


@dataclass
class EagleProposerConfig:
    name: str = "eagle"
    k: int = 4                   # most tokens drafted per round (a tree's depth)
    path: str | None = None      # an EAGLE-3 head folder; null = the shipped demo head (demo target)
    topk: int = 1                # > 1: an EAGLE-2 tree, each node's topk likeliest children
    num_draft_tokens: int | None = None   # nodes per row in a tree (default k)
    dtype: str = "auto"          # the head's weights: auto (a 16-bit target's dtype; else int8
                                 # blocks where the native step runs, else as saved) | float32 |
                                 # bfloat16 | float16 | int8 | int4
    min_confidence: float | None = None   # a chain row stops after its first draft the head
                                 # gives less than this probability (kept); null: k drafts

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        check_min_confidence(self.min_confidence, self.topk)
        if self.dtype not in HEAD_DTYPES:
            raise ConfigError(f"proposer.dtype={self.dtype!r}; use auto (the head as saved, or the target's "
                              f"16-bit dtype), float32, bfloat16, float16, int8 or int4")
        self.nodes = tree_budget(self.k, self.topk, self.num_draft_tokens)


class EagleProposer:
    def __init__(self, cfg: EagleProposerConfig, ctx):
        from specflow.backends.heads.eagle import demo_head_for, load_head, missing_head

        target = ctx.target            # None inside vLLM (vllm/stages.py): refused in one line
        if target is None or not target.supports_hidden_states or target.input_embeddings() is None:
            raise ConfigError(f"proposer=eagle reads the hidden states of a transformers target; "
                              f"model={ctx.cfg.model.name} has none: use model=demo (or hf), or "
                              f"proposer=draft")
        path = cfg.path or demo_head_for(target)
        if path is None:
            raise missing_head(target.path)
        self.cfg = cfg
        self.path = path
        self.head = load_head(path, target, target.device, head_dtype(cfg.dtype, target))
        # the head's step as native calls where the kernel builds (float32 activations)
        from specflow.backends.heads.native_step import NativeHead

        blocks = cfg.dtype == "auto" and head_dtype(cfg.dtype, target) is None
        self.bits = HEAD_BITS.get(cfg.dtype, AUTO_BITS if blocks else None)
        self.native = NativeHead.build(self.head, target.device, self.bits)
        if self.native is None and blocks:     # no block step (a width off 32): as saved
            self.bits = None
            self.native = NativeHead.build(self.head, target.device)
        if self.native is None and cfg.dtype in HEAD_BITS:
            raise ConfigError(f"proposer.dtype={cfg.dtype} holds the head in GGUF blocks for "
                              f"specflow's native kernel, which does not run here (a CPU target "
                              f"and a C compiler); use proposer.dtype=auto")
        self.dtype = torch.float32 if self.native is not None else self.head.fc.weight.dtype
        self.layers = tuple(self.head.shape.layer_ids)    # read in layer order (load_head)
        self.cache = SlotKVCache(1, ctx.slots, (target.max_length or 1 << 16) + 64)
        self.pending: dict[int, list] = {}    # slot -> [(first position, [n, nE]), ...]
        self.vocab_size = target.vocab_size
        self.draft_ids = self.head.draft_ids                      # [Vd] target id of each entry
        ids = self.draft_ids.cpu().long().contiguous()
        # the greedy steps as one native call take the argmax in draft order: the same token
        # as on the target's vocabulary where the entries' ids increase
        self.chain_ids = ids if bool((ids[1:] > ids[:-1]).all()) else None       # [Vd]
        self.device = target.device
        self.target_length = target.max_length
        self.trees: dict[int, DraftTree] = {}       # by slot, this round's tree rows
        self.calibration = Calibration(cfg.topk)    # head q -> acceptance, learned online

    def describe(self) -> dict:
        """The head that drafts (metrics.json `backends.proposer`)."""
        dtype = f"int{self.bits}" if self.bits else \
            str(self.head.fc.weight.dtype).removeprefix("torch.")
        return {"head": str(self.path), "dtype": dtype,
                "draft_vocab_size": self.head.shape.draft_vocab_size,
                "step": "native (float32 activations)" if self.native is not None else "torch"}

    @torch.inference_mode()
    def step_seconds(self, rows: int, reps: int = 5, context: int = 64, positions: int = 1) -> float:
        """Seconds of one draft step for `rows` rows (the head's forward of `positions` pairs
        each over a `context`-pair cache, and their logits on the target's vocabulary), the
        median of `reps` after a warm-up; the cache rows it used are emptied again."""
        import statistics
        import time

        shape = self.head.shape
        slots = list(range(rows))
        dtype = self.dtype
        width = len(shape.layer_ids) * shape.target_hidden_size
        for s in slots:
            self.cache.reset(s)
        self._forward(slots, torch.zeros(rows, context, width, dtype=dtype, device=self.device),
                      torch.zeros(rows, context, dtype=torch.long, device=self.device),
                      [context] * rows)
        g = torch.zeros(rows, positions, shape.hidden_size, dtype=dtype, device=self.device)
        token = torch.zeros(rows, positions, dtype=torch.long, device=self.device)
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            out = self._forward(slots, g, token, [positions] * rows)
            self._on_target_vocab(self._logits(out).flatten(0, 1).float())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
            self.cache.truncate(slots, [context] * rows)
        for s in slots:
            self.cache.reset(s)
        return statistics.median(times[1:])

    @hookimpl
    def specflow_draft_step_seconds(self, rows, positions):
        """A head's draft step, timed now (policy=goodput's prior)."""
        return self.step_seconds(rows, positions=positions)

    # --- the target's hidden states, kept until their positions are read --------------------

    @hookimpl
    def specflow_hidden_layers(self):
        return list(self.layers)

    @hookimpl
    def specflow_target_states(self, states):
        """Row b's states for positions starts[b] .. starts[b] + lens[b] - 1, kept as chunks (a
        row that does not draft for a while gathers one per round; they are joined once, when
        the head reads them)."""
        hidden = states.select(self.layers)                                           # [B, T, nE]
        for b, (slot, p, n) in enumerate(zip(states.slots, states.starts, states.lens)):
            if n == 0:
                continue
            chunks = self.pending.setdefault(slot, [])
            while chunks and chunks[-1][0] >= p:          # positions from p on are rewritten
                chunks.pop()
            if chunks and chunks[-1][0] + len(chunks[-1][1]) > p:
                first, states = chunks[-1]
                chunks[-1] = (first, states[:p - first])
            chunks.append((p, hidden[b, :n]))

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.cache.reset(slot)
        self.pending.pop(slot, None)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.cache.reset(slot)
        self.pending.pop(slot, None)
        self.trees.pop(slot, None)

    # --- drafting ----------------------------------------------------------------------------

    @hookimpl
    def specflow_propose(self, batch, k):
        asked = k.tolist()
        slots = batch.slots.tolist()
        self.trees = {}
        # a row can draft once the target has scored at least one of its positions; a depth-k
        # tree writes up to topk (k - 1) head entries after the len - 1 committed pairs
        ready = [self._have(s, len(ids)) for s, ids in zip(slots, batch.token_ids)]
        room = [1 + (self.cache.max_capacity - len(ids) + 1) // self.cfg.topk
                for ids in batch.token_ids]
        ks = [min(kb, r) if ok else 0 for kb, ok, r in zip(asked, ready, room)]
        rows = [b for b, kb in enumerate(ks) if kb > 0]
        K = max(ks, default=0)
        reasons = [None if a == 0 or kb > 0 else "no target state yet" if not ok
                   else "draft context full" for a, kb, ok in zip(asked, ks, ready)]
        if K == 0:
            return Proposal(Proposal.empty(batch.size).draft_token_ids, None, reasons)
        sub = batch.select(rows) if len(rows) < batch.size else batch
        sub_ks = [ks[b] for b in rows]
        if self.cfg.topk > 1 and not no_branch_pays(sub):
            tokens, parents = self._tree(sub, sub_ks)
            return Proposal.for_rows(batch.size, rows, tokens, None, reasons, parents)
        drafts, probs = self._draft(sub, sub_ks, K)
        proposal = Proposal.for_rows(batch.size, rows, drafts, probs, reasons)
        if self.cfg.min_confidence is None:
            proposal.draft_counts = ks   # each row drafted its k: the round reads no drafts
        return proposal

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        if result.accepted_nodes is not None:
            # a tree pass sent its states in node order: keep the accepted path's, in place
            base = result.path_starts(batch.token_ids)
            self._keep_path(batch.slots.tolist(), base, result.accepted_nodes)
        if self.trees and result.accepted_nodes is not None:      # the verdicts teach it
            learn(self.calibration, self.trees, batch.slots.tolist(), result.accepted_nodes,
                  batch.greedy or batch.draws_by_position)
        self.trees = {}

    def _keep_path(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
        """After a target tree pass (root at base - 1, node i at base + i, states sent in that
        order): the pending states of positions base + pick[i] move to base + i and the rest of
        the pass's are dropped, as the target cache's keys and values are (keep_cached)."""
        for slot, b, pick in zip(slots, base, picks):
            chunks = self.pending.get(slot)
            if not pick or pick == list(range(len(pick))) or not chunks:
                continue
            first, states = chunks[-1]                    # the tree pass's chunk (root first)
            assert first == b - 1 and b - first + max(pick) < len(states), \
                f"slot {slot}: the tree pass's states start at {first}, not at the root {b - 1}"
            src = torch.tensor(pick, device=states.device) + (b - first)             # [n]
            chunks[-1] = (first, torch.cat([states[:b - first], states.index_select(0, src)]))

    def _have(self, slot: int, length: int) -> bool:
        """The target's states cover every pair the head has not read (positions up to length-2)."""
        chunks = self.pending.get(slot)
        first = self.cache.lengths[slot]
        if first >= length - 1 or not chunks:
            return False      # nothing new to read (a one-token prompt before its first pass)
        end = chunks[-1][0] + len(chunks[-1][1])
        return chunks[0][0] <= first and end >= length - 1

    def _forward(self, slots: list[int], h: torch.Tensor, tokens: torch.Tensor,
                 lens: list[int], tree=None) -> torch.Tensor:
        """Pairs (h [B, T, E or nE], tokens [B, T]) into the head's cache -> pre-norm states
        [B, T, E]; row b uses its first lens[b] pairs. With a tree (models.base.TreeAttention)
        the pairs sit at its positions and see what it marks."""
        head = self.head
        B, T = tokens.shape
        plan = make_plan(slots, [self.cache.lengths[s] for s in slots], tokens, lens,
                         self.device, tree)
        self.cache.begin(plan)
        positions, kv_len = plan.positions, plan.kv_len                                # [B, T]
        if self.native is not None:                                # two native calls
            cos, sin = head.rope(positions, torch.float32, kv_len)                    # [B, 1, T, D]
            out = self.native.layer(self.native.layer_input(h), tokens, self.cache, cos, sin)
            if out is not None:
                self.cache.commit(slots, lens)
                return out                                                            # [B, T, E]
            h = h.to(head.fc.weight.dtype)          # the eager step, in the head's dtype
        x = head.layer_input(h)                                                       # [B, T, E]
        q, k, v = head.qkv(x, tokens, positions, kv_len)        # every position < kv_len
        k_all, v_all = self.cache.update(k, v, 0)                                     # [B, Hkv, L, D]
        mask = None
        if tree is not None:
            mask = tree.allowed(kv_len).to(self.device)[:, None]                      # [B, 1, T, L]
        elif not (B == 1 and T == 1):
            keys = torch.arange(kv_len, device=self.device)
            mask = (keys[None, None, :] <= positions[:, :, None])[:, None]           # [B, 1, T, L]
        out = head.finish(x, head.attend(q, k_all, v_all, mask))
        self.cache.commit(slots, lens)
        return out.to(self.dtype)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] of the head's pre-norm states [.., E]."""
        if self.native is not None:
            return self.native.logits(h)
        return self.head.logits(h)

    def _on_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [L, Vd] placed on the target's vocabulary [L, V] (-inf else)."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_ids] = logits
        return full

    @torch.inference_mode()
    def _read(self, batch) -> tuple[torch.Tensor, list[int]]:
        """Each row's unread pairs into the head's cache. -> (the head's state after the last
        committed pair [B, 1, E], each row's cache length then)."""
        B = batch.size
        slots = batch.slots.tolist()
        device = self.device
        # the pairs each row has not read: target states at t, tokens at t + 1, t < length - 1
        starts = [self.cache.lengths[s] for s in slots]
        ends = [len(ids) - 1 for ids in batch.token_ids]
        lens = [e - s for s, e in zip(starts, ends)]
        T = max(lens)
        width = self.pending[slots[0]][0][1].shape[-1]
        h = torch.zeros(B, T, width, dtype=self.dtype, device=device)                 # [B, T, nE]
        tokens = torch.zeros(B, T, dtype=torch.long)                                  # [B, T]
        for b, (s, a, e) in enumerate(zip(slots, starts, ends)):
            chunks = self.pending.pop(s)                   # all read: later positions come next pass
            first = chunks[0][0]
            states = chunks[0][1] if len(chunks) == 1 else torch.cat([c for _, c in chunks])
            h[b, :e - a] = states[a - first:e - first]
            tokens[b, :e - a] = torch.tensor(batch.token_ids[b][a + 1:e + 1])
        out = self._forward(slots, h, tokens.to(device), lens)                         # [B, T, E]
        rows = torch.arange(B, device=device)
        g = out[rows, torch.tensor(lens, device=device) - 1][:, None]                 # [B, 1, E]
        return g, [self.cache.lengths[s] for s in slots]

    @torch.inference_mode()
    def _draft(self, batch, ks: list[int], K: int):
        """Read the unread pairs, then K draft steps; a row stops once it has its own k.
        -> ([B, K] long, [B, K, V] or None)."""
        slots = batch.slots.tolist()
        g, read = self._read(batch)         # read: pairs resting on the target's states
        if self.native is not None and self.chain_ids is not None \
                and batch.shaping_keeps_argmax():     # every step in one native call
            drafts = self.native.chain(self.head, g[:, 0], self.cache, slots, ks, self.chain_ids,
                                       self.cfg.min_confidence)
            if drafts is not None:
                return drafts.to(self.device), None

        def step(i, sub, still_live, previous):
            nonlocal g
            if len(still_live) < g.shape[0]:
                g = g[still_live]
            if i > 0:   # the head's own state and the token it just drafted, one position on
                g = self._forward(sub.slots.tolist(), g, previous[:, None], [1] * len(still_live))
            return self._on_target_vocab(self._logits(g[:, 0]).float())                # [L, V]
        drafts, probs = draft_steps(batch, ks, K, self.vocab_size, self.device, step,
                                    self.cfg.min_confidence)
        self.cache.truncate(slots, read)      # draft steps rest on the head's states: drop them
        return drafts, probs

    @torch.inference_mode()
    def _tree(self, batch, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the unread pairs, then a tree per row. -> (tokens [B, N], parents [B, N])."""
        slots = batch.slots.tolist()
        g, read = self._read(batch)                                                   # [B, 1, E]
        first = self._on_target_vocab(self._logits(g[:, 0]).float())                  # [B, V]
        try:
            tokens, parents, trees = draft_trees(
                _HeadTree(self, slots, g[:, 0], self.cfg.topk * (max(ks) - 1)), batch, ks,
                self.cfg, first, self._on_target_vocab, self.calibration, self.target_length)
        finally:
            self.cache.truncate(slots, read)  # tree entries rest on the head's states: dropped
        self.trees = dict(zip(slots, trees))
        return tokens, parents


class _HeadTree:
    """The head as the draft model build_trees drives: a node's input pair is its parent's head
    state (the state after the committed pairs for a child of the root) and its own token."""

    def __init__(self, proposer: EagleProposer, slots: list[int], roots: torch.Tensor,
                 entries: int):
        """roots [B, E]: each row's state after its committed pairs; `entries`: the most tree
        entries a row writes (topk per level below the deepest)."""
        self.proposer = proposer
        self.row = {s: b for b, s in enumerate(slots)}
        self.base = [proposer.cache.lengths[s] for s in slots]   # tree entries are written after
        # [B, 1 + entries, E]: the root's state, then each fed entry's output in entry order
        self.states = roots.new_zeros(roots.shape[0], 1 + max(entries, 1), roots.shape[1])
        self.states[:, 0] = roots

    def cache_length(self, slot: int) -> int:
        return self.proposer.cache.lengths[slot]

    def forward(self, slots: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor,
                tree=None) -> torch.Tensor:
        """ids [L, T] (PAD after lens[b]) -> draft logits [L, T, Vd]. Without a tree each row
        feeds one node, the child of its last fed one."""
        slot_list, n = slots.tolist(), lens.tolist()
        L, T = ids.shape
        rows = [self.row[s] for s in slot_list]
        fed = torch.tensor([self.cache_length(s) - self.base[r]                        # [L]
                            for s, r in zip(slot_list, rows)])
        # where each query's parent state is (entry e at e + 1, the root at 0), and where its
        # output goes (a padding query's lands past the row's entries: never read)
        device = self.proposer.device
        at = fed[:, None] + 1 + torch.arange(T)[None, :]                               # [L, T]
        r, dst = torch.stack([torch.tensor(rows)[:, None].expand(L, T), at]).to(device)
        src = (fed[:, None] if tree is None else tree.parent + 1).to(device)           # [L, T]
        h = self.states[r, src]                                                        # [L, T, E]
        out = self.proposer._forward(slot_list, h, ids.clamp(min=0).to(device), n, tree)   # [L, T, E]
        self.states[r, dst] = out
        return self.proposer._logits(out).float()                                      # [L, T, Vd]
