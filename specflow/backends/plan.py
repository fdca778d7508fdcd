"""A forward pass's plan: every input of one pass as device tensors, built in one place.

A backend on a SlotKVCache (the HF target and draft, an EAGLE head's cache) turns forward's
arguments (slots, token ids, lengths, an optional tree) into a ForwardPlan and runs it. The plan
holds what attention and the cache need: where each row's inputs are written (its cached length),
each input's rotary position, the keys attended (kv_len), the write indices of a ragged batch and
the tree's visibility, all computed on the host (where the lengths live) and sent to the device
in one copy.

Buckets: a backend may pad plans to fixed (rows, positions) sizes (`bucket`), so a CUDA-graph
backend captures one graph per bucket and replays it. Padding rows feed nothing (length 0, never
written to the cache) and padding positions repeat their row's last real position (also never
written); the caller reads the first `rows` x `width` outputs. CPU backends run plans eagerly at
their exact sizes (no bucket): padding would be computed for nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specflow.state import PAD

Bucket = Callable[[int, int], "tuple[int, int]"]     # (rows, positions) -> padded sizes


@dataclass
class ForwardPlan:
    """One forward over B rows (padded to Bp) of T positions (padded to Tp)."""

    slots: torch.Tensor          # [Bp] long (device): each row's cache slot
    input_ids: torch.Tensor      # [Bp, Tp] long (device): PAD positions hold 0
    write_positions: torch.Tensor  # [Bp, Tp] long (device): where each input is cached
    positions: torch.Tensor      # [Bp, Tp] long (device): each input's rotary position (a
                                 # tree node's: its depth's; else where it is cached)
    starts: torch.Tensor         # [Bp] long (device): each row's cached length before the pass
    slot_list: list[int]         # [Bp] host mirror of slots
    lens: list[int]              # [Bp] inputs per row (0 for a padding row)
    start_list: list[int]        # [Bp] host mirror of starts
    rows: int                    # B: the real rows
    width: int                   # T: the real positions
    kv_len: int                  # keys attended: the longest row after the pass
    # how the cache writes: slots s..s+B-1 (first slot, else -1); one full row (its start,
    # else -1); a ragged batch's real (slot, position, flat index) triples, [N] each
    first_slot: int = -1
    single_start: int = -1
    ragged: tuple[torch.Tensor, ...] | None = None
    tree: object | None = None   # models.base.TreeAttention: tree queries' positions and sight

    @property
    def shape(self) -> tuple[int, int]:
        """The padded (rows, positions) the pass computes."""
        return tuple(self.input_ids.shape)


def make_plan(slots: list[int], starts: list[int], input_ids: torch.Tensor, lens: list[int],
              device, tree=None, bucket: Bucket | None = None) -> ForwardPlan:
    """The plan of a forward: row b appends input_ids[b, :lens[b]] (host [B, T], PAD after) to
    slot slots[b], whose cache holds starts[b] entries. `tree` (TreeAttention) places and masks
    tree queries; `bucket` pads the sizes (a padding row repeats slot slots[0] with length 0)."""
    B, T = input_ids.shape
    Bp, Tp = bucket(B, T) if bucket is not None else (B, T)
    if (Bp, Tp) != (B, T):
        padded = input_ids.new_full((Bp, Tp), PAD)
        padded[:B, :T] = input_ids
        input_ids = padded
        slots = slots + [slots[0]] * (Bp - B)
        starts = starts + [starts[0]] * (Bp - B)
        lens = lens + [0] * (Bp - B)
    # the numbers are built as host lists and sent with the token ids in one copy: a decode
    # step's plan is a handful of ints, where tensor ops would cost more than the numbers
    on_host = input_ids.device.type == "cpu"     # a draft step's own tokens may be on the device
    # where each input is cached: padding positions repeat the row's last real one (never
    # written; inside the context, e.g. for absolute position embeddings)
    write = [s + min(j, max(m - 1, 0)) for s, m in zip(starts, lens) for j in range(Tp)]
    numbers = [slots, write, starts]
    if min(lens) != Tp:    # ragged: which (slot, position, flat index) each real token goes to
        real = [(b, j) for b in range(Bp) for j in range(lens[b])]                      # [N]
        numbers += [[slots[b] for b, _ in real], [write[b * Tp + j] for b, j in real],
                    [b * Tp + j for b, j in real]]
    flat = [v for part in numbers for v in part]
    sizes = [len(part) for part in numbers]
    if on_host and tree is None and torch.device(device).type == "cpu":
        # a CPU pass (every decode step on a CPU): the numbers and the ids as one host tensor,
        # without the copy and the clamp (~20 us of a 2 ms step)
        ids = input_ids.flatten().tolist()                                       # cpu only
        sent = torch.tensor(flat + [max(t, 0) for t in ids], dtype=torch.long)
    else:
        parts = [torch.tensor(flat, dtype=torch.long)]
        if tree is not None:   # tree queries sit at their depth's position, not where cached
            rotary = tree.positions.new_zeros(Bp, Tp)
            rotary[:B, :T] = tree.positions
            parts.append(rotary.flatten())
        if on_host:
            parts.append(input_ids.clamp(min=0).flatten())
        sent = torch.cat(parts).to(device)
    # the pieces, as views: the numbers, a tree's rotary positions, the ids where they were sent
    pieces, at = [], 0
    for size in sizes + [Bp * Tp] * ((tree is not None) + on_host):
        pieces.append(sent[at:at + size])
        at += size
    n = len(numbers)
    rotary = pieces[n].view(Bp, Tp) if tree is not None else None
    ids = pieces[-1].view(Bp, Tp) if on_host else input_ids.clamp(min=0)          # [Bp, Tp]
    return _plan_of(pieces[:n], ids, rotary, slots, starts, lens, B, T, Bp, Tp, tree)


def _plan_of(sent, ids: torch.Tensor, rotary: torch.Tensor | None, slots: list[int],
             starts: list[int], lens: list[int], B: int, T: int, Bp: int, Tp: int,
             tree) -> ForwardPlan:
    """The ForwardPlan of make_plan's numbers as tensors (`sent`: slots, write positions,
    starts, and a ragged batch's three), its ids and a tree's rotary positions."""
    contiguous = slots[:B] == list(range(slots[0], slots[0] + B)) and Bp == B
    write = sent[1].view(Bp, Tp)
    return ForwardPlan(
        slots=sent[0], input_ids=ids, write_positions=write,
        positions=rotary if tree is not None else write,
        starts=sent[2], slot_list=list(slots), lens=list(lens), start_list=list(starts),
        rows=B, width=T, kv_len=max(s + m for s, m in zip(starts, lens)),
        first_slot=slots[0] if contiguous else -1,
        single_start=starts[0] if Bp == 1 and lens[0] == Tp else -1,
        ragged=tuple(sent[3:]) if len(sent) > 3 else None, tree=tree)
