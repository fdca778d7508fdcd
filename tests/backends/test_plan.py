"""Forward plans (backends/plan.py): one builder for every pass's inputs, and buckets that pad a
plan to fixed sizes without changing any real row's output or what the cache holds."""
from __future__ import annotations

import torch

from specflow import Pipeline
from specflow.backends.plan import make_plan
from specflow.state import PAD


def pow2(rows: int, positions: int) -> tuple[int, int]:
    return 1 << (rows - 1).bit_length(), 1 << (positions - 1).bit_length()


def test_a_ragged_plan_writes_only_real_positions_and_pads_with_the_last_one():
    ids = torch.tensor([[5, 6, 7], [8, PAD, PAD]])
    plan = make_plan([2, 0], [10, 4], ids, [3, 1], torch.device("cpu"))
    assert plan.positions.tolist() == [[10, 11, 12], [4, 4, 4]]
    assert plan.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert plan.kv_len == 13 and plan.first_slot == -1 and plan.single_start == -1
    slots, pos, flat = (t.tolist() for t in plan.ragged)
    assert list(zip(slots, pos, flat)) == [(2, 10, 0), (2, 11, 1), (2, 12, 2), (0, 4, 3)]


def test_a_bucket_pads_rows_and_positions_with_inputs_that_are_never_cached():
    ids = torch.tensor([[5, 6, 7]] * 3)
    plan = make_plan([0, 1, 2], [4, 4, 4], ids, [3, 3, 3], torch.device("cpu"), bucket=pow2)
    assert plan.shape == (4, 4) and (plan.rows, plan.width) == (3, 3)
    assert plan.lens == [3, 3, 3, 0]
    slots, pos, _ = (t.tolist() for t in plan.ragged)
    assert len(slots) == 9 and max(pos) == 6      # the 9 real inputs, none of the padding


def test_a_bucketed_target_decodes_exactly_what_an_exact_one_does():
    """The same pipelines with the target's plans padded to powers of two: every output
    (plain, chain and tree speculation, batch 1 and 3) is the same, token for token."""
    prompts = ["def fib(n):", "for i in range(10):", "x = 1"]
    arms = [["proposer=none"], ["proposer=ngram", "proposer.k=3"],
            ["proposer=ngram", "proposer.k=3", "proposer.topk=2", "proposer.num_draft_tokens=6"]]
    for arm in arms:
        pipe = Pipeline.from_config([*arm, "pack=false", "threads=1", "show_progress=false"])
        exact = [r.token_ids for r in pipe.generate(prompts, max_new_tokens=16, max_batch_size=3)]
        pipe.target.bucket = pow2
        padded = [r.token_ids for r in pipe.generate(prompts, max_new_tokens=16, max_batch_size=3)]
        assert padded == exact, arm


def test_a_bucketed_pass_gives_the_real_rows_the_same_logits():
    pipe = Pipeline.from_config(["proposer=none", "pack=false", "threads=1"])
    target = pipe.target
    ids = torch.tensor([[5, 6, 7], [9, 10, PAD], [11, PAD, PAD]])
    lens = torch.tensor([3, 2, 1])
    out = {}
    for bucket in (None, pow2):
        target.bucket = bucket
        for s in range(3):
            target.reset(s)
        target.forward(torch.tensor([0, 1, 2]), torch.tensor([[1, 2, 3, 4]] * 3),
                       torch.tensor([4, 4, 4]))
        out[bucket] = target.forward(torch.tensor([0, 1, 2]), ids, lens)
        assert [target.cache_length(s) for s in range(3)] == [7, 6, 5]
    # the real positions: padding is never read (a ragged pass on a CPU computes only its real
    # queries: tests/backends/lean/test_native_pass.py)
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(out[None][b, :n], out[pow2][b, :n], atol=1e-5, rtol=1e-5)
