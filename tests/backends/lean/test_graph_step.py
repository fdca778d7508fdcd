"""The static-shape verify step (backends/lean/graph_step.py), checked on a CPU: what a CUDA graph
captures must trace as one graph, keep its buffers, read nothing on the host, and decode exactly
what the eager pass does."""
from __future__ import annotations

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.backends.lean.graph_step import StaticStep, static_forward
from specflow.backends.plan import make_plan

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "class Stack:\n    def push(self"]
BASE = ["model=demo", "draft=demo", "pack=false", "threads=1", "max_new_tokens=24"]


def tokens(*overrides, batch=3):
    pipe = Pipeline.from_config([*BASE, f"max_batch_size={batch}", *overrides])
    return [r.token_ids for r in pipe.generate(PROMPTS)], pipe


@pytest.mark.parametrize("proposer", ["proposer=none", "proposer=ngram", "proposer=draft"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_graph_path_decodes_exactly_what_the_eager_path_does(proposer, batch):
    eager, _ = tokens(proposer, batch=batch)
    graphs, pipe = tokens(proposer, "model.graphs=true", batch=batch)
    assert graphs == eager
    runner = pipe.target.graphs
    assert runner is not None and runner.steps and not runner.capture      # CPU: eager steps
    assert all(rows & (rows - 1) == 0 and pos & (pos - 1) == 0 for rows, pos in runner.steps)
    assert pipe.backends["target"]["graphs"]["buckets"]


def test_eagle_and_trees_keep_the_eager_pass_and_stay_exact():
    eager, _ = tokens("proposer=eagle")
    assert tokens("proposer=eagle", "model.graphs=true")[0] == eager          # hidden states
    tree, _ = tokens("proposer=ngram", "proposer.topk=2", "proposer.num_draft_tokens=6")
    assert tokens("proposer=ngram", "proposer.topk=2", "proposer.num_draft_tokens=6",
                  "model.graphs=true")[0] == tree


def _target(batch=4):
    pipe = Pipeline.from_config([*BASE, "proposer=ngram", f"max_batch_size={batch}",
                                 "model.graphs=true"])
    target = pipe.target
    for slot, n in enumerate((5, 9, 3, 7)[:batch]):              # rows with different contexts
        target.forward(torch.tensor([slot]), torch.arange(1, n + 1)[None], torch.tensor([n]),
                       logits=False)
    return target


def _plan(target, rows, positions):
    slots = list(range(rows))
    starts = [target.cache.lengths[s] for s in slots]
    lens = [max(1, positions - b) for b in range(rows)]               # ragged
    ids = torch.full((rows, positions), -1)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.arange(10, 10 + n)
    return make_plan(slots, starts, ids, lens, target.device, bucket=target.bucket)


@pytest.mark.parametrize("rows,positions", [(1, 1), (1, 5), (2, 2), (3, 8), (4, 4)])
def test_every_bucket_traces_as_one_graph_and_computes_the_eager_logits(rows, positions):
    target = _target()
    plan = _plan(target, rows, positions)
    step = StaticStep(target.lean, target.cache, *plan.shape, target.device, capture=False)
    step.load(plan)
    saved = [(k.clone(), v.clone()) for k, v in zip(target.cache.keys, target.cache.values)]
    compiled = torch.compile(static_forward, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        traced = compiled(*step._args())
        for (k, v), (k0, v0) in zip(zip(target.cache.keys, target.cache.values), saved):
            k.copy_(k0), v.copy_(v0)                                  # the same cache again
        eager_static = static_forward(*step._args())
    torch.testing.assert_close(traced, eager_static, rtol=0, atol=0)
    # in inference mode, as every pass runs: a choice timed at start (native=auto where a
    # library product won the pick) may have allocated the cache there, as inference tensors
    with torch.inference_mode():
        for (k, v), (k0, v0) in zip(zip(target.cache.keys, target.cache.values), saved):
            k.copy_(k0), v.copy_(v0)
    target.graphs = None                                              # the eager pass
    eager = target.run(plan)                                          # [B, T, V]
    for b, n in enumerate(plan.lens[:plan.rows]):
        torch.testing.assert_close(eager_static[b, :n].float(), eager[b, :n], rtol=1e-5,
                                   atol=1e-5)


def test_static_buffers_keep_their_storage_across_rounds():
    pipe = Pipeline.from_config([*BASE, "proposer=ngram", "max_batch_size=3",
                                 "model.graphs=true"])
    pipe.generate(PROMPTS[:1], max_new_tokens=4)
    runner = pipe.target.graphs
    before = {key: [t.data_ptr() for t in (s.ids, s.pos, s.write, s.slots)]
              for key, s in runner.steps.items()}
    cache = [t.data_ptr() for t in runner.cache.keys]
    pipe.generate(PROMPTS, max_new_tokens=24)
    for key, ptrs in before.items():
        s = runner.steps[key]
        assert [t.data_ptr() for t in (s.ids, s.pos, s.write, s.slots)] == ptrs
    assert [t.data_ptr() for t in runner.cache.keys] == cache


def test_a_step_reads_nothing_on_the_host_and_a_round_no_more_than_eagerly():
    from test_host_syncs import HostReadProbe, reads_per_round

    eager, _ = reads_per_round(["proposer=ngram", "pack=false"], PROMPTS)
    graphs, results = reads_per_round(["proposer=ngram", "pack=false", "model.graphs=true"],
                                      PROMPTS)
    assert all(r.token_ids for r in results)
    assert max(map(len, graphs)) <= max(map(len, eager)) <= 1

    target = _target()
    plan = _plan(target, 3, 5)
    probe = HostReadProbe()
    probe.taint([plan.input_ids, plan.positions, plan.write_positions, plan.slots])
    with probe, torch.inference_mode():          # as HFBackend.run calls it
        probe.active = True
        target.graphs.run(plan)
    assert probe.reads == []


def test_graphs_without_the_lean_forward_are_one_line():
    with pytest.raises(ConfigError, match="model.graphs=true runs the lean forward's static "
                                          "step.*no lean forward.*model.graphs=false"):
        Pipeline.from_config([*BASE, "proposer=none", "model.forward=hf", "model.graphs=true"])
