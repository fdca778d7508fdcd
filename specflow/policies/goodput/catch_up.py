"""A draft's catch-up, charged to drafting.

A proposer that drafts with a model of its own may have to feed that model tokens before a
row's first draft step (a draft model caches a row only when the row drafts: a new prompt, the
tokens committed while the row sat at k = 0): seconds plain decoding never spends. The proposer
says how many tokens each row owes beyond those a draft step feeds for free (the
`specflow_catch_up_tokens` hook); they cost a draft position's seconds each, timed at build
(costs.py) and fitted on the rounds' catch-up seconds (the `prefill` entry of a round's times).

Catching up once lets every later round draft, so a row is charged its catch-up spread over the
drafting rounds it has left (its remaining tokens over the most a round can commit): short
requests under load never start drafting, while long ones at small batch barely notice.
"""
from __future__ import annotations

import numpy as np

from specflow.policies.goodput.fits import LineFit


class CatchUpCosts:
    def __init__(self, memory: float, per_token: float = 0.0):
        """per_token: seconds per token fed, as timed at build (0: learned from rounds only)."""
        self.fit = LineFit(memory, 0.0, per_token)       # seconds = per_token x tokens fed
        # this round's drafting rows: request id -> the tokens their drafts are to catch up on
        self.owed_by_drafting_rows: dict[int, int] = {}

    @property
    def per_token(self) -> float:
        return self.fit.coef()[1]

    def seconds(self, owed: list[int], tokens_left: list[int],
                tokens_per_round: np.ndarray) -> np.ndarray:
        """Per row, the catch-up seconds charged to a round in which it drafts: `owed` tokens at
        the per-token cost, over the drafting rounds left (tokens_left / tokens_per_round, at
        least 1). [B]"""
        c = self.per_token
        if c <= 0:
            return np.zeros(len(owed))
        lag = np.asarray(owed, dtype=float)
        left = np.maximum(1.0, np.asarray(tokens_left, dtype=float))
        rounds = np.maximum(1.0, left / tokens_per_round)
        return c * lag / rounds

    def drafting(self, request_ids: list[int], owed: list[int] | None, k: list[int]) -> None:
        """This round's choice: the rows that draft, and what their drafts owe (None: no
        proposer answered, nothing to learn)."""
        self.owed_by_drafting_rows = {} if owed is None else \
            {rid: int(n) for rid, n, kb in zip(request_ids, owed, k) if kb}

    def observe(self, result, seconds: float) -> None:
        """The round ran (RoundResult); `seconds`: its catch-up seconds. A row given k but held
        at 0 after the policy (the length cap, the draft's own context) was not fed."""
        owed = self.owed_by_drafting_rows
        fed = sum(owed[rid] for rid, k in zip(result.request_ids, result.num_drafts)
                  if k and rid in owed)
        if fed:
            self.fit.add(fed, seconds)
        self.owed_by_drafting_rows = {}
