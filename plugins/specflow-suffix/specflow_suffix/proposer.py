"""`proposer=suffix`: suffix decoding (model-free drafts from suffix tries), as in ArcticInference.

Two kinds of tree (specflow_suffix.tree.SuffixTree) propose drafts:

- a per-request tree for each slot over the request's prompt and generated tokens: built in
  specflow_request_start, extended with the committed tokens in specflow_sync_cache;
- one global tree over the prompt + output tokens of earlier finished requests (inserted in
  specflow_request_end, at most ``max_cached_requests`` of them, oldest evicted first), optionally
  loaded from ``cache_path`` when the pipeline is built and saved there at the end of every
  ``generate`` call, so a run sees every earlier run's requests.

Each round, every row with k_b > 0 speculates from both trees with at most min(k_b, k) tokens and
keeps the draft with the higher score (expected accepted tokens). Drafts are deterministic
(draft_probs=None), so verification is exact under greedy and sampling alike.
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Optional

import torch

from specflow import PAD, ConfigError, Proposal, atomic_write_text, hookimpl

from specflow_suffix.tree import SuffixTree

CACHE_FORMAT = "specflow-suffix-cache"
CACHE_VERSION = 1


@dataclass
class SuffixProposerConfig:
    name: str = "suffix"
    k: int = 12                    # most tokens drafted per round (the static policy's k)
    max_depth: int = 24            # longest suffix matched, and depth of the tries (Arctic's)
    max_spec_factor: float = 1.0   # draft length <= ceil(max_spec_factor x match length)
    min_token_prob: float = 0.1    # stop drafting when the draft prefix's estimated prob drops below
    max_cached_requests: int = 200   # finished requests the global tree keeps (FIFO); 0 = none
    use_global: bool = True        # also draft from earlier finished requests (the global tree)
    cache_path: Optional[str] = None  # JSON file the global tree is loaded from and saved to

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        if self.max_depth < 1:
            raise ConfigError(f"proposer.max_depth={self.max_depth} must be >= 1 "
                              f"(the longest suffix matched; 24 is the default)")
        if not self.max_spec_factor > 0:
            raise ConfigError(f"proposer.max_spec_factor={self.max_spec_factor} must be > 0 "
                              f"(draft length <= factor x match length; 1.0 is the default)")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ConfigError(f"proposer.min_token_prob={self.min_token_prob} must be in [0, 1] "
                              f"(a probability; 0.1 is the default)")
        if self.max_cached_requests < 0:
            raise ConfigError(f"proposer.max_cached_requests={self.max_cached_requests} must be "
                              f">= 0 (0 keeps no finished request; use proposer.use_global=false "
                              f"to switch the global tree off)")
        if self.cache_path is not None and not str(self.cache_path).strip():
            raise ConfigError("proposer.cache_path is empty; give a file path or null")
        if self.cache_path is not None and not (self.use_global and self.max_cached_requests):
            raise ConfigError(f"proposer.cache_path={self.cache_path} is set but the global tree "
                              f"is off (use_global={self.use_global}, max_cached_requests="
                              f"{self.max_cached_requests}); turn it on or set cache_path=null")


class _SlotState:
    """One running request: its trie over prompt + generated tokens, and those tokens."""

    __slots__ = ("tree", "tokens", "live")

    def __init__(self, max_depth: int, prompt_ids: list[int]):
        self.tree = SuffixTree(max_depth)
        self.tokens: list[int] = []
        self.live: list[int] | None = None       # the pipeline's own list for this row
        self.extend(prompt_ids)

    def extend(self, new: list[int]) -> None:
        self.tree.extend(0, new)
        self.tokens.extend(new)


class SuffixProposer:
    def __init__(self, cfg: SuffixProposerConfig, ctx=None):
        self.cfg = cfg
        self.slots: dict[int, _SlotState] = {}
        keep = cfg.max_cached_requests if cfg.use_global else 0
        self.global_tree = SuffixTree(cfg.max_depth, max_sequences=keep)
        self._next_seq_id = 0
        target = getattr(ctx, "target", None)
        self.vocab_size: int | None = getattr(target, "vocab_size", None)
        self.cache_path = (pathlib.Path(os.path.expanduser(cfg.cache_path))
                           if cfg.cache_path else None)
        self._cache_stamp: tuple[int, int] | None = None   # (mtime_ns, size) last read/written
        if self.cache_path is not None:
            self.load()

    # --- the global tree and its file -------------------------------------------------------

    def add_finished(self, tokens: list[int]) -> None:
        """Put a finished request's tokens into the global tree (FIFO eviction)."""
        if not self.cfg.use_global or not tokens:
            return
        self.global_tree.add_sequence(self._next_seq_id, tokens)
        self._next_seq_id += 1

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.cache_path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def load(self) -> int:
        """Replace the global tree by the cache file's sequences (if the file exists); returns
        how many sequences were loaded."""
        path = self.cache_path
        if path is None or not path.exists():
            return 0
        where = f"proposer.cache_path={self.cfg.cache_path}"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
                raise ValueError(f"no {CACHE_FORMAT!r} format marker")
            if data.get("version") != CACHE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {CACHE_VERSION}")
            sequences = data["sequences"]
            top = self.vocab_size or data.get("vocab_size") or float("inf")
            if not all(isinstance(s, list) and all(type(t) is int and 0 <= t < top for t in s)
                       for s in sequences):
                raise ValueError(f"sequences must be lists of token ids in [0, {top})")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{where} is not a suffix cache this plugin can read ({exc}); "
                              f"delete the file or point cache_path elsewhere") from None
        saved_vocab = data.get("vocab_size")
        if saved_vocab is not None and self.vocab_size is not None and saved_vocab != self.vocab_size:
            raise ConfigError(f"{where} was written for a {saved_vocab}-token vocabulary but this "
                              f"model has {self.vocab_size}; use a cache_path per model")
        keep = self.global_tree.max_sequences
        self.global_tree = SuffixTree(self.cfg.max_depth, max_sequences=keep)
        self._next_seq_id = 0
        for seq in sequences[-keep:] if keep else []:
            self.add_finished(seq)
        self._cache_stamp = self._stamp()
        return len(self.global_tree)

    def save(self) -> None:
        """Write the global tree's sequences atomically (complete file or the previous one)."""
        if self.cache_path is None:
            return
        data = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "vocab_size": self.vocab_size,
                "max_depth": self.cfg.max_depth, "sequences": list(self.global_tree.sequences())}
        atomic_write_text(self.cache_path, json.dumps(data, separators=(",", ":")) + "\n")
        self._cache_stamp = self._stamp()

    # --- hooks ---------------------------------------------------------------------------------

    @hookimpl
    def specflow_run_start(self, pipeline, requests):
        # another process (or pipeline) rewrote the file since this one last read or wrote it
        if self.cache_path is not None and self._stamp() not in (None, self._cache_stamp):
            self.load()

    @hookimpl
    def specflow_run_end(self, pipeline, results, stats):
        if self.cache_path is not None:
            self.save()

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.slots[slot] = _SlotState(self.cfg.max_depth, list(request.prompt_ids))

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        state = self.slots.pop(slot, None)
        if state is None:
            return
        tokens = state.tokens
        if state.live is not None and len(state.live) < len(tokens):
            tokens = tokens[:len(state.live)]     # the pipeline retracted a stop string's tokens
        self.add_finished(tokens)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        for s, ids in zip(batch.slots.tolist(), batch.token_ids):
            state = self.slots[s]
            state.extend(ids[len(state.tokens):])
            state.live = ids

    @hookimpl
    def specflow_propose(self, batch, k):
        cfg = self.cfg
        drafts: list[list[int]] = []
        for b, (slot, kb) in enumerate(zip(batch.slots.tolist(), k.tolist())):
            n = min(int(kb), cfg.k)
            if n <= 0:
                drafts.append([])
                continue
            ids = batch.token_ids[b]
            state = self.slots[slot]
            if len(state.tokens) < len(ids):              # not synced yet: catch up
                state.extend(ids[len(state.tokens):])
            context = ids[-cfg.max_depth:]
            tokens, score = state.tree.speculate(context, n, cfg.min_token_prob,
                                                 cfg.max_spec_factor)
            if cfg.use_global and len(self.global_tree):
                g_tokens, g_score = self.global_tree.speculate(context, n, cfg.min_token_prob,
                                                               cfg.max_spec_factor)
                if g_score > score:
                    tokens = g_tokens
            drafts.append(tokens)
        K = max((len(d) for d in drafts), default=0)
        out = torch.full((batch.size, K), PAD, dtype=torch.long)          # [B, K]
        for b, d in enumerate(drafts):
            if d:
                out[b, :len(d)] = torch.tensor(d, dtype=torch.long)
        return Proposal(out, None)
