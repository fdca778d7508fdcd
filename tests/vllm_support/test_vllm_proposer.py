"""SpecflowProposer against a stand-in for vLLM's side of the custom_class contract."""
from __future__ import annotations

import pytest
import torch

from specflow.plugins import hookimpl
from specflow.stages.proposers.ngram import NgramIndex
from specflow.vllm import SpecflowProposer
from specflow.vllm.testing import FakeEngine, toy_next, vllm_config

PROMPTS = {"a": [1, 2, 3, 1, 2], "b": [5, 6, 7, 5], "c": [9, 9, 9, 4], "d": [2, 4, 6, 8, 2]}


class Probe:
    """Records what each hook saw, by specflow request id."""

    def __init__(self):
        self.seen: dict[int, list[int]] = {}   # request id -> its tokens at the last propose
        self.started, self.ended, self.ks = [], [], []

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.started.append(request.request_id)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.ended.append(request.request_id)

    @hookimpl
    def specflow_draft_length(self, batch):
        for rid, toks in zip(batch.request_ids, batch.token_ids):
            before = self.seen.get(rid, [])
            assert toks[:len(before)] == before, "a request's tokens changed under it"
            self.seen[rid] = list(toks)
        return None


def drafter(*overrides, k=4, rows=4, probe=None):
    p = SpecflowProposer(vllm_config(k, rows), overrides=list(overrides) or None)
    if probe is not None:
        p.stages.pm.register(probe)
    return p


def run(p, rows=4, steps=12, moves=True):
    e = FakeEngine(p, rows)
    e.add("a", PROMPTS["a"])
    e.add("b", PROMPTS["b"])
    for i in range(steps):
        if moves and i == 3:
            e.swap(0, 1)
        if moves and i == 4:
            e.add("c", PROMPTS["c"])
        if moves and i == 6:
            e.remove("a")
            e.add("d", PROMPTS["d"])
        e.step(skip=frozenset({"b"}) if moves and i == 8 else frozenset())
    return e


def test_drafts_are_specflow_ngram_drafts_of_each_rows_tokens_and_counts_match_vllms():
    p = drafter("proposer=ngram")
    e = FakeEngine(p, 4)
    for name in ("a", "b", "c"):
        e.add(name, PROMPTS[name])
    for i in range(10):
        drafts = e.step()
        for r, d in zip(e.rows, drafts):
            idx = NgramIndex(1, 4)
            idx.extend(r["tokens"])
            assert d == idx.propose(4)
        if i == 4:
            e.swap(0, 2)
    stats = p.stats()
    assert stats["num_accepted_tokens"] == e.accepted > 0
    assert stats["num_draft_tokens"] == e.drafted


def test_per_request_state_follows_requests_as_they_join_leave_skip_and_move():
    probe = Probe()
    p = drafter("proposer=ngram", "policy=adaptive", probe=probe)
    run(p)
    assert len(probe.started) == 4 == len(set(probe.started))       # a, b, c, d: once each
    p.close()
    assert sorted(probe.ended) == sorted(probe.started)             # every one released
    assert p.rows.live == {} and sorted(p.rows.free) == [0, 1, 2, 3]


def test_a_request_gone_from_every_row_is_ended_without_close():
    probe = Probe()
    p = drafter("proposer=ngram", probe=probe)
    p.rows.absent_steps = 2
    e = FakeEngine(p, 4)
    e.add("a", PROMPTS["a"])
    e.add("b", PROMPTS["b"])
    e.step()
    e.remove("a")
    e.step()
    e.step()
    assert probe.ended == [0]


def test_the_policy_gives_each_row_its_own_k_up_to_num_speculative_tokens():
    p = drafter("proposer=ngram", "policy=static", "policy.k=2", k=4)
    e = run(p, moves=False)
    assert 0 < p.stats()["num_draft_tokens"] <= 2 * p.stats()["num_drafts"]
    assert all(len(r["drafts"]) <= 2 for r in e.rows)

    class NoDraftsForB:
        @hookimpl(tryfirst=True)
        def specflow_draft_length(self, batch):
            return torch.tensor([0 if toks[:4] == PROMPTS["b"] else 4 for toks in batch.token_ids])

    p = drafter("proposer=ngram", k=3)
    p.stages.pm.register(NoDraftsForB())
    e = FakeEngine(p, 4)
    e.add("a", PROMPTS["a"])
    e.add("b", PROMPTS["b"])
    for _ in range(8):
        drafts = e.step()
        assert drafts[1] == [] and len(drafts[0]) <= 3       # 4 asked, capped at vLLM's k
    assert p.stats()["num_draft_tokens"] > 0


def test_the_adaptive_policy_learns_each_requests_acceptance_inside_vllm():
    p = drafter("proposer=ngram", "policy=adaptive")
    run(p, moves=False, steps=16)
    policy = p.stages.pm.get_plugin("policy.adaptive")
    assert set(policy.acceptance) == {0, 1}
    assert all(a != policy.cfg.initial_acceptance for a in policy.acceptance.values())


def test_rows_still_in_prefill_get_no_drafts_and_keep_their_state():
    p = drafter("proposer=ngram")
    e = FakeEngine(p, 4)
    e.add("a", PROMPTS["a"])
    e.step()
    drafts = p.propose([[]], e.num_tokens, e.token_ids_cpu)
    assert drafts == [[]] and len(p.rows.live) == 1


def test_output_through_the_drafter_is_the_targets_own():
    """The stand-in verifies greedily: every committed token is toy_next of what precedes it."""
    p = drafter("proposer=ngram")
    e = run(p)
    for r in e.rows:
        toks = r["tokens"]
        start = len(PROMPTS[r["id"]])
        assert all(toks[i] == toy_next(toks[:i]) for i in range(start, len(toks)))


@pytest.mark.parametrize("env, proposer", [(None, "ngram"), ("policy=adaptive", "ngram"),
                                           ("proposer=ngram proposer.max_n=2", "ngram")])
def test_overrides_come_from_the_environment_and_default_to_ngram(monkeypatch, env, proposer):
    if env is None:
        monkeypatch.delenv("SPECFLOW_VLLM_OVERRIDES", raising=False)
    else:
        monkeypatch.setenv("SPECFLOW_VLLM_OVERRIDES", env)
    p = SpecflowProposer(vllm_config(k=3))
    assert p.stages.cfg.proposer.name == proposer and p.stages.cfg.proposer.k == 3
    if env and "max_n" in env:
        assert p.stages.cfg.proposer.max_n == 2
