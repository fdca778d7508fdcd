"""`proposer=eagle`: an EAGLE-3 head drafts from the target's own hidden states.

The target's pass hands out the inputs of the head's three layers at every position it scores
(`HFBackend.capture_layers`, no extra forward); they wait here per slot until their position is
committed. Each round the head first reads the pairs (target state at t, committed token t + 1)
it has not seen — the prompt after prefill, then the accepted drafts and the bonus token of the
last round — into its own slot cache, then drafts k tokens feeding back its own state. Its draft
steps are dropped from its cache after the round's drafting (they rest on its own states, not
the target's), so rollback is only a length change.

Draft logits live on a reduced vocabulary; they are placed into the target's vocabulary (-inf
elsewhere) before the pipeline's shape() call, so processors, penalties and grammar masks apply
to the head's q exactly as to the target's, and the draft is sampled from the very q the
verifier receives.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.models.slot_cache import SlotKVCache
from specflow.plugins import hookimpl
from specflow.stages.tree import tree_budget
from specflow.stages.proposers.draft import draft_steps, spread
from specflow.state import Proposal

DEMO_HEAD = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "eagle"


@dataclass
class EagleProposerConfig:
    name: str = "eagle"
    k: int = 4                   # most tokens drafted per round
    path: str | None = None      # an EAGLE-3 head folder; null = the shipped demo head (demo target)
    topk: int = 1                # trees: not built by the head yet (proposer=draft / ngram are)
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        tree_budget(self.k, self.topk, self.num_draft_tokens)
        if self.topk > 1:
            raise ConfigError(f"proposer.topk={self.topk}: proposer=eagle drafts chains only so "
                              f"far; set proposer.topk=1, or use proposer=draft or proposer=ngram "
                              f"for token trees")


def demo_head_for(target) -> str | None:
    """The shipped head's folder when `target` is the embedded demo target."""
    from specflow.models.hf import DEMO_DIR

    try:
        same = pathlib.Path(target.path).resolve() == (DEMO_DIR / "target").resolve()
    except (OSError, TypeError):
        return None
    return str(DEMO_HEAD) if same and (DEMO_HEAD / "config.json").is_file() else None


class EagleProposer:
    def __init__(self, cfg: EagleProposerConfig, ctx):
        from specflow.models.eagle_head import load_head
        from specflow.models.hf import HFBackend

        target = ctx.target
        if not isinstance(target, HFBackend):
            raise ConfigError(f"proposer=eagle reads the hidden states of a transformers target; "
                              f"model={ctx.cfg.model.name} has none: use model=demo (or hf), or "
                              f"proposer=draft")
        path = cfg.path or demo_head_for(target)
        if path is None:
            raise ConfigError(f"proposer=eagle needs a head for {target.path!r}: set "
                              f"proposer.path=<folder with an EAGLE-3 head> (train one with "
                              f"`specflow train-head`); only the demo target has one built in")
        self.cfg = cfg
        self.head = load_head(path, target, target.device, target.model.dtype)
        target.capture_layers = tuple(self.head.shape.layer_ids)
        target.hidden_sink = self._sink
        self.cache = SlotKVCache(1, ctx.slots, target.cache.max_capacity)
        self.pending: dict[int, list] = {}    # slot -> [(first position, [n, nE]), ...]
        self.vocab_size = target.vocab_size
        self.draft_ids = self.head.draft_ids                      # [Vd] target id of each entry
        self.device = target.device
        ctx.draft_step_seconds = self.step_seconds                # for policy=goodput's prior

    @torch.inference_mode()
    def step_seconds(self, rows: int, reps: int = 5, context: int = 64) -> float:
        """Seconds of one draft step for `rows` rows (the head's forward of one pair each over a
        `context`-pair cache, and its logits on the target's vocabulary), the median of `reps`
        after a warm-up; the cache rows it used are emptied again."""
        import statistics
        import time

        shape = self.head.shape
        slots = list(range(rows))
        dtype = self.head.fc.weight.dtype
        width = len(shape.layer_ids) * shape.target_hidden_size
        for s in slots:
            self.cache.reset(s)
        self._forward(slots, torch.zeros(rows, context, width, dtype=dtype, device=self.device),
                      torch.zeros(rows, context, dtype=torch.long, device=self.device),
                      [context] * rows)
        g = torch.zeros(rows, 1, shape.hidden_size, dtype=dtype, device=self.device)
        token = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            out = self._forward(slots, g, token, [1] * rows)
            self._on_target_vocab(self.head.logits(out[:, 0]).float())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
            self.cache.truncate(slots, [context] * rows)
        for s in slots:
            self.cache.reset(s)
        return statistics.median(times[1:])

    # --- the target's hidden states, kept until their positions are read --------------------

    def _sink(self, slots: list[int], starts: list[int], lens: list[int],
              hidden: torch.Tensor) -> None:
        """hidden [B, T, nE]: row b's states for positions starts[b] .. starts[b] + lens[b].
        Kept as chunks (a row that does not draft for a while gathers one per round; they are
        joined once, when the head reads them)."""
        for b, (slot, p, n) in enumerate(zip(slots, starts, lens)):
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

    # --- drafting ----------------------------------------------------------------------------

    @hookimpl
    def specflow_propose(self, batch, k):
        asked = k.tolist()
        slots = batch.slots.tolist()
        # a row can draft once the target has scored at least one of its positions
        ready = [self._have(s, len(ids)) for s, ids in zip(slots, batch.token_ids)]
        ks = [kb if ok else 0 for kb, ok in zip(asked, ready)]
        rows = [b for b, kb in enumerate(ks) if kb > 0]
        K = max(ks, default=0)
        reasons = ["no target state yet" if a > 0 and not ok else None
                   for a, ok in zip(asked, ready)]
        if K == 0:
            return Proposal(Proposal.empty(batch.size).draft_token_ids, None, reasons)
        sub = batch.select(rows) if len(rows) < batch.size else batch
        drafts, probs = self._draft(sub, [ks[b] for b in rows], K)
        return spread(batch.size, rows, drafts, probs, reasons)

    def _have(self, slot: int, length: int) -> bool:
        """The target's states cover every pair the head has not read (positions up to length-2)."""
        chunks = self.pending.get(slot)
        first = self.cache.lengths[slot]
        if first >= length - 1 or not chunks:
            return False      # nothing new to read (a one-token prompt before its first pass)
        end = chunks[-1][0] + len(chunks[-1][1])
        return chunks[0][0] <= first and end >= length - 1

    def _forward(self, slots: list[int], h: torch.Tensor, tokens: torch.Tensor,
                 lens: list[int]) -> torch.Tensor:
        """Pairs (h [B, T, E or nE], tokens [B, T]) into the head's cache -> pre-norm states
        [B, T, E]; row b uses its first lens[b] pairs."""
        head = self.head
        B, T = tokens.shape
        positions, kv_len = self.cache.begin(slots, lens, T, self.device)             # [B, T]
        x = head.layer_input(h)                                                       # [B, T, E]
        q, k, v = head.qkv(x, tokens, positions, kv_len)        # every position < kv_len
        k_all, v_all = self.cache.update(k, v, 0)                                     # [B, Hkv, L, D]
        mask = None
        if not (B == 1 and T == 1):
            keys = torch.arange(kv_len, device=self.device)
            mask = (keys[None, None, :] <= positions[:, :, None])[:, None]           # [B, 1, T, L]
        out = head.finish(x, head.attend(q, k_all, v_all, mask))
        self.cache.commit(slots, lens)
        return out

    def _on_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [L, Vd] placed on the target's vocabulary [L, V] (-inf else)."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_ids] = logits
        return full

    @torch.inference_mode()
    def _draft(self, batch, ks: list[int], K: int):
        """Read the unread pairs, then K draft steps; a row stops once it has its own k.
        -> ([B, K] long, [B, K, V] or None)."""
        B = batch.size
        slots = batch.slots.tolist()
        device = self.device
        # the pairs each row has not read: target states at t, tokens at t + 1, t < length - 1
        starts = [self.cache.lengths[s] for s in slots]
        ends = [len(ids) - 1 for ids in batch.token_ids]
        lens = [e - s for s, e in zip(starts, ends)]
        T = max(lens)
        width = self.pending[slots[0]][0][1].shape[-1]
        h = torch.zeros(B, T, width, dtype=self.head.fc.weight.dtype, device=device)  # [B, T, nE]
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
        read = [self.cache.lengths[s] for s in slots]     # pairs resting on the target's states

        def step(i, sub, keep, previous):
            nonlocal g
            if len(keep) < g.shape[0]:
                g = g[keep]
            if i > 0:   # the head's own state and the token it just drafted, one position on
                g = self._forward(sub.slots.tolist(), g, previous[:, None], [1] * len(keep))
            return self._on_target_vocab(self.head.logits(g[:, 0]).float())            # [L, V]
        drafts, probs = draft_steps(batch, ks, K, self.vocab_size, device, step)
        self.cache.truncate(slots, read)      # draft steps rest on the head's states: drop them
        return drafts, probs
