"""An EAGLE-3 head's step as native calls (backends/heads/native_step.py): the head's layer with
its side input and its final norm and LM head compute what the eager step computes (to float
rounding), from weights saved in float16 or float32, for chains and trees, and greedy
speculation over it equals plain decoding."""
from __future__ import annotations

import pytest
import torch

from specflow.backends.lean import native
from tests.backends.heads.test_eagle import PROMPTS, pipeline, tiny_head  # noqa: F401

pytestmark = pytest.mark.skipif(not native.available(torch.float32),
                                reason="no C compiler: specflow's native kernel is not built")


def proposer(hf_models, tiny_head, *overrides):  # noqa: F811
    pipe = pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}", *overrides)
    return pipe, pipe.pm.get_plugin("proposer.eagle")


@pytest.mark.parametrize("dtype", ["float32", "float16"])        # float16: as saved
def test_the_native_step_computes_what_the_eager_step_does(hf_models, tiny_head, dtype):  # noqa: F811
    from specflow.backends.slot_cache import SlotKVCache

    _, prop = proposer(hf_models, tiny_head, f"proposer.dtype={dtype}")
    assert prop.native is not None and prop.describe()["step"].startswith("native")
    # the eager step on the same weights in float32 (float16's widen exactly)
    _, eager = proposer(hf_models, tiny_head, "proposer.dtype=float32")
    eager.native, eager.dtype = None, torch.float32
    head = prop.head
    gen = torch.Generator().manual_seed(0)
    T = 9
    states = torch.randn(2, T, len(head.shape.layer_ids) * 64, generator=gen)       # [B, T, nE]
    tokens = torch.randint(0, 300, (2, T + 3), generator=gen)
    runs = {}
    for way in ("native", "eager"):
        prop = eager if way == "eager" else prop
        prop.cache = SlotKVCache(1, 2, 64)
        out = prop._forward([0, 1], states, tokens[:, 1:T + 1], [T, T - 3])           # [2, T, E]
        g = torch.stack([out[0, T - 1], out[1, T - 4]])[:, None]                       # [2, 1, E]
        steps = [g]
        for j in range(2):
            g = prop._forward([0, 1], g, tokens[:, T + 1 + j:T + 2 + j], [1, 1])
            steps.append(g)
        # row 1's last 3 positions are padding: never read (the native step leaves them)
        runs[way] = (out[0], out[1, :T - 3], torch.cat(steps, 1),
                     prop._logits(torch.cat(steps, 1)))
    for a, b in zip(runs["native"], runs["eager"]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculation_over_the_native_step_equals_plain_decoding(hf_models, tiny_head,  # noqa: F811
                                                                       batch):
    plain = pipeline(hf_models, "proposer=none")
    want = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=24, max_batch_size=1)]
    for tree in ([], ["proposer.topk=2", "proposer.num_draft_tokens=6"]):
        pipe, prop = proposer(hf_models, tiny_head, *tree)
        assert prop.native is not None
        got = pipe.generate(PROMPTS, max_new_tokens=24, max_batch_size=batch)
        assert [r.token_ids for r in got] == want
        assert pipe.last_stats["num_accepted_tokens"] > 0


def test_a_head_held_in_blocks_drafts_natively_and_exactly(hf_models, tiny_head):  # noqa: F811
    """proposer.dtype=int8 | int4: the head's products in GGUF blocks (a half or a quarter of
    float16's bytes a step reads); drafts change a little, the output not at all."""
    from specflow.backends.lean.blocks import BlockWeight

    plain = pipeline(hf_models, "proposer=none")
    want = [r.token_ids for r in plain.generate(PROMPTS[:4], max_new_tokens=24)]
    for dtype in ("int8", "int4"):
        pipe, prop = proposer(hf_models, tiny_head, f"proposer.dtype={dtype}")
        assert isinstance(prop.native.lm_head, BlockWeight)
        assert all(isinstance(w, BlockWeight) for w in prop.native.products)
        assert pipe.backends["proposer"]["dtype"] == dtype
        assert [r.token_ids for r in pipe.generate(PROMPTS[:4], max_new_tokens=24)] == want
        assert pipe.last_stats["num_accepted_tokens"] > 0


def test_auto_holds_the_head_in_int8_blocks_beside_a_float32_target(hf_models, tiny_head,  # noqa: F811
                                                                  monkeypatch):
    """proposer.dtype=auto beside a float32 target, where the native step runs: Q8_0 blocks (half
    of float16's bytes; acceptance as the saved weights'), greedy output plain decoding's; where
    blocks cannot hold the head (a width off 32), the head as saved."""
    from specflow.backends.heads.native_step import NativeHead
    from specflow.backends.lean.blocks import BITS, BlockWeight

    plain = pipeline(hf_models, "proposer=none")
    want = [r.token_ids for r in plain.generate(PROMPTS[:4], max_new_tokens=24)]
    pipe, prop = proposer(hf_models, tiny_head)
    held = [prop.native.fc, prop.native.lm_head, *prop.native.products]
    assert all(isinstance(w, BlockWeight) and BITS[w.kind_code] == 8 for w in held)
    assert pipe.backends["proposer"]["dtype"] == "int8"
    assert [r.token_ids for r in pipe.generate(PROMPTS[:4], max_new_tokens=24)] == want
    assert pipe.last_stats["num_accepted_tokens"] > 0
    build = NativeHead.build.__func__
    monkeypatch.setattr(NativeHead, "build", classmethod(
        lambda cls, head, device, bits=None: None if bits else build(cls, head, device)))
    pipe, prop = proposer(hf_models, tiny_head)
    assert prop.native is not None and not isinstance(prop.native.lm_head, BlockWeight)
    assert pipe.backends["proposer"]["dtype"] == "float16"
    assert [r.token_ids for r in pipe.generate(PROMPTS[:4], max_new_tokens=24)] == want


def test_a_head_in_blocks_without_the_native_step_is_one_line(hf_models, tiny_head,  # noqa: F811
                                                              monkeypatch):
    from specflow import ConfigError
    from specflow.backends.heads.native_step import NativeHead

    monkeypatch.setattr(NativeHead, "build", classmethod(lambda cls, *a: None))
    with pytest.raises(ConfigError, match="proposer.dtype=int8 holds the head in GGUF blocks"):
        proposer(hf_models, tiny_head, "proposer.dtype=int8")


def record_rounds(prop, keep) -> list:
    """Each round's keep(ks, drafts) as the proposer drafts it (its _draft patched)."""
    rounds, draft = [], prop._draft

    def recorded(batch, ks, K):
        drafts, probs = draft(batch, ks, K)
        rounds.append(keep(ks, drafts))
        return drafts, probs
    prop._draft = recorded
    return rounds


@pytest.mark.parametrize("dtype,extra", [("float32", ()), ("int8", ()),
                                         ("float32", ("proposer.min_confidence=0.05",))])
def test_the_greedy_steps_as_one_call_draft_what_the_steps_do(hf_models, tiny_head, dtype,  # noqa: F811
                                                              extra):
    """Where shaping keeps the argmax, every draft step of a round is one native call
    (specflow_head_chain): the drafts of every round equal the step-by-step native calls'
    (proposer.min_confidence stopping rows alike in both)."""
    drafted = {}
    for way in ("chain", "steps"):
        pipe, prop = proposer(hf_models, tiny_head, f"proposer.dtype={dtype}", *extra)
        assert prop.chain_ids is not None
        if way == "steps":
            prop.chain_ids = None
        calls = drafted[way] = record_rounds(prop, lambda ks, drafts: drafts.tolist())
        real = prop.native.chain

        def counted(*args, _real=real, _calls=calls, **kwargs):
            _calls.append("chain")
            return _real(*args, **kwargs)
        prop.native.chain = counted
        pipe.generate(PROMPTS, max_new_tokens=24, max_batch_size=3)
    chained = [d for d in drafted["chain"] if d != "chain"]
    assert len(chained) < len(drafted["chain"])          # the one call ran
    assert "chain" not in drafted["steps"]
    assert chained == drafted["steps"]


@pytest.mark.parametrize("way", ["chain", "steps"])
def test_min_confidence_stops_a_row_at_its_first_unsure_draft(hf_models, tiny_head, way):  # noqa: F811
    """proposer.min_confidence: a chain row stops after its first draft the head gives less
    than that probability (the draft kept), in the one native call and in the step-by-step
    drafting alike; output stays plain decoding's."""
    plain = pipeline(hf_models, "proposer=none")
    want = [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=24)]
    drafted = {}
    for setting in ("0.05", "0.999999", "1e-9"):      # the tiny head is rarely sure
        pipe, prop = proposer(hf_models, tiny_head, f"proposer.min_confidence={setting}")
        if way == "steps":
            prop.chain_ids = None
        rounds = drafted[setting] = record_rounds(
            prop, lambda ks, drafts: (ks, (drafts >= 0).sum(1).tolist()))
        got = pipe.generate(PROMPTS, max_new_tokens=24, max_batch_size=3)
        assert [r.token_ids for r in got] == want
        assert rounds and all(n <= k for ks, ns in rounds for k, n in zip(ks, ns))
    # nearly every draft is unsure: one a row; none is: k a row; 0.05 stops some rows early
    assert all(n == min(k, 1) for ks, ns in drafted["0.999999"] for k, n in zip(ks, ns))
    assert all(n == k for ks, ns in drafted["1e-9"] for k, n in zip(ks, ns))
    counts = [(k, n) for ks, ns in drafted["0.05"] for k, n in zip(ks, ns)]
    assert any(n < k for k, n in counts) and any(n > 1 for k, n in counts)


def test_min_confidence_outside_0_1_or_with_a_tree_is_one_line(hf_models, tiny_head):  # noqa: F811
    from specflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"proposer.min_confidence=1.5 must lie between 0 and 1"):
        proposer(hf_models, tiny_head, "proposer.min_confidence=1.5")
    with pytest.raises(ConfigError, match=r"min_confidence=0.4 stops a chain; with topk=2"):
        proposer(hf_models, tiny_head, "proposer.min_confidence=0.4", "proposer.topk=2")
