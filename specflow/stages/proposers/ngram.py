"""`proposer=ngram`: prompt lookup over each row's prompt and generated tokens (no model).

Rule (DESIGN.md section 6): the longest n in [min_n, max_n] whose last-n suffix occurs earlier in
the sequence; take its most recent earlier occurrence; propose up to k tokens that followed it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.state import PAD, Proposal


@dataclass
class NgramProposerConfig:
    name: str = "ngram"
    k: int = 4          # most tokens proposed per round
    min_n: int = 1      # shortest suffix that may match
    max_n: int = 4      # longest suffix tried first

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"proposer.min_n={self.min_n}, proposer.max_n={self.max_n}: need "
                              f"1 <= min_n <= max_n")


def ngram_draft(token_ids: list[int], min_n: int = 1, max_n: int = 4, k: int = 5) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    L = len(token_ids)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = token_ids[L - n:]
        # most recent occurrence that ends before the last position: scan start positions backwards
        for start in range(L - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = start + n
                return list(token_ids[follow:follow + k])
    return []


class NgramProposer:
    def __init__(self, cfg: NgramProposerConfig, ctx=None):
        self.cfg = cfg

    @hookimpl
    def specflow_propose(self, batch, k):
        ks = k.tolist()
        drafts = [ngram_draft(ids, self.cfg.min_n, self.cfg.max_n, kb) if kb else []
                  for ids, kb in zip(batch.token_ids, ks)]
        K = max((len(d) for d in drafts), default=0)
        out = torch.full((batch.size, K), PAD, dtype=torch.long)          # [B, K]
        for b, d in enumerate(drafts):
            if d:
                out[b, :len(d)] = torch.tensor(d)
        return Proposal(out, None)
