"""What the pipeline needs from a model: a batched, slot-addressed forward with a rollback-able cache.

A backend holds one cache per batch slot. `forward` appends each row's new tokens to its slot's
cache and returns logits at every new position; `truncate` rolls slots back to a committed length.
Slots are reused as requests come and go (continuous batching); `reset` empties one.
"""
from __future__ import annotations

import abc
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
