"""Every admitted request is ended on every exit path, and no stage carries per-request state from
one generate() call into the next: after a call that failed in round 3, a second call on the same
pipeline gives exactly what a fresh pipeline gives."""
from __future__ import annotations

import pytest

from specflow import Pipeline, PluginError, hookimpl

SYN = ["model=synthetic", "draft=synthetic", "proposer=draft", "max_batch_size=3"]
PROMPTS = ["ab", "cd", "ef", "gh", "ij"]


class RaiseInRound:
    """Raises once, in the given round of the first call."""

    def __init__(self, at: int):
        self.at, self.rounds, self.armed = at, 0, True

    @hookimpl
    def specflow_observe(self, result):
        self.rounds += 1
        if self.armed and self.rounds == self.at:
            self.armed = False
            raise RuntimeError("boom in round %d" % self.at)


class Ends:
    def __init__(self):
        self.started, self.ended = [], []

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.started.append(request.request_id)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.ended.append((request.request_id, finish_reason))


def _outcome(results):
    return [(r.token_ids, r.stats["num_draft_tokens"], r.stats["num_accepted_tokens"])
            for r in results]


@pytest.mark.parametrize("policy", ["heuristic", "adaptive", "goodput", "static"])
@pytest.mark.parametrize("sampling", [False, True])
def test_a_failed_call_leaves_nothing_behind(policy, sampling):
    overrides = [*SYN, f"policy={policy}"] + (["logits=[temperature]"] if sampling else [])
    fresh = _outcome(Pipeline.from_config(overrides).generate(PROMPTS, max_new_tokens=24))
    ends = Ends()
    pipe = Pipeline.from_config(overrides, plugins=[RaiseInRound(3), ends])
    with pytest.raises(PluginError, match="boom in round 3"):
        pipe.generate(PROMPTS, max_new_tokens=24)
    # every request that took a slot was ended, the ones still running with "abort"
    assert sorted(ends.started) == sorted(rid for rid, _ in ends.ended)
    assert any(reason == "abort" for _, reason in ends.ended)
    if policy != "goodput":   # goodput keeps its cost fits across calls on purpose
        assert _outcome(pipe.generate(PROMPTS, max_new_tokens=24)) == fresh
    else:
        again = pipe.generate(PROMPTS, max_new_tokens=24)
        assert [r.token_ids for r in again] == [f[0] for f in fresh] or sampling


def test_ctrl_c_ends_every_running_request():
    class Interrupt:
        @hookimpl
        def specflow_observe(self, result):
            raise KeyboardInterrupt

    ends = Ends()
    pipe = Pipeline.from_config(SYN, plugins=[Interrupt(), ends])
    with pytest.raises(KeyboardInterrupt):
        pipe.generate(PROMPTS, max_new_tokens=8)
    assert sorted(ends.ended) == [(0, "abort"), (1, "abort"), (2, "abort")]


def test_a_stage_raising_in_request_end_still_lets_the_others_release():
    class RaisingEnd:
        @hookimpl(tryfirst=True)
        def specflow_request_end(self, slot, request, finish_reason):
            if finish_reason != "abort":
                raise RuntimeError("release failed")

    ends = Ends()
    pipe = Pipeline.from_config(SYN, plugins=[ends, RaisingEnd()])
    with pytest.raises(PluginError, match="release failed"):
        pipe.generate(PROMPTS, max_new_tokens=8)
    assert sorted(ends.started) == sorted(rid for rid, _ in ends.ended)
