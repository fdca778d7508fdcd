"""Acceptance estimates: for each sequence and draft position j, the chance that position j
adds an accepted token once positions 1..j-1 did.

That is the chance that draft j is accepted, times the chance that the proposer drafts a j-th
token when asked for it: an n-gram lookup without a match drafts fewer tokens than asked (or
none), and a row asked for k that drafted fewer commits no more than a rejection would, while
its padded pass still scores k + 1 positions. So a position asked for and left empty counts as
examined and not accepted; counting only the drafts made priced a batch of rows that mostly
found no match as if each had drafted (at 16 requests on SmolLM2, 0.86x plain decoding).

Learned online from the rounds' verdicts, nothing hand-set: discounted counts (accepted /
examined at j) shrunk towards the sequence's own rate over all positions, which is shrunk towards
the running global rate, so positions a sequence has not tried yet are estimated from what it
has, and a new sequence starts from everyone's average. Each estimate carries `optimism`
standard errors on top, so a sequence that could draft deeper finds out; what a sequence not
drafting knows fades, so it is probed again later rather than written off after one unlucky
stretch.

A tree proposer's rounds run as trees or as chains (modes.py), and a tree's levels are accepted
more often than a chain's tokens: the counts are kept per mode.
"""
from __future__ import annotations

import numpy as np


class AcceptanceEstimates:
    PRIOR = 2.0        # pseudo-observations behind each shrinkage

    def __init__(self, k_max: int, ewma: float, prior_acceptance: float, optimism: float,
                 modes: tuple[str, ...] = ("chain",)):
        """ewma: the weight of the newest round in each estimate (the global rate moves ten
        times slower); prior_acceptance: the global rate before anything is seen."""
        self.k_max, self.ewma, self.optimism = k_max, ewma, optimism
        self.global_rate = prior_acceptance
        # per mode, per request id: discounted [accepted, examined] counts per position, [2, K]
        self.counts_by_mode: dict[str, dict[int, np.ndarray]] = {m: {} for m in modes}

    def estimate(self, request_ids: list[int], mode: str) -> np.ndarray:
        """Per row and draft position, the estimated chance of acceptance: [B, K]."""
        K, counts = self.k_max, self.counts_by_mode[mode]
        fresh = np.zeros((2, K))
        c = np.stack([counts.get(rid, fresh) for rid in request_ids]) \
            if request_ids else np.zeros((0, 2, K))                              # [B, 2, K]
        acc, seen = c[:, 0], c[:, 1]                                             # [B, K]
        rate = (acc.sum(1, keepdims=True) + self.PRIOR * self.global_rate) \
            / (seen.sum(1, keepdims=True) + self.PRIOR)                          # [B, 1]
        mean = (acc + self.PRIOR * rate) / (seen + self.PRIOR)                   # [B, K]
        # optimism where little is known, so a sequence that could draft deeper finds out
        bonus = self.optimism * np.sqrt(mean * (1 - mean) / (seen + self.PRIOR))
        return np.minimum(mean + bonus, 1.0)

    def observe(self, result, mode: str) -> None:
        """Count a round's verdicts (RoundResult) under the mode it ran in."""
        K, keep = self.k_max, 1 - self.ewma
        g = self.ewma / 10                              # the global rate moves slower
        counts_of = self.counts_by_mode[mode]
        levels = result.num_examined or [None] * len(result.request_ids)
        # a chain row's length is what it was asked for: positions its proposer left empty
        # count as rejections (a tree's levels examined already say where its path ended)
        asked = result.num_asked if result.num_asked is not None and result.num_examined is None \
            else result.num_drafts
        for rid, k, acc, examined in zip(result.request_ids, asked, result.num_accepted, levels):
            if k == 0:
                # what a sequence not drafting knows fades, so it is probed again later rather
                # than written off after one unlucky stretch
                if rid in counts_of:
                    counts_of[rid] *= keep
                continue
            if examined is None:                        # a chain: up to the first rejection
                examined = min(acc + 1, k)              # (a tree: the levels tried)
            if examined == 0:
                continue
            self.global_rate = (1 - g) * self.global_rate + g * acc / examined
            counts = counts_of.setdefault(rid, np.zeros((2, K)))
            counts *= keep
            n = min(examined, K)
            counts[0, :min(acc, n)] += 1.0               # accepted at positions 1..acc
            counts[1, :n] += 1.0                          # examined at positions 1..n

    def forget(self, request_id: int) -> None:
        """A request ended or a fresh one took its id: nothing of it is kept."""
        for counts in self.counts_by_mode.values():
            counts.pop(request_id, None)
