"""Trees or chains: which a tree proposer's drafting rounds run, chosen on what each achieved.

The node price (pricing.py) sees what a node costs to score and to draft, not the fixed costs a
tree round adds whatever its size (ranking children per level, the tree mask, shaping along
every path), which depend on the machine and the model. So a tree proposer's drafting rounds run
in one of two modes, trees or chains (price 1: no branch, and the proposer drafts its own chain
by the cheaper chain path), and the mode is chosen on what each achieved: the committed tokens
of its drafting rounds per the tokens plain decoding would have committed in their seconds at
their batch (so rounds of a full batch and of a lone request compare alike; discounted). Each is
tried MODE_FIRST rounds first, then the better one runs, and one round in MODE_EXPLORE runs the
other so a change of traffic is seen (once the other has MODE_SURE rounds, one in MODE_EXPLORE x
gap / MODE_NOISE when it measured further behind, at most 10x fewer: exploring a mode 20% slower
one round in 10 costs 2%). Under load neither matters: k falls to 0.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

MODES = ("tree", "chain")


class ModeChooser:
    MODE_EXPLORE = 10  # drafting rounds per round run in the mode measured slower, when the
    MODE_NOISE = 0.05  # two are within this (relative); further apart, proportionally fewer
    MODE_FIRST, MODE_SURE = 4, 12   # rounds each mode runs first; rounds before a gap counts

    def __init__(self, memory: float):
        self.memory = memory           # the weight of the newest round
        # per mode, per batch size: discounted [committed tokens, seconds] of drafting rounds
        self.achieved: dict[str, dict[int, np.ndarray]] = {m: {} for m in MODES}
        self.rounds_run: dict[str, int] = {m: 0 for m in MODES}   # drafting rounds per mode
        self.since_explore = 0         # choices since a round ran in the slower mode

    def record(self, mode: str, batch_size: int, tokens: float, seconds: float) -> None:
        """A drafting round run in `mode`: the tokens it committed in its seconds (its own work:
        a new prompt's catch-up left out)."""
        by_batch = self.achieved[mode]
        for done in by_batch.values():
            done *= 1 - self.memory
        by_batch.setdefault(batch_size, np.zeros(2))[:] += [tokens, seconds]
        self.rounds_run[mode] += 1

    def speedup(self, mode: str, plain_seconds: Callable[[int], float]) -> float:
        """The mode's committed tokens over what plain decoding commits in the same seconds at
        each batch size (a plain round at batch B, plain_seconds(B), commits B)."""
        by_batch = self.achieved[mode]
        tokens = sum(done[0] for done in by_batch.values())
        plain = sum(done[1] * B / max(plain_seconds(B), 1e-12) for B, done in by_batch.items())
        return tokens / max(plain, 1e-12)

    def choose(self, plain_seconds: Callable[[int], float]) -> str:
        """The mode of the next drafting round. plain_seconds(B): a plain round's seconds at
        batch B (measured, or the cost fit's)."""
        counts = self.rounds_run
        untried = [m for m in MODES if counts[m] < self.MODE_FIRST]
        if untried:                          # each tried a few rounds first, taking turns
            return min(untried, key=counts.__getitem__)
        score = {m: self.speedup(m, plain_seconds) for m in MODES}
        best = max(MODES, key=score.__getitem__)
        other = next(m for m in MODES if m != best)
        gap = 1 - score[other] / max(score[best], 1e-12)
        # a gap measured on few rounds is noise: the slower mode keeps its one round in
        # MODE_EXPLORE until it has MODE_SURE of them
        sure = counts[other] >= self.MODE_SURE
        every = self.MODE_EXPLORE * (min(max(1.0, gap / self.MODE_NOISE), 10.0) if sure else 1.0)
        self.since_explore += 1
        if self.since_explore >= every:
            self.since_explore = 0
            return other
        return best
