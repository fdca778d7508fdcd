"""The pipeline's verifier stage: lossless verification of a round's drafts, whatever their
layout (each layout verifies its own kind: stages/layout.py, stages/tree.py).

Greedy: exact match with the target's argmax. Under sampling, `rule=coupled` (the default)
commits the token plain sampling draws at each (seed, position) and accepts a draft when it is
that token; `rule=rejection` is Leviathan/Chen rejection sampling from per-request generator
streams (stages/verify.py explains both).
"""
from __future__ import annotations

from dataclasses import dataclass

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.layout import layout_of

RULES = ("coupled", "rejection")


@dataclass
class StandardVerifierConfig:
    name: str = "standard"
    # how sampling verifies (greedy is one rule): coupled = the token plain sampling draws at
    # each (seed, position), drafts drawn with the same draws (reproducible whatever k, batch or
    # load); rejection = Leviathan/Chen rejection sampling from per-request generator streams
    rule: str = "coupled"

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"verifier.rule={self.rule!r} is not a rule; use coupled (reproducible "
                              f"per seed whatever the draft length) or rejection")


class StandardVerifier:
    """Lossless verification: greedy exact match; under sampling, the plain sample at each
    (seed, position) (rule=coupled) or rejection sampling (rule=rejection)."""

    def __init__(self, cfg=None, ctx=None):
        self.cfg = cfg

    @hookimpl
    def specflow_verify(self, batch, proposal, target_probs):
        layout = layout_of(proposal)
        if batch.draws_by_position:
            return layout.verify_by_position(batch, proposal, target_probs)
        return layout.verify(batch, proposal, target_probs)
