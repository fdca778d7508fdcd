"""A KV cache with one row per batch slot, written at each row's own position and rolled back by length.

transformers' caches append the same number of positions to every row, so ragged speculation
(rows accept different numbers of drafts) would leave holes that grow every round. This cache
keeps preallocated buffers [S, H_kv, C, D] per layer: a forward writes each row's new keys and
values at that row's own positions, attention sees keys [0, kv_len) through an explicit 4-D mask,
and rollback is only a change of the row's length. Memory is bounded by slots x capacity.
"""
from __future__ import annotations

import math
import mmap

import torch
from transformers.cache_utils import Cache


def zeros_on_demand(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros of `shape` in `like`'s dtype and device. On the CPU the memory is an anonymous
    mapping: the OS's zero pages, each mapped (4 KB) as it is first written, so a cache sized
    for every slot at the full context costs nothing for the positions no request reaches
    (torch's zeros writes every byte: a second of SmolLM2's start for 8 slots x 2k positions).
    Not numpy's zeros: it asks for transparent huge pages on large arrays, so the first write
    into each 2 MB of a slot's row mapped and zeroed all 2 MB (64 slots, 30 layers, 64
    positions each: 1.1 s a layer's buffer and gigabytes resident, against 2 ms and 3.6 MB)."""
    if like.device.type != "cpu":
        return like.new_zeros(shape)
    nbytes = math.prod(shape) * like.element_size()
    if nbytes == 0:
        return like.new_zeros(shape)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(like.dtype).view(shape)


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
        self.plan = None                    # the ForwardPlan of the forward about to run
        # the buffers' addresses for the native pass (backends/lean/native_pass.py), taken once all
        # exist: a buffer is allocated once, on its layer's first write, and never moves
        self.native_tables = None

    # --- per-forward bookkeeping ---------------------------------------------------------------

    def begin(self, plan) -> None:
        """Take the plan (backends/plan.py) of the forward about to run: its rows, where each row's
        inputs are written and the keys attended (plan.kv_len)."""
        if plan.kv_len > self.max_capacity:
            raise ValueError(f"{plan.kv_len} positions exceed the cache capacity "
                             f"{self.max_capacity}")
        self.plan = plan

    def commit(self, slots: list[int], added: list[int]) -> None:
        for s, n in zip(slots, added):
            self.lengths[s] += n

    def truncate(self, slots: list[int], lengths: list[int]) -> None:
        for s, n in zip(slots, lengths):
            self.lengths[s] = min(self.lengths[s], n)

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0

    def move_path_into_place(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
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

    def copy_from(self, source: "SlotKVCache", slots: list[int], ends: list[int]) -> None:
        """Take `source`'s keys and values of each slot from this cache's length up to ends[i]
        (the same slot in both; source holds them): a cache of the same layers and attention
        shapes whose buffers exist. Each row's length becomes ends[i]."""
        for s, end in zip(slots, ends):
            start = self.lengths[s]
            if end <= start:
                continue
            for dst, src in zip((*self.keys, *self.values), (*source.keys, *source.values)):
                dst[s, :, start:end] = src[s, :, start:end]                  # [H, n, D], cast
            self.lengths[s] = end

    # --- what attention layers call ------------------------------------------------------------

    def allocate(self, like: torch.Tensor) -> None:
        """Every layer's buffers, as its first write would make them from `like` [*, H_kv, *, D]
        (its dtype and device): for a pass that writes the cache itself (the native pass), so
        that the first pass of a fresh cache runs as every later one does."""
        for layer in range(self.num_layers):
            self._ensure(layer, like)

    def _ensure(self, layer: int, like: torch.Tensor) -> None:
        """The layer's buffers, allocated once at full capacity on its first write (its dtype
        and device are known then): a pass never reallocates, and its shapes do not change."""
        if self.keys[layer] is None:
            B, H, T, D = like.shape
            self.keys[layer] = zeros_on_demand(like, (self.slots, H, self.max_capacity, D))
            self.values[layer] = zeros_on_demand(like, (self.slots, H, self.max_capacity, D))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values [B, H_kv, T, D] at each row's positions; return [B, H_kv, kv_len, D]."""
        self._ensure(layer_idx, key_states)
        plan = self.plan
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]                     # [S, H, C, D]
        B, H, T, D = key_states.shape
        if plan.single_start >= 0:   # one row, every position real: a plain slice copy
            s, p = plan.first_slot, plan.single_start
            k_buf[s, :, p:p + T] = key_states[0]
            v_buf[s, :, p:p + T] = value_states[0]
        else:
            k_new = key_states.transpose(1, 2).to(k_buf.dtype)                           # [B, T, H, D]
            v_new = value_states.transpose(1, 2).to(v_buf.dtype)
            if plan.ragged is None:
                rows = plan.slots[:, None]                                               # [B, 1]
                k_buf[rows, :, plan.write_positions] = k_new
                v_buf[rows, :, plan.write_positions] = v_new
            else:   # ragged: write the real positions only (indices made on the host)
                rows, pos, flat = plan.ragged                                             # [N] x3
                k_buf[rows, :, pos] = k_new.reshape(B * T, H, D)[flat]                   # [N, H, D]
                v_buf[rows, :, pos] = v_new.reshape(B * T, H, D)[flat]
        kv_len = plan.kv_len
        if plan.first_slot >= 0:   # slots s..s+B-1: views, no copy
            rows = slice(plan.first_slot, plan.first_slot + B)
            return k_buf[rows, :, :kv_len], v_buf[rows, :, :kv_len]
        return (k_buf[:, :, :kv_len].index_select(0, plan.slots),
                v_buf[:, :, :kv_len].index_select(0, plan.slots))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan.kv_len if self.plan is not None else 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.get_seq_length(), 0

    @property
    def is_compileable(self) -> bool:
        return False
