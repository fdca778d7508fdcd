"""RowTracker: vLLM's rows told apart by their tokens alone."""
from __future__ import annotations

import numpy as np
import pytest

from specflow.vllm.rows import RowTracker


def step(tracker: RowTracker, rows: dict[int, list[int]], new: int = 1):
    tracker.begin_step()
    got = {row: tracker.match(row, np.array(toks), new) for row, toks in rows.items()}
    return got, tracker.end_absent()


def test_a_request_keeps_its_state_when_rows_swap_and_when_it_skips_a_step():
    t = RowTracker(slots=4, absent_steps=3)
    (got, _) = step(t, {0: [1, 2, 3], 1: [7, 8]})
    a, b = got[0][0], got[1][0]
    assert got[0][1] and got[1][1]                      # both started
    assert a.tokens == [1, 2] and a.prompt_len == 2     # the sampled token is not the prompt
    a.extend([3]), b.extend([8])
    got, _ = step(t, {0: [7, 8, 9], 1: [1, 2, 3, 4]})   # swapped, each grew
    assert got[0][0] is b and got[1][0] is a and not got[0][1] and not got[1][1]
    got, ended = step(t, {0: [7, 8, 9]})                 # a waits a step unscheduled
    assert got[0][0] is b and ended == []
    got, _ = step(t, {2: [1, 2, 3, 4, 5]})               # and comes back in another row
    assert got[2][0] is a and a.slot != b.slot


def test_states_no_row_claims_end_after_absent_steps_and_free_their_slot():
    t = RowTracker(slots=2, absent_steps=2)
    got, _ = step(t, {0: [1, 2], 1: [3, 4]})
    first = got[0][0]
    step(t, {1: [3, 4, 5]})
    _, ended = step(t, {1: [3, 4, 5, 6]})
    assert ended == [first] and first.key not in t.live
    got, _ = step(t, {0: [9, 9]})
    assert got[0][1] and got[0][0].slot == first.slot   # the freed slot is reused


def test_equal_tokens_in_two_rows_are_two_requests():
    t = RowTracker(slots=4)
    got, _ = step(t, {0: [5, 6, 7], 1: [5, 6, 7]})
    assert got[0][0] is not got[1][0] and got[0][0].slot != got[1][0].slot


def test_more_requests_than_slots_ends_the_one_absent_longest_or_says_how_to_fix_it():
    t = RowTracker(slots=2, absent_steps=100)
    got, _ = step(t, {0: [1, 1], 1: [2, 2]})
    old = got[0][0]
    step(t, {1: [2, 2, 2]})
    got, ended = step(t, {0: [3, 3], 1: [2, 2, 2, 2]})   # a third request, no free slot
    assert ended == [old] and got[0][1]
    t.begin_step()
    t.match(0, np.array([4, 4]), 1)
    t.match(1, np.array([2, 2, 2, 2, 2]), 1)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        t.match(2, np.array([8, 8]), 1)
