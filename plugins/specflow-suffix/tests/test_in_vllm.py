"""The suffix proposer inside vLLM (specflow.vllm.SpecflowProposer), with specflow's stand-in
for vLLM's side of the contract: no vLLM needed."""
from __future__ import annotations

from specflow.vllm import SpecflowProposer
from specflow.vllm.testing import FakeEngine, vllm_config


def test_suffix_drafts_inside_vllm_and_learns_from_the_requests_that_left():
    drafter = SpecflowProposer(vllm_config(k=4, max_num_seqs=2),
                               overrides=["proposer=suffix", "proposer.use_global=true"])
    drafter.rows.absent_steps = 1          # a request gone for one step has ended
    engine = FakeEngine(drafter, max_num_seqs=2)
    prompt = [3, 1, 4, 1, 5]
    engine.add("first", prompt)
    for _ in range(12):
        engine.step()
    first_accepted = engine.accepted
    done = engine.remove("first")
    engine.step()                          # no row holds it: it ends, into the global tree
    suffix = drafter.stages.pm.get_plugin("proposer.suffix")
    assert len(suffix.global_tree) > 0
    engine.accepted = 0
    engine.add("again", prompt)            # the same prompt: the global tree knows what follows
    for _ in range(12):
        engine.step()
    again = engine.rows[0]["tokens"]
    n = min(len(again), len(done["tokens"]))
    assert again[:n] == done["tokens"][:n]               # the toy target is greedy
    assert engine.accepted > first_accepted
