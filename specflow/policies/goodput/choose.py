"""How many tokens to draft: the k per row that turns out the most expected tokens per second.

A row drafting k tokens whose positions are accepted with chances a_1, a_2, ... (each given the
ones before it) commits E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens (expected_tokens). What the
round costs depends on how the target prices a pass:

- rows priced separately (the synthetic clock charges each row its own tokens): each row takes
  the k maximising E(k) over its own share of the round, a_t / B + b_t (k + 1) + its draft steps
  (the round's fixed costs shared by the B rows; choose_k). With a full queue this minimises the
  total cost of the work; under load b_t (k + 1) dominates and k falls to 0;
- padded rows (a real forward pads every row to the longest): the round is priced as a whole,
  a_t + b_t B (K + 1) for its longest draft K, so for each cap K every row drafts the k <= K its
  own draft steps pay for, and the cap with the most expected tokens per second of the round
  wins (choose_k_padded). One keen row can no longer make every row score K + 1 positions.

a_t, b_t: the target pass's fixed seconds and seconds per position; a_d, b_d: a draft step's
seconds and seconds per drafted token (costs.py measures them, policy.py fits them online).
"""
from __future__ import annotations

import numpy as np


def expected_tokens(acceptance) -> np.ndarray:
    """acceptance [B, K] (per position) -> E(k) [B, K+1] for k = 0..K."""
    gain = np.cumprod(np.clip(np.asarray(acceptance, dtype=np.float64), 0, 1), 1)  # [B, K]
    return np.concatenate([np.ones((len(gain), 1)), 1 + np.cumsum(gain, 1)], 1)


def choose_k(acceptance, a_t: float, b_t: float, a_d: float, b_d: float,
             rounds: int = 3, positions=None, first: float = 0.0) -> list[int]:
    """acceptance [B, K] -> per row, the k in 0..K maximising E(k) / its cost share, for a
    target whose pass costs the sum of its rows' positions (rows are not padded).

    A row's share of a round: a_t / B of the target pass's fixed cost, b_t per position it adds,
    b_d per draft step it takes, and a_d / n_i for its i-th draft step, which the n_i rows
    drafting at least i tokens share (the first step also `first`, the fixed cost of drafting
    at all in a round). n depends on everyone's k: a few fixed-point passes.
    """
    E = expected_tokens(acceptance)                                              # [B, K+1]
    B, K = E.shape[0], E.shape[1] - 1
    if B == 0:
        return []
    k = np.arange(K + 1)                                                         # [K+1]
    scored = k + 1 if positions is None else np.asarray(positions[:K + 1])      # [K+1]
    choice = np.full(B, K)
    for _ in range(rounds):
        sharing = (choice[:, None] >= k[None, 1:]).sum(0)                        # [K] n_i
        step_share = a_d / np.maximum(sharing, 1)                                # [K]
        step_share[:1] += first / max(int(sharing[0]) if K else 1, 1)
        cost = a_t / B + b_t * scored + b_d * k + np.concatenate(
            [[0.0], np.cumsum(step_share)])                                      # [K+1]
        new = (E / np.maximum(cost, 1e-12)).argmax(1)                            # [B]
        if np.array_equal(new, choice):
            break
        choice = new
    return choice.tolist()


def choose_k_padded(acceptance, a_t: float, b_t: float, a_d: float, b_d: float,
                    rounds: int = 4, positions=None, first: float = 0.0,
                    plain: float | None = None, row_first=None) -> list[int]:
    """acceptance [B, K] -> per row k, for a target whose pass pads every row to the longest
    (a transformer forward over [B, max k + 1]): the round costs a_t + b_t B (K + 1) for its
    largest K whatever the other rows draft, plus a_d per draft step and b_d per drafting row
    (and `first` once when any row drafts).
    So the choice is the batch's: for each cap K, every row takes the k <= K that is worth its
    own draft steps, and the cap with the most expected tokens per second of the round wins
    (per-row shares would let one keen row make all B rows score K + 1 positions).

    For a cap the rows' choices and the round's rate depend on each other (Dinkelbach): each row
    maximises E(k) - rate * b_d * k at the current rate, a few passes. `plain`: the measured
    seconds of a round without drafts at this batch, in place of the fit's a_t + b_t B (a cap
    then costs the dearer of the fit's line and plain + b_t B (its extra positions));
    `row_first` [B] (or a function returning it): seconds a row adds to the round if it drafts
    at all (its draft's catch-up)."""
    E = expected_tokens(acceptance)                                              # [B, K+1]
    B, K = E.shape[0], E.shape[1] - 1
    if B == 0:
        return []
    j = np.arange(K + 1)                                                         # [J]
    cap = np.arange(K + 1)                                                       # [C] = K+1 caps
    # positions a row scores with depth k: k + 1 for a chain, the tree's nodes + 1 for a tree
    scored = cap + 1 if positions is None else np.asarray(positions[:K + 1])    # [C]
    target = a_t + b_t * B * scored                                              # [C]
    if plain is not None:
        # a cap costs the dearer of the fit's line and the measured plain round plus the fit's
        # price of the extra positions: the fit's value at B is an extrapolation, and each
        # price alone drafted where drafting lost at 16 requests (the line when plain rounds
        # measured dearer than it, on SmolLM2; the measured round plus the slope on the demo
        # pair, whose drafting rounds cost more than the slope says): docs/decisions.md
        target = np.maximum(target, plain + b_t * B * (scored - scored[0]))
        target[0] = plain
    # under load no longest draft K can beat plain decoding even if every row drafted K and all
    # were accepted at its estimated rates (the round then costs at least target + (a_d + b_d) K):
    # the common answer, found without the search
    best_case = E.sum(0)[1:] / (target[1:] + (a_d + b_d) * cap[1:] + first)     # [K]
    if K == 0 or best_case.max() <= B / max(target[0], 1e-12):
        return [0] * B
    over = j[None, :] > cap[:, None]                                             # [C, J]
    ks = np.repeat(cap[:, None], B, 1)                                           # [C, B]
    rows = np.arange(B)[None, :]

    if callable(row_first):         # computed only past the common answer above
        row_first = row_first()
    extra = np.zeros(B) if row_first is None else np.asarray(row_first, dtype=np.float64)  # [B]
    # what drafting k costs a row beyond its share of the pass: b_d per token, its catch-up once
    own = b_d * j[None, :] + extra[:, None] * (j[None, :] > 0)                   # [B, J]

    def rate(ks):
        tokens = E[rows, ks].sum(1)                                              # [C]
        longest = ks.max(1)
        return tokens / np.maximum(target + a_d * longest + first * (longest > 0)
                                   + own[rows, ks].sum(1), 1e-12)

    for _ in range(rounds):
        score = E[None] - rate(ks)[:, None, None] * own[None]                    # [C, B, J]
        score[np.broadcast_to(over[:, None, :], score.shape)] = -np.inf
        new = score.argmax(-1)                                                   # [C, B]
        if np.array_equal(new, ks):
            break
        ks = new
    return ks[int(rate(ks).argmax())].tolist()
