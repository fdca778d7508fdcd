"""Stand-ins for what the goodput policy reads from a pipeline: a target whose passes cost a
known number of seconds, and a proposer that answers the drafting-cost hooks."""
from __future__ import annotations

from types import SimpleNamespace

from specflow import hookimpl
from specflow.plugins import new_plugin_manager
from specflow.state import RoundResult


class TimedTarget:
    """A real-looking target (padded rows, no simulated clock) whose pass costs
    fixed + per_position x rows x positions seconds."""

    pads_rows = True
    clock = None

    def __init__(self, fixed: float = 0.010, per_position: float = 0.0005):
        self.fixed, self.per_position = fixed, per_position

    def time_pass(self, rows: int = 1, positions: int = 1, reps: int = 5) -> float:
        return self.fixed + self.per_position * rows * positions

    def choice_key(self) -> None:      # nothing kept on disk: timed every build
        return None


class PaddedTarget:
    """A target pricing a pass by its padded rows, that nothing times (a policy built without
    a pipeline keeps its priors)."""

    pads_rows = True
    clock = None

    def choice_key(self) -> None:
        return None


class FakeProposer:
    """A proposer with a model of its own: a draft step costs fixed + per_position x rows x
    positions seconds, and each row owes `owed[row]` catch-up tokens (None: it never lags)."""

    def __init__(self, fixed: float = 0.001, per_position: float = 0.00005,
                 owed: list[int] | None = None):
        self.fixed, self.per_position, self.owed = fixed, per_position, owed
        self.asked: list[tuple[int, int]] = []

    @hookimpl
    def specflow_draft_step_seconds(self, rows, positions):
        self.asked.append((rows, positions))
        return self.fixed + self.per_position * rows * positions

    @hookimpl
    def specflow_catch_up_tokens(self, batch):
        return None if self.owed is None else list(self.owed)


def built(policy_cls, cfg, *plugins, target=None, slots: int = 4, proposer=None):
    """A policy registered beside `plugins` on a plugin manager of its own, its ctx holding the
    manager's hook relay, and told the pipeline is built (as Pipeline does): -> (policy, pm)."""
    pm = new_plugin_manager()
    for plugin in plugins:
        pm.register(plugin)
    ctx = SimpleNamespace(target=target, slots=slots, hook=pm.hook,
                          cfg={"proposer": proposer} if proposer else None)
    policy = policy_cls(cfg, ctx)
    pm.register(policy)
    pm.hook.specflow_pipeline_built(pipeline=None)
    return policy, pm


def timed_round(k: int, batch: int, tokens_per_row: float, seconds: float,
                prefill: float = 0.0) -> RoundResult:
    """A round of `batch` rows each drafting k and committing about tokens_per_row, timed."""
    n = [int(tokens_per_row)] * batch
    return RoundResult(0, list(range(batch)), [k] * batch, [max(t - 1, 0) for t in n],
                       [[1] * t for t in n], [None] * batch, batch,
                       seconds={"target": seconds * 0.7, "propose": seconds * 0.3,
                                **({"prefill": prefill} if prefill else {})})
