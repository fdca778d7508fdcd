"""Greedy draft steps as one native call (backends/lean/native_chain.py, gemv.c's specflow_chain):
the tokens and the cache the torch steps leave, bit for bit; ragged steps; left alone where
it does not run; and proposer=draft takes it only where shaping leaves the argmax alone."""
from __future__ import annotations

import pytest
import torch

from specflow.backends.lean import native, native_chain
from specflow.backends.hf.backend import DEMO_DIR

from tests.backends.lean.test_native_pass import backend_for, prefill, tiny_llama

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP here")

LENGTHS = [37, 5, 120]


def torch_steps(backend, fed: list[list[int]], steps: list[int],
                min_confidence: float = 0.0) -> list[list[int]]:
    """Each row's greedy steps one forward() at a time (the proposer's torch path): its tokens
    `fed` first, then the token each step found; a row stops after a token whose softmax
    probability is below min_confidence."""
    out = []
    for slot, (tokens, n) in enumerate(zip(fed, steps)):
        row = []
        for _ in range(n):
            logits = backend.forward(torch.tensor([slot]), torch.tensor([tokens]),
                                     torch.tensor([len(tokens)]))                     # [1, T, V]
            tokens = [int(logits[0, -1].argmax())]
            row.append(tokens[0])
            if logits[0, -1].softmax(-1)[tokens[0]] < min_confidence:
                break
        out.append(row + [-1] * (max(steps) - len(row)))
    return out


def model_path(tmp_path, model: str) -> str:
    return str(DEMO_DIR / "draft") if model == "demo draft" else tiny_llama(tmp_path)


@pytest.mark.parametrize("model", ["demo draft", "tiny llama"])
@pytest.mark.parametrize("dtype", ["float32", "int8", "int8, embedding in the head's blocks"])
def test_the_chain_finds_the_torch_steps_tokens_and_leaves_their_cache(tmp_path, model, dtype):
    backend = backend_for(model_path(tmp_path, model))
    if dtype != "float32":
        backend.lean.quantize(8)
    if "embedding" in dtype:     # looked up in the tied head's blocks, as a GGUF file's table is
        backend.lean.embed_held = backend.lean.lm_head
    # a row fed one token, one skipped, one catching up on three committed tokens
    fed, steps = [[11], [700], [4000, 12, 13]], [3, 0, 5]
    prefill(backend, LENGTHS)
    want = torch_steps(backend, fed, steps)
    want_lengths = backend.cache.lengths[:3]
    nxt = backend.forward(torch.arange(3), torch.tensor([[5], [6], [7]]), torch.tensor([1] * 3))
    prefill(backend, LENGTHS)
    got = backend.greedy_steps([0, 1, 2], fed, steps, backend.vocab_size)
    assert got is not None and got.tolist() == want
    assert backend.cache.lengths[:3] == want_lengths
    # the keys and values the chain cached are the torch steps': the next pass scores the same
    after = backend.forward(torch.arange(3), torch.tensor([[5], [6], [7]]), torch.tensor([1] * 3))
    torch.testing.assert_close(after, nxt, atol=1e-5, rtol=1e-5)


def test_min_confidence_stops_the_chain_where_the_torch_steps_stop(tmp_path):
    backend = backend_for(DEMO_DIR / "draft")
    fed, steps = [[11], [700], [4000, 12, 13]], [6, 6, 6]
    prefill(backend, LENGTHS)
    free = torch_steps(backend, fed, steps)
    for t in (0.5, 0.9):
        prefill(backend, LENGTHS)
        want = torch_steps(backend, fed, steps, t)
        want_lengths = backend.cache.lengths[:3]
        nxt = backend.forward(torch.arange(3), torch.tensor([[5], [6], [7]]), torch.tensor([1] * 3))
        prefill(backend, LENGTHS)
        got = backend.greedy_steps([0, 1, 2], fed, steps, backend.vocab_size, min_confidence=t)
        assert got is not None and got.tolist() == want
        assert backend.cache.lengths[:3] == want_lengths
        after = backend.forward(torch.arange(3), torch.tensor([[5], [6], [7]]), torch.tensor([1] * 3))
        torch.testing.assert_close(after, nxt, atol=1e-5, rtol=1e-5)
    # each stopped row is a prefix of its free run; 0.9 stops a row early that 0.5 does not
    assert all(w[:len([x for x in w if x >= 0])] == f[:len([x for x in w if x >= 0])]
               for w, f in zip(want, free))
    assert want != free


def test_the_argmax_stays_inside_the_vocabulary_asked_for(tmp_path):
    # a draft whose table is wider than the target's vocabulary: tokens past it are never drafted
    backend = backend_for(DEMO_DIR / "draft")
    prefill(backend, [9])
    backend.lean.lm_head = backend.lean.lm_head.clone()
    backend.lean.lm_head[5000:] = 0
    backend.lean.lm_head[7000] = 10.0           # the largest logit, outside the first 6000
    got = backend.greedy_steps([0], [[3]], [2], 6000)
    assert got is not None and (got < 6000).all() and (got >= 0).all()


def test_where_the_chain_does_not_run_the_backend_says_so(tmp_path):
    backend = backend_for(DEMO_DIR / "draft")
    prefill(backend, [9])
    backend.lean.native_layers = False            # the eager layers: no native pass to chain
    assert not native_chain.runs(backend.lean, backend.cache)
    assert backend.greedy_steps([0], [[3]], [2], backend.vocab_size) is None
    assert backend.cache.lengths[0] == 9                      # nothing was fed


class ChainSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = native_chain.chain

        def counted(*args, **kwargs):
            out = real(*args, **kwargs)
            self.calls += out is not None
            return out
        monkeypatch.setattr(native_chain, "chain", counted)


@pytest.mark.parametrize("extra,chained", [
    ((), True),
    (("proposer.min_confidence=0.6",), True),
    (("logits=[repetition_penalty]", "logits.repetition_penalty.penalty=1.3"), False),
    (("constraint=regex", "constraint.pattern='(def|class) [a-z_]{1,12}\\(\\):'"), False),
])
def test_proposer_draft_chains_only_where_shaping_keeps_the_argmax(make_pipeline, monkeypatch,
                                                                   extra, chained):
    prompts = ["def fib(n):", "class Stack:", "import os"]
    shaping = [e for e in extra if not e.startswith("proposer.")]
    plain = make_pipeline("model=demo", "draft=demo", "proposer=none", "max_batch_size=3", *shaping)
    want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=24)]
    spy = ChainSpy(monkeypatch)
    pipe = make_pipeline("model=demo", "draft=demo", "proposer=draft", "max_batch_size=3", *extra)
    got = [r.token_ids for r in pipe.generate(prompts, max_new_tokens=24)]
    assert got == want
    assert (spy.calls > 0) == chained


def test_a_request_with_its_own_bias_or_grammar_keeps_the_shaping_call(make_pipeline):
    pipe = make_pipeline("model=demo", "draft=demo", "proposer=draft")
    assert pipe.keeps_argmax([0, 1], None, True)
    assert not pipe.keeps_argmax([0, 1], None, False)                        # sampling
    assert not pipe.keeps_argmax([0, 1], [None, {"logit_bias": {5: 3.0}}], True)


def test_a_row_with_no_finite_logit_drafts_token_0_as_the_shaping_call_leaves_it(tmp_path):
    # shape()'s mark_empty zeroes a row whose largest logit is not finite; its argmax is 0
    backend = backend_for(DEMO_DIR / "draft")
    prefill(backend, [9, 9])
    backend.lean.lm_head = backend.lean.lm_head.clone()
    backend.lean.lm_head[100] = float("nan")            # a NaN in every row's logits
    got = backend.greedy_steps([0, 1], [[3], [4]], [3, 2], backend.vocab_size)
    assert got is not None and got.tolist() == [[0, 0, 0], [0, 0, -1]]
