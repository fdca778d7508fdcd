"""Random draws for verification and drafting, reproducible per request.

`generator` may be one torch.Generator for the batch, or a list with one per row. With a list,
row b consumes its draws from its own generator only, so a seeded request gets the same tokens
whatever batch it shares (the per-row draws are the only loop).
"""
from __future__ import annotations

from typing import Sequence

import torch

Generators = torch.Generator | Sequence[torch.Generator | None] | None


def row_uniforms(shape: tuple[int, int], k: list[int], generator: Generators,
                  device: torch.device) -> torch.Tensor:
    """Uniform(0, 1) draws [B, K]; with per-row generators row b draws exactly k[b] of them."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device)
    u = torch.zeros(shape, device=device)
    for b, (gen, n) in enumerate(zip(generator, k)):
        if n:
            u[b, :n] = torch.rand(n, generator=gen, device=device)
    return u


def row_exponentials(shape: tuple[int, int], generator: Generators, device: torch.device,
                      active: torch.Tensor | None = None) -> torch.Tensor:
    """Exponential(1) draws [B, V] for the exponential race argmax(w / E) ~ Categorical(w).

    With per-row generators, rows where `active` is False draw nothing (their result is unused).
    """
    if generator is None or isinstance(generator, torch.Generator):
        return torch.empty(shape, device=device).exponential_(generator=generator)
    e = torch.ones(shape, device=device)
    flags = [True] * shape[0] if active is None else active.tolist()
    for b, (gen, on) in enumerate(zip(generator, flags)):
        if on:
            e[b].exponential_(generator=gen)
    return e


def sample_categorical(probs: torch.Tensor, generator: Generators = None,
                       active: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from unnormalised non-negative weights [B, V] -> [B] (exponential race)."""
    e = row_exponentials(tuple(probs.shape), generator, probs.device, active)   # [B, V]
    return (probs / e).argmax(-1)                                                # [B]
