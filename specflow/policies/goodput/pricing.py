"""What a token tree costs: the positions a depth-k tree scores, and the price of one more node.

A depth-k tree is priced as 1 + w k scored positions, w the nodes per level of the trees recently
scored (learned, from 1; TreeSize), at most the proposer's node budget.

Which branches are scored is priced too: each round the policy publishes a node price (the
`specflow_node_price` hook), the throughput R of recent rounds (committed tokens / s, measured;
RecentThroughput) times what one more node costs: b_t to score it (b_t B with padded rows: a
branch mostly lengthens one row, and the pass pads every row to it), plus its share of a wider
draft step (timed at build). A node whose chance of acceptance is under that price displaces
more tokens than it is expected to add (adding v tokens for c seconds raises a round's rate only
if v / c > R), so a draft-model tree keeps only branches worth the price: with cheap positions it
spreads where the draft is unsure; under load (R grows with the batch, and for a compute-bound
pass R b_t approaches 1) it shrinks to the draft's own chain, and then k falls to 0.
"""
from __future__ import annotations

import numpy as np


class RecentThroughput:
    """Committed tokens per second of recent rounds (discounted), the rate a node must beat."""

    def __init__(self, memory: float):
        self.memory = memory
        self.tokens = self.seconds = 0.0     # discounted sums over the rounds seen

    def add(self, tokens: float, seconds: float) -> None:
        keep = 1 - self.memory
        self.tokens, self.seconds = keep * self.tokens + tokens, keep * self.seconds + seconds

    @property
    def rate(self) -> float | None:
        """Tokens / s, or None before any round with measured seconds."""
        return self.tokens / self.seconds if self.seconds > 0 else None

    def reset(self) -> None:
        """A new run's throughput is its own (a batch of 16 before must not price a batch of 1)."""
        self.tokens = self.seconds = 0.0


class TreeSize:
    """The nodes per level a tree proposer's trees score (learned), and so the positions a row
    scores per depth."""

    def __init__(self, max_nodes: int, ewma: float):
        self.max_nodes, self.ewma = max_nodes, ewma
        self.width = 1.0             # nodes per level of the trees recently scored (from chains')

    def observe(self, nodes: int, levels: int) -> None:
        """A round's trees: `nodes` scored over `levels` levels, summed over rows."""
        if levels:
            self.width = (1 - self.ewma) * self.width + self.ewma * (nodes / levels)

    def positions(self, k_max: int) -> np.ndarray:
        """Positions a row scores per depth k = 0..k_max: 1 + k x the width, at most the node
        budget + 1. [k_max + 1]"""
        return 1 + np.minimum(self.width * np.arange(k_max + 1), self.max_nodes)


def node_price(rate: float, per_position: float, batch_size: int, padded: bool,
               branch_cost: float) -> float:
    """The chance of acceptance a tree node must have to be scored: the tokens it displaces,
    the round's rate (tokens / s) x what one more node costs, scored (per_position seconds;
    with padded rows B positions, since it lengthens one row and the pass pads every row to it)
    and drafted beside its siblings (branch_cost seconds). At most 1 (no branch can pay)."""
    scored = per_position * (batch_size if padded else 1)
    return min(1.0, rate * (scored + branch_cost))
