"""`proposer=none`: plain decoding through the same pipeline (the baseline arm of every experiment)."""
from __future__ import annotations

from dataclasses import dataclass

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.state import Proposal


@dataclass
class NoneProposerConfig:
    name: str = "none"
    k: int = 0

    def __post_init__(self) -> None:
        if self.k != 0:
            raise ConfigError(f"proposer.k={self.k} with proposer=none; plain decoding drafts "
                              f"nothing: pick proposer=ngram or proposer=draft to draft tokens")


class NoneProposer:
    def __init__(self, cfg=None, ctx=None):
        self.cfg = cfg

    @hookimpl
    def specflow_propose(self, batch, k):
        return Proposal.empty(batch.size)
