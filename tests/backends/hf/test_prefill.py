"""Batched prefill: the prompts admitted before the same round are cached in one forward per model."""
from __future__ import annotations

import torch

from specflow import Pipeline
from specflow.backends.hf import backend as hf

PROMPTS = ["def add(a, b):\n    return a + b\n", "import os", "class Stack:\n    def __init__(self):",
           "for i in range(10):\n    print(i)\n" * 3, "x = 1"]


def counting(backend, calls: list):
    forward = backend.forward

    def counted(slots, input_ids, input_lens, hidden_layers=(), logits=True, **kw):
        calls.append((len(slots), input_ids.shape[1], logits))
        return forward(slots, input_ids, input_lens, hidden_layers, logits=logits, **kw)
    backend.forward = counted


def test_prompts_admitted_together_are_prefilled_in_one_forward_per_model():
    pipe = Pipeline.from_config(["model=demo", "draft=demo", "proposer=draft", "show_progress=false"])
    target_calls, draft_calls = [], []
    counting(pipe.target, target_calls)
    counting(pipe.draft, draft_calls)
    batched = pipe.generate(PROMPTS, max_new_tokens=12, max_batch_size=len(PROMPTS))
    prefills = [c for c in target_calls if not c[2]]
    assert len(prefills) == 1 and prefills[0][0] == len(PROMPTS)
    assert len([c for c in draft_calls if not c[2]]) == 1
    one_by_one = [pipe.generate([p], max_new_tokens=12, max_batch_size=1)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in one_by_one]
    assert all(r.stats["seconds"]["prefill"] > 0 for r in batched)


def test_a_token_budget_splits_prefill_longest_first(monkeypatch):
    monkeypatch.setattr(hf, "PREFILL_TOKENS", 48)
    backend = hf.HFBackend(hf.HFModelConfig(path=str(hf.DEMO_DIR / "target")), torch.device("cpu"), 4)
    calls = []
    counting(backend, calls)
    prompts = [list(range(1, 11)), list(range(1, 31)), [], list(range(1, 21))]
    backend.prefill_many([0, 1, 2, 3], prompts)
    # 30 alone (30 + 30 > 48), then 20 + 10 (2 x 20 <= 48); the empty prompt runs nothing
    assert [(b, t) for b, t, _ in calls] == [(1, 30), (2, 20)]
    assert [backend.cache_length(s) for s in range(4)] == [10, 30, 0, 20]
    # the cache holds what one forward per prompt would have written
    ids = torch.tensor([list(range(1, 21)) + [7]])
    ref = hf.HFBackend(hf.HFModelConfig(path=str(hf.DEMO_DIR / "target")), torch.device("cpu"), 1)
    want = ref.forward(torch.tensor([0]), ids, torch.tensor([21]))[0, -1]
    got = backend.forward(torch.tensor([3]), torch.tensor([[7]]), torch.tensor([1]))[0, -1]
    assert torch.allclose(got, want, atol=1e-4)
