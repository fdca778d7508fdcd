"""The slot cache's buffers: zeros in the writer's dtype, at full capacity, written in place."""
from __future__ import annotations

import pytest
import torch

from specflow.backends.slot_cache import SlotKVCache, zeros_on_demand


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_on_demand_are_zeros_of_the_dtype_asked(dtype):
    like = torch.ones(1, 2, 1, 8, dtype=dtype)
    z = zeros_on_demand(like, (3, 2, 1000, 8))
    assert z.dtype == dtype and z.shape == (3, 2, 1000, 8) and z.is_contiguous()
    assert not z.any()
    z[1, :, 5] = 2.0                    # written in place like any tensor
    assert z.sum().item() == 2.0 * 2 * 8 and z[0].abs().sum() == 0


def _resident_mb() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="Linux only")
def test_a_cache_costs_the_positions_written_not_the_capacity():
    """64 slots x 3 heads x 8192 positions (400 MB) with 64 positions written in every row: a
    few MB resident. (numpy's zeros once backed it: it asks for transparent huge pages, so each
    row's first write mapped and zeroed 2 MB: 384 MB resident, and a second to write.)"""
    before = _resident_mb()
    z = zeros_on_demand(torch.zeros(1), (64, 3, 8192, 64))
    z[:, :, :64] = 1.0
    grew = _resident_mb() - before
    assert z[:, :, :64].all() and not z[:, :, 64:128].any()
    assert grew < 48, f"{grew:.0f} MB resident for 3 MB written"


def test_a_fresh_cache_reads_zeros_past_what_was_written():
    cache = SlotKVCache(num_layers=2, slots=4, max_capacity=256)
    cache.allocate(torch.zeros(1, 2, 1, 8))
    for buf in (*cache.keys, *cache.values):
        assert buf.shape == (4, 2, 256, 8) and not buf.any()
    # each buffer its own memory
    assert len({b.data_ptr() for b in (*cache.keys, *cache.values)}) == 4
