"""A KV cache with one row per batch slot, written at each row's own position and rolled back by length.

transformers' caches append the same number of positions to every row, so ragged speculation
(rows accept different numbers of drafts) would leave holes that grow every round. This cache
keeps preallocated buffers [S, H_kv, C, D] per layer: a forward writes each row's new keys and
values at that row's own positions, attention sees keys [0, kv_len) through an explicit 4-D mask,
and rollback is only a change of the row's length. Memory is bounded by slots x capacity.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class _Layer:
    """What transformers' mask helpers look for on a cache layer."""

    is_sliding = False
    is_compileable = False


class SlotKVCache(Cache):
    def __init__(self, num_layers: int, slots: int, max_capacity: int):
        # not calling Cache.__init__: this cache owns its storage; the attributes below are the
        # ones transformers' modelling and masking code read
        self.layers = [_Layer() for _ in range(num_layers)]
        self.layer_class_to_replicate = None
        self.offloading = False
        self.num_layers = num_layers
        self.slots = slots
        self.max_capacity = max_capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers    # [S, H_kv, C, D] each
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * slots          # tokens cached per slot (host-side, no syncs)
        # set by begin() for the forward about to run
        self._slots: torch.Tensor | None = None     # [B]
        self._first = -1                             # s when slots == [s, s+1, ..., s+B-1], else -1
        self._batch = 0
        self._start = -1                             # B == 1, every position real: its first position
        self._positions: torch.Tensor | None = None  # [B, T] where each new token is written
        self._ragged: tuple | None = None             # ragged batch: (rows, positions, flat) [N]
        self._kv_len = 0

    # --- per-forward bookkeeping ---------------------------------------------------------------

    def begin(self, slots: list[int], lens: list[int], T: int, device) -> tuple[torch.Tensor, int]:
        """Prepare a forward of T positions for `slots`, of which row b uses its first lens[b].

        Returns (positions [B, T], kv_len). Padding positions repeat the row's last real position
        (they stay inside the context, e.g. for absolute position embeddings) and are never written
        to the cache, so a short row next to a long one cannot run past its capacity.
        """
        self._batch = len(slots)
        self._first = slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else -1
        self._start = self.lengths[slots[0]] if len(slots) == 1 and lens[0] == T else -1
        # everything is computed on the host (the lengths live there) and sent in one copy
        host_slots = torch.tensor(slots, dtype=torch.long)                               # [B]
        starts = torch.tensor([self.lengths[s] for s in slots], dtype=torch.long)        # [B]
        n = torch.tensor(lens, dtype=torch.long)                                         # [B]
        t = torch.arange(T)[None, :]                                                     # [1, T]
        positions = starts[:, None] + torch.minimum(t, (n - 1).clamp(min=0)[:, None])    # [B, T]
        parts = [host_slots, positions.flatten()]
        if min(lens) != T:    # ragged: which (slot, position) each real token goes to
            b, j = (t < n[:, None]).nonzero(as_tuple=True)                               # [N] x2
            parts += [host_slots[b], positions[b, j], b * T + j]
        sent = torch.cat(parts).to(device).split([p.numel() for p in parts])
        self._slots = sent[0]
        self._positions = sent[1].view(len(slots), T)
        self._ragged = sent[2:] if len(sent) > 2 else None      # rows [N], positions [N], flat [N]
        self._kv_len = max(self.lengths[s] + m for s, m in zip(slots, lens))
        if self._kv_len > self.max_capacity:
            raise ValueError(f"{self._kv_len} positions exceed the cache capacity "
                             f"{self.max_capacity}")
        return self._positions, self._kv_len

    def commit(self, slots: list[int], added: list[int]) -> None:
        for s, n in zip(slots, added):
            self.lengths[s] += n

    def truncate(self, slots: list[int], lengths: list[int]) -> None:
        for s, n in zip(slots, lengths):
            self.lengths[s] = min(self.lengths[s], n)

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def keep(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
        """Move each row's entries base + picks[i] to base + i, every layer (a tree pass's
        accepted path into place); the row's length becomes base + len(picks)."""
        for s, b, pick in zip(slots, base, picks):
            if pick and pick != list(range(len(pick))):
                src = torch.tensor(pick) + b                                           # [n]
                for buf in (*self.keys, *self.values):
                    if buf is not None:
                        src_d = src.to(buf.device)
                        buf[s, :, b:b + len(pick)] = buf[s].index_select(1, src_d)    # copy first
            self.lengths[s] = b + len(pick)

    # --- what attention layers call ------------------------------------------------------------

    def _ensure(self, layer: int, like: torch.Tensor) -> None:
        B, H, T, D = like.shape
        buf = self.keys[layer]
        if buf is not None and buf.shape[2] >= self._kv_len:
            return
        capacity = min(self.max_capacity, max(64, 2 * self._kv_len))
        new_k = like.new_zeros(self.slots, H, capacity, D)
        new_v = like.new_zeros(self.slots, H, capacity, D)
        if buf is not None:
            old = buf.shape[2]
            new_k[:, :, :old] = buf
            new_v[:, :, :old] = self.values[layer]
        self.keys[layer], self.values[layer] = new_k, new_v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values [B, H_kv, T, D] at each row's positions; return [B, H_kv, kv_len, D]."""
        self._ensure(layer_idx, key_states)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]                     # [S, H, C, D]
        B, H, T, D = key_states.shape
        if self._start >= 0:   # one row, every position real: a plain slice copy
            s, p = self._first, self._start
            k_buf[s, :, p:p + T] = key_states[0]
            v_buf[s, :, p:p + T] = value_states[0]
        else:
            k_new = key_states.transpose(1, 2).to(k_buf.dtype)                           # [B, T, H, D]
            v_new = value_states.transpose(1, 2).to(v_buf.dtype)
            if self._ragged is None:
                rows = self._slots[:, None]                                              # [B, 1]
                k_buf[rows, :, self._positions] = k_new
                v_buf[rows, :, self._positions] = v_new
            else:   # ragged: write the real positions only (indices made on the host in begin)
                rows, pos, flat = self._ragged                                            # [N] x3
                k_buf[rows, :, pos] = k_new.reshape(B * T, H, D)[flat]                   # [N, H, D]
                v_buf[rows, :, pos] = v_new.reshape(B * T, H, D)[flat]
        if self._first >= 0:   # slots s..s+B-1: views, no copy
            rows = slice(self._first, self._first + self._batch)
            return k_buf[rows, :, :self._kv_len], v_buf[rows, :, :self._kv_len]
        return (k_buf[:, :, :self._kv_len].index_select(0, self._slots),
                v_buf[:, :, :self._kv_len].index_select(0, self._slots))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self._kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False
