"""`pack`: auto packs the target's weights when a one-row pass and the pipeline's fullest pass
(max_batch_size rows x k+1 positions) run faster packed on average, each relative to its own
dense time (timed at start), and a draft model's by
the same rule at its fullest step; true and false are applied; other values are refused."""
from __future__ import annotations

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.backends.hf.backend import HFBackend
from specflow.backends.lean.kernels import can_pack

# what the choices at build time measure is replaced here: nothing is read back or kept
pytestmark = pytest.mark.times_choices

needs_onednn = pytest.mark.skipif(not can_pack(torch.float32),
                                  reason="this torch build has no oneDNN packed linear")

DEMO = ["model=demo", "threads=2", "max_new_tokens=6", "show_progress=false", "max_batch_size=1",
        "native=true"]      # (auto may time the native pass too: tests/backends/lean/test_native_choice.py)


@needs_onednn
@pytest.mark.parametrize("packed_faster", [True, False])
def test_auto_packs_a_speculating_target_when_its_passes_run_faster(monkeypatch, packed_faster):
    timed = []

    def fake(backend, rows=1, positions=1, reps=5, context=32):
        timed.append((backend.lean.packed, positions, rows))
        fast = backend.lean.packed == packed_faster
        return (0.004 if fast else 0.006) * (1 + positions * rows / 10)

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    pipe = Pipeline.from_config(DEMO + ["proposer=ngram", "proposer.k=4"])
    assert pipe.packed is packed_faster and pipe.target.lean.packed is packed_faster
    # the two ends: one row at one position, the full batch (1 row here) at k+1
    assert set(timed) == {(False, 1, 1), (False, 5, 1), (True, 1, 1), (True, 5, 1)}
    assert ("packed" in pipe.kernels) is packed_faster
    timed.clear()
    plain_batch = Pipeline.from_config(DEMO + ["proposer=none", "draft=none", "max_batch_size=8"])
    assert plain_batch.packed is packed_faster
    assert (False, 1, 8) in timed and (True, 1, 8) in timed       # 8 rows x 1 position


@needs_onednn
def test_each_end_counts_for_its_own_relative_cost(monkeypatch):
    # SmolLM2 at 16 rows x 5 positions on a 2-core EPYC: packed wins the full batch's pass by a
    # little and loses the one-row pass by 2.2x; by the sum of the two it packed half the time
    ends = {(False, 1, 1): 0.019, (False, 5, 16): 0.215, (True, 1, 1): 0.043, (True, 5, 16): 0.19}
    timed = []

    def fake(backend, rows=1, positions=1, reps=5, context=32):
        timed.append((backend.lean.packed, positions, rows))
        return ends[timed[-1]]

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    pipe = Pipeline.from_config(DEMO + ["proposer=ngram", "proposer.k=4", "max_batch_size=16"])
    assert ends[(True, 5, 16)] + ends[(True, 1, 1)] < ends[(False, 5, 16)] + ends[(False, 1, 1)]
    assert not pipe.packed and not pipe.target.lean.packed
    # the layouts took turns: dense, packed, dense, ...
    layouts = [packed for packed, _, _ in timed]
    assert layouts[:4] == [False, False, True, True] and len(layouts) == 12


@needs_onednn
@pytest.mark.parametrize("packed_faster", [True, False])
def test_auto_times_plain_decoding_of_one_row_too_and_true_false_are_applied(monkeypatch,
                                                                             packed_faster):
    """A one-row, one-position pipeline times that pass both ways: packed wins it on a model
    larger than the cache (SmolLM2 on an EPYC), loses it on one that fits (the demo target)."""
    timed = []

    def fake(backend, rows=1, positions=1, reps=5, context=32):
        timed.append((backend.lean.packed, positions, rows))
        return 0.004 if backend.lean.packed == packed_faster else 0.006

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    plain = Pipeline.from_config(DEMO + ["proposer=none", "draft=none"])
    assert plain.packed is packed_faster and set(timed) == {(False, 1, 1), (True, 1, 1)}
    monkeypatch.setattr(HFBackend, "time_pass", lambda *a, **k: pytest.fail("timed"))
    pipe = Pipeline.from_config(DEMO + ["proposer=none", "draft=none", "pack=true"])
    assert pipe.packed and pipe.target.lean.packed
    # a packed target decodes the same tokens as a dense one (greedy, the demo workload)
    dense = Pipeline.from_config(DEMO + ["proposer=ngram", "pack=false"])
    assert not dense.target.lean.packed
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, x):"]
    assert [r.token_ids for r in pipe.generate(prompts)] == \
        [r.token_ids for r in dense.generate(prompts)]


@needs_onednn
@pytest.mark.parametrize("topk, rows, packed_faster", [(1, 1, True), (4, 1, True), (1, 4, False)])
def test_a_draft_model_packs_by_the_same_rule_at_its_fullest_step(monkeypatch, topk, rows,
                                                                   packed_faster):
    """The draft's fullest step: a tree frontier (topk positions) or one position, in every
    slot; one row at one position (a chain at batch 1) is timed too."""
    timed = []

    def fake(backend, rows=1, positions=1, reps=5, context=32):
        if backend.lean.model.config.hidden_size == 128:          # the demo draft
            timed.append((backend.lean.packed, positions, rows))
        fast = backend.lean.packed == packed_faster
        return (0.004 if fast else 0.006) * (1 + positions * rows / 10)

    monkeypatch.setattr(HFBackend, "time_pass", fake)
    tree = ["proposer.topk=4", "proposer.num_draft_tokens=8"] if topk > 1 else []
    pipe = Pipeline.from_config([*DEMO[:-1], f"max_batch_size={rows}", "draft=demo",
                                 "proposer=draft", "proposer.k=4", *tree])
    assert pipe.draft_packed is packed_faster
    assert pipe.draft.lean.packed is pipe.draft_packed and not pipe.draft.lean.dual
    points = {(1, 1), (1, rows), (topk, rows)} | ({(1, 2)} if rows >= 2 else set())
    assert set(timed) == {(packed, p, q) for packed in (False, True) for p, q in points}
    off = Pipeline.from_config([*DEMO, "draft=demo", "proposer=draft", "pack=false"])
    assert off.draft_packed is False and not off.draft.lean.packed


def test_synthetic_models_never_pack_and_nonsense_is_refused():
    assert Pipeline.from_config(["model=synthetic", "draft=synthetic", "pack=true"]).packed is False
    with pytest.raises(ConfigError, match=r"pack='sometimes'; use auto"):
        Pipeline.from_config(["model=synthetic", "draft=synthetic", "pack=sometimes"])


@needs_onednn
def test_a_draft_keeps_both_layouts_when_packed_wins_only_on_its_wider_steps(monkeypatch):
    """One-row chain steps faster dense, four-row frontier steps faster packed: the draft keeps
    both (its weights once more), each pass taking the faster, and decodes the same tokens."""
    def fake(backend, rows=1, positions=1, reps=5, context=32):
        wide = positions * rows >= 4
        fast = backend.lean.packed == wide
        return (0.004 if fast else 0.006) * (1 + positions * rows / 10)

    tree = ["draft=demo", "proposer=draft", "proposer.k=4", "proposer.topk=4",
            "proposer.num_draft_tokens=8"]
    monkeypatch.setattr(HFBackend, "time_pass", fake)
    pipe = Pipeline.from_config([*DEMO, *tree])
    lean = pipe.draft.lean
    assert pipe.draft_packed and lean.dual and lean.dual_from == 4
    assert lean.extra_bytes() >= sum(p.numel() * 4 for p in lean.model.parameters()) * 0.9
    calls = []
    real = lean._dual[1]
    monkeypatch.setattr(HFBackend, "time_pass", lambda *a, **k: 0.0)
    dense = Pipeline.from_config([*DEMO, *tree, "pack=false"])
    original = lean.mm

    vocab = lean.embed.shape[0]

    def spy(x, w):          # the head may see fewer rows than its pass (logits_to_keep)
        if w.shape[0] != vocab:
            calls.append((x.numel() // x.shape[-1], w.is_mkldnn))
        return original(x, w)
    lean.mm = spy
    lean.native_layers = False     # every product through lean.mm (not one native pass)
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, x):"]
    assert [r.token_ids for r in pipe.generate(prompts, max_new_tokens=24)] == \
        [r.token_ids for r in dense.generate(prompts, max_new_tokens=24)]
    assert {packed for rows, packed in calls if rows < 4} == {False}
    assert {packed for rows, packed in calls if 4 <= rows <= 64} == {True}
    assert real is lean._dual[1]
    lean.unpack()
    assert not lean.packed and not lean.dual
