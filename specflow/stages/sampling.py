"""Random draws for verification and drafting, reproducible per request.

Two schemes:
- Per position (the pipeline's default, `verifier.rule=coupled`): the draws for the token at
  position n of a request are a fixed function of (its seed, n), computed by a counter-based hash
  (`position_exponentials`) rather than read from a stream. The token plain sampling would put at
  n is argmax(p / E(seed, n)) (the exponential race), and a speculative round commits exactly that
  token, whatever was drafted: a seeded request gives the same tokens whatever the policy, the
  draft length, the batch and the load (docs/decisions.md, "Sampling draws keyed by position").
  No generator, no per-row loop, nothing read back from the device.
- Per stream (`verifier.rule=rejection` and the public `verify()`): `generator` may be one
  torch.Generator for the batch, or a list with one per row. With a list, row b consumes its
  draws from its own generator only, so a seeded request gets the same tokens whatever batch it
  shares, as long as its draft lengths are the same (the per-row draws are the only loop).
"""
from __future__ import annotations

from typing import Sequence

import torch

from specflow.backends.lean.native import argmax

Generators = torch.Generator | Sequence[torch.Generator | None] | None

_M32 = 0xFFFFFFFF
_COLUMNS: dict[tuple[int, str], torch.Tensor] = {}    # (V, device) -> the vocabulary's hash offsets


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32-style) on int64 tensors holding values < 2^32; every
    product stays below 2^63, so nothing relies on overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position): seeds [B] long (any value in [0, 2^63)), positions
    [B, P] long -> [B, P] int64 in [0, 2^32)."""
    seeds = seeds.to(positions.device)
    low, high = (seeds & _M32)[:, None], (seeds >> 32)[:, None]                   # [B, 1]
    return _mix32(_mix32(_mix32(low) ^ positions) ^ high)                          # [B, P]


def _columns(vocab_size: int, device: torch.device) -> torch.Tensor:
    key = (vocab_size, str(device))
    col = _COLUMNS.get(key)
    if col is None:     # token v's offset from the key: v times the 32-bit golden ratio, as int32
        col = ((torch.arange(vocab_size, dtype=torch.long) * 0x9E3779B1) & _M32)
        col = _COLUMNS[key] = torch.where(col >= 2 ** 31, col - 2 ** 32, col).to(torch.int32).to(device)
    return col                                                                     # [V] int32


def position_exponentials(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                          tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Exponential(1) draws [B, P, V] float32, a fixed function of (seed, position, token); with
    `tokens` ([S] ids), those tokens' draws only, [B, P, S], each the same value as in the whole.

    The per-token part runs in int32 with wrapping products (as two's-complement hardware and
    torch's CPU and CUDA kernels compute them; tests/stages/test_sampling.py checks the values
    against an exact reference) and logical shifts made by masking; its top 24 bits give the
    uniform w, as torch.rand's float32 draws have 24 bits. E = -log(1 - w) is finest near E = 0,
    where the race is decided, and never 0 (w >= 2^-25); a w that rounds up to 1 gives E = inf, a
    token that cannot win."""
    keys = position_keys(seeds, positions)                                          # [B, P]
    keys = torch.where(keys >= 2 ** 31, keys - 2 ** 32, keys).to(torch.int32)
    columns = _columns(vocab_size, positions.device)                                # [V]
    if tokens is not None:
        columns = columns[tokens]                                                   # [S]
    x = keys[..., None] + columns                                                   # [B, P, V]
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    x.mul_(0x7FEB352D)
    x.bitwise_xor_((x >> 15) & 0x1FFFF)
    x.mul_(0x2C1B3C6D)
    x.bitwise_xor_((x >> 16) & 0xFFFF)
    w = ((x >> 8) & 0xFFFFFF).to(torch.float32).add_(0.5).mul_(2.0 ** -24)        # (0, 1]
    return w.neg_().log1p_().neg_()


def position_weights(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """p / E(seed, position) for non-negative weights probs [B, P, V] -> [B, P, V]: its argmax is
    the token plain sampling draws (the exponential race). A round verifies the target's
    weights greedily: drafts drawn with the same E match them as often as the draws allow, and
    the committed stream is Categorical(p) at every position.

    A token of weight 0 has 0 there whatever its draw, so on a CPU, where top-p or top-k left
    the round's rows a support of at most a quarter of the vocabulary (usually a few dozen
    tokens), only those tokens' draws are computed (the draws were ~8% of a sampled round over
    SmolLM2's 49,152 ids): the same values, bit for bit. Elsewhere (an accelerator, where the
    support's size would be read back) every token's."""
    V = probs.shape[-1]
    if probs.device.type == "cpu":
        support = (probs.reshape(-1, V).amax(0) > 0).nonzero()[:, 0]     # [S] ascending; cpu only
        if len(support) * 4 <= V:
            out = torch.zeros_like(probs)                                          # [B, P, V]
            out[..., support] = probs[..., support] / position_exponentials(
                seeds, positions, V, support)                                      # [B, P, S]
            return out
    return probs / position_exponentials(seeds, positions, V)                      # [B, P, V]


def position_choice(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The token plain sampling puts at each position: argmax(p / E(seed, position)) over
    unnormalised non-negative weights probs [B, P, V] -> [B, P] long (Categorical(p) exactly)."""
    return argmax(position_weights(probs, seeds, positions))


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
    return argmax(probs / e)                                                     # [B]
