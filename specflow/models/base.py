"""What the pipeline needs from a model: a batched, slot-addressed forward with a rollback-able cache.

A backend holds one cache per batch slot. `forward` appends each row's new tokens to its slot's
cache and returns logits at every new position; `truncate` rolls slots back to a committed length.
Slots are reused as requests come and go (continuous batching); `reset` empties one.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

import torch


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SimClock:
    """Simulated time for the synthetic backend: a target step costs 1 unit, a draft step c."""

    def __init__(self) -> None:
        self.time = 0.0
        self.by_source: dict[str, float] = {}

    def charge(self, source: str, units: float) -> None:
        self.time += units
        self.by_source[source] = self.by_source.get(source, 0.0) + units


@dataclass
class TreeAttention:
    """Who attends to whom in a forward over tree nodes. Every query sees the cached keys below
    visible_below[b] (the committed prefix); among the keys from there on it sees those `see`
    marks. Queries sit at their own rotary positions (the prefix length plus their depth), not
    at the cache slots they are written to."""

    positions: torch.Tensor       # [B, T] long, each query's position
    visible_below: list[int]      # [B] keys [0, visible_below[b]) are visible to every query
    see: torch.Tensor             # [B, T, R] bool: query t sees key visible_below[b] + r
    # [B, T] long: each query's parent, as a key index from visible_below[b] (-1 = the last
    # committed position); read by models that feed a node its parent's state (draft heads)
    parent: torch.Tensor | None = None

    def allowed(self, kv_len: int, window: int | None = None) -> torch.Tensor:
        """[B, T, kv_len] bool (host): query t may attend key j (the committed prefix, only its
        last `window` positions with a sliding window, and the tree keys `see` marks)."""
        B, T, R = self.see.shape
        below = torch.tensor(self.visible_below)                                     # [B]
        keys = torch.arange(kv_len)                                                  # [L]
        rel = keys[None, :] - below[:, None]                                         # [B, L]
        in_tree = (rel >= 0) & (rel < R)                                             # [B, L]
        tree_part = self.see.gather(2, rel.clamp(0, max(R - 1, 0))[:, None, :].expand(B, T, kv_len))
        prefix = (rel < 0)[:, None, :]                                               # [B, 1, L]
        if window is not None:
            prefix = prefix & (keys[None, None, :] > self.positions[:, :, None] - window)
        return prefix | (in_tree[:, None, :] & tree_part)                            # [B, T, L]

    @classmethod
    def of_layout(cls, layout, starts: list[int]) -> "TreeAttention":
        """A target tree pass: the root is written at starts[b], node i at starts[b] + 1 + i;
        each sees its ancestors and itself (stages/tree.py TreeLayout)."""
        T = layout.depth.shape[1]
        start = torch.tensor(starts)
        return cls(start[:, None] + layout.depth, list(starts), layout.ancestors()[:, :T, :T])


class Backend(abc.ABC):
    """A causal LM with one rollback-able cache per slot."""

    name: str = "backend"
    vocab_size: int
    eos_token_id: int | None = None
    max_length: int | None = None        # context window in tokens, None = unbounded
    supports_rollback: bool = True       # False for recurrent caches: speculation is refused
    device: torch.device = torch.device("cpu")
    tokenizer: Tokenizer
    clock: SimClock | None = None
    # a forward's cost follows rows x its longest input (rows are padded to one length), not the
    # sum of the rows' lengths; the goodput policy prices a round's drafts by it
    pads_rows: bool = True

    @abc.abstractmethod
    def reset(self, slot: int) -> None:
        """Forget everything cached for `slot`."""

    @abc.abstractmethod
    def cache_length(self, slot: int) -> int:
        """Tokens currently cached for `slot`."""

    @abc.abstractmethod
    def forward(self, slots: torch.Tensor, input_ids: torch.Tensor,
                input_lens: torch.Tensor) -> torch.Tensor:
        """Append input_ids[b, :input_lens[b]] to slot slots[b]'s cache.

        slots [B] long, input_ids [B, T] long (PAD beyond each row's length), input_lens [B] long.
        Returns logits [B, T, V] float32; position t predicts the token after input t.
        """

    def prefill(self, slot: int, ids: list[int]) -> None:
        """Cache a new request's prompt (all but its last token, which the first round feeds)."""
        if ids:
            self.forward(torch.tensor([slot]), torch.tensor([ids]), torch.tensor([len(ids)]))

    def prefill_many(self, slots: list[int], prompts: list[list[int]]) -> None:
        """Cache several new requests' prompts (each without its last token); a backend that can
        batch them overrides this (HFBackend: ragged forwards under a token budget)."""
        for slot, ids in zip(slots, prompts):
            self.prefill(slot, ids)

    @abc.abstractmethod
    def truncate(self, slots: torch.Tensor, lengths: list[int]) -> None:
        """Roll each slot's cache back to its first `lengths[b]` tokens."""

    # --- token trees (optional) -------------------------------------------------------------

    supports_trees: bool = False         # forward_tree and keep_cached are implemented

    def forward_tree(self, slots: torch.Tensor, input_ids: torch.Tensor, input_lens: torch.Tensor,
                     layout) -> torch.Tensor:
        """Append a tree per row: input_ids [B, N+1] = the row's last committed token, then its
        draft nodes (PAD after input_lens[b]); `layout` (stages/tree.py TreeLayout) gives each
        node's depth and ancestors. Node t sits at position start + depth(t) and attends to the
        cached prefix and to its own ancestors only. The entries are cached in input order
        (keep_cached later keeps the accepted path). Returns logits [B, N+1, V] float32."""
        raise NotImplementedError(f"{type(self).__name__} cannot score token trees")

    def keep_cached(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
        """After a tree pass: for each row, the cached entries base[b] + picks[b][i] move to
        base[b] + i (in order), and the row's length becomes base[b] + len(picks[b])."""
        raise NotImplementedError(f"{type(self).__name__} cannot score token trees")

