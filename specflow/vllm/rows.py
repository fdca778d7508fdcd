"""Which of vLLM's batch rows holds which request, told from the tokens alone.

vLLM calls a `custom_class` proposer with each row's token ids but no request ids, and its rows
are not stable: requests join, leave, wait a step unscheduled, come back after preemption, and
move to other rows when the batch is condensed. A request's tokens only ever grow, so the state
that last saw tokens T owns the row whose tokens start with T. `RowTracker.match` finds that owner
(the row's previous owner first, then any live state), or starts a new one.

Two requests whose tokens are equal so far are interchangeable: the drafts of a history proposer
depend only on the tokens. A state that no row has claimed for `absent_steps` steps is ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Tracked:
    """One request as the tracker follows it."""

    key: int                       # unique for the tracker's lifetime (specflow's request_id)
    slot: int                      # a stable slot for the stages' per-slot state
    tokens: list[int]              # what the stages have synced: prompt + committed tokens
    prompt_len: int
    drafts: list[int] = field(default_factory=list)     # proposed last step, awaiting verdict
    drafted: bool = False          # a propose step ran for it since its last verdict
    asked: int = 0                 # the draft length the policy asked of it then
    last_step: int = 0

    def is_prefix_of(self, row: np.ndarray) -> bool:
        n = len(self.tokens)
        return n <= len(row) and bool(np.array_equal(row[:n], self.tokens))

    def extend(self, new: list[int]) -> None:
        self.tokens.extend(new)


class RowTracker:
    """Follows requests across vLLM's rows. `match` each row, then `end_absent` once a step."""

    def __init__(self, slots: int, absent_steps: int = 64):
        self.free = list(range(slots - 1, -1, -1))     # slots, handed out lowest first
        self.slots = slots
        self.absent_steps = absent_steps
        self.live: dict[int, Tracked] = {}             # key -> state
        self.by_row: dict[int, int] = {}               # row -> key of its owner last step
        self.step = 0
        self.ended: list[Tracked] = []                 # ended during a step, to free a slot
        self._next_key = 0
        self._claimed: set[int] = set()
        self._rows: dict[int, int] = {}

    def begin_step(self) -> None:
        self.step += 1
        self._claimed, self._rows = set(), {}

    def match(self, row: int, tokens: np.ndarray, new_count: int) -> tuple[Tracked, bool]:
        """The state owning `row` (tokens [L]); new_count: tokens vLLM sampled this step, used to
        split a new request's prompt from what it generated. -> (state, started now)."""
        owner = self._owner(row, tokens)
        started = owner is None
        if started:
            owner = self._start(tokens, new_count)
        owner.last_step = self.step
        self._claimed.add(owner.key)
        self._rows[row] = owner.key
        return owner, started

    def _owner(self, row: int, tokens: np.ndarray) -> Tracked | None:
        key = self.by_row.get(row)
        state = self.live.get(key) if key is not None else None
        if state is not None and key not in self._claimed and state.is_prefix_of(tokens):
            return state
        # moved, or back after a step unscheduled: the longest live state that is a prefix
        best = None
        for state in self.live.values():
            if state.key in self._claimed or not state.is_prefix_of(tokens):
                continue
            if best is None or len(state.tokens) > len(best.tokens):
                best = state
        return best

    def _start(self, tokens: np.ndarray, new_count: int) -> Tracked:
        if not self.free:       # more requests than slots: end the one absent longest
            oldest = min((s for s in self.live.values() if s.key not in self._claimed),
                         key=lambda s: s.last_step, default=None)
            if oldest is None:
                raise RuntimeError(f"more rows than the {self.slots} slots specflow was built "
                                   f"with; raise vLLM's max_num_seqs to match")
            self.ended.append(self._end(oldest.key))
        prompt_len = max(len(tokens) - max(new_count, 0), 0)
        state = Tracked(self._next_key, self.free.pop(), [int(t) for t in tokens[:prompt_len]],
                        prompt_len, last_step=self.step)
        self._next_key += 1
        self.live[state.key] = state
        return state

    def end_absent(self) -> list[Tracked]:
        """Close the step: the states no row has claimed for `absent_steps` steps are ended and
        returned (with any ended to free a slot during the step)."""
        self.by_row = self._rows
        gone = [self._end(k) for k, s in list(self.live.items())
                if self.step - s.last_step >= self.absent_steps]
        ended, self.ended = self.ended + gone, []
        return ended

    def end_all(self) -> list[Tracked]:
        ended = [self._end(k) for k in list(self.live)] + self.ended
        self.ended = []
        return ended

    def _end(self, key: int) -> Tracked:
        state = self.live.pop(key)
        self.free.append(state.slot)
        self.free.sort(reverse=True)
        return state
