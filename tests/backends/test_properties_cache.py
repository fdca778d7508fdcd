"""Property tests (hypothesis): a slot's cache, after any accept/reject history, equals a fresh one.

Several slots with different prompt lengths run rounds as the pipeline does: each round a random
subset of slots (in random order, so slots are not 0..B-1) feeds its last committed token plus k
random drafts (ragged, PAD-padded), a random prefix of the drafts is accepted and one new token is
committed, and TargetCacheSync rolls every slot back to its committed tokens; sometimes a slot is
reset for a new request (continuous batching). Every forward's logits, at every real position, must
equal a from-scratch forward over the committed tokens plus the fed ones, so any stale key/value
of a rejected draft, any row written at the wrong place or any mis-rolled length shows up.

Backends: the synthetic model (history table), and a tiny random Llama through the transformers
backend's SlotKVCache with both transformers' forward and the lean forward.
"""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.synthetic import SyntheticBackend, SyntheticModelConfig
from specflow.stages.cache import TargetCacheSync
from specflow.state import PAD

SLOTS = 3
TOKENS = st.integers(0, 60)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 32, GQA 4/2 heads) with the demo tokenizer, saved once."""
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=0, bos_token_id=0, pad_token_id=0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)       # logits far from uniform
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / name, path / name)
    return path


def synthetic_pair():
    cfg = SyntheticModelConfig(vocab_size=64, contexts=64, seed=3)
    backend = SyntheticBackend(cfg, slots=SLOTS)

    def reference(seq: list[int]) -> torch.Tensor:
        fresh = SyntheticBackend(cfg, slots=1)
        fresh.reset(0)
        return fresh.forward(torch.tensor([0]), torch.tensor([seq]), torch.tensor([len(seq)]))[0]

    return backend, reference, 0.0


def hf_pair(path, forward: str):
    backend = HFBackend(HFModelConfig(path=str(path), forward=forward), torch.device("cpu"), SLOTS)
    model = backend.model

    @torch.inference_mode()
    def reference(seq: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()

    return backend, reference, 1e-4


def run_rounds(backend, reference, atol: float, data) -> int:
    """Random rounds on `backend`; every forward checked against `reference`. -> rounds run."""
    sync = TargetCacheSync(backend)
    committed: dict[int, list[int]] = {}
    for s in range(SLOTS):
        backend.reset(s)

    def start(*slots: int) -> None:
        """New requests in `slots`, admitted together: their prompts are prefilled in one call
        (ragged, batched where the backend can)."""
        requests = []
        for slot in slots:
            # short prompts, or long ones that rounds push past 64 positions (where buffers grow)
            n = data.draw(st.integers(1, 12) | st.integers(48, 64), label=f"prompt length[{slot}]")
            prompt = data.draw(st.lists(TOKENS, min_size=n, max_size=n), label=f"prompt[{slot}]")
            requests.append(SimpleNamespace(prompt_ids=prompt))
            sync.specflow_request_start(slot=slot, request=requests[-1])
            committed[slot] = list(prompt)
        sync.specflow_prefill(slots=list(slots), requests=requests)

    def check(slots, fed, logits) -> None:
        for b, s in enumerate(slots):
            cached = committed[s][:-1]
            want = reference(cached + fed[b])[len(cached):]                            # [n_b, V]
            got = logits[b, :len(fed[b])]
            assert torch.allclose(got, want, atol=atol, rtol=0), (
                f"slot {s}: max diff {(got - want).abs().max():.2e} after {len(cached)} cached")

    start(*range(SLOTS))
    rounds = data.draw(st.integers(2, 10), label="rounds")
    for _ in range(rounds):
        if data.draw(st.integers(0, 5), label="restart?") == 0:     # a new request in some slot
            start(data.draw(st.integers(0, SLOTS - 1), label="restart slot"))
        order = data.draw(st.permutations(list(range(SLOTS))), label="row order")
        slots = order[:data.draw(st.integers(1, SLOTS), label="rows")]
        fed = []
        for s in slots:
            assert backend.cache_length(s) == len(committed[s]) - 1
            k = data.draw(st.integers(0, 6), label="k")
            fed.append([committed[s][-1]] + data.draw(st.lists(TOKENS, min_size=k, max_size=k)))
        T = max(len(f) for f in fed)
        ids = torch.tensor([f + [PAD] * (T - len(f)) for f in fed])                     # [B, T]
        lens = torch.tensor([len(f) for f in fed])
        logits = backend.forward(torch.tensor(slots), ids, lens)                        # [B, T, V]
        check(slots, fed, logits)
        event("ragged rows" if min(lens) < T else "equal rows")
        event("rows in slot order" if slots == list(range(len(slots))) else "rows out of order")
        if max(len(committed[s]) - 1 + len(f) for s, f in zip(slots, fed)) > 64:
            event("past 64 positions")
        for b, s in enumerate(slots):
            drafts = fed[b][1:]
            n = data.draw(st.integers(0, len(drafts)), label="accepted")
            committed[s] += drafts[:n] + [data.draw(TOKENS, label="recovered/bonus")]
        sync.specflow_sync_cache(batch=SimpleNamespace(
            slots=torch.tensor(slots), token_ids=[committed[s] for s in slots]), result=None)
    # finally every slot, one token each (all rows in slot order: the contiguous path) and alone
    for slots in (list(range(SLOTS)), [data.draw(st.integers(0, SLOTS - 1), label="last")]):
        for s in slots:
            assert backend.cache_length(s) == len(committed[s]) - 1
        fed = [[committed[s][-1]] for s in slots]
        logits = backend.forward(torch.tensor(slots), torch.tensor(fed), torch.ones(len(slots),
                                                                                   dtype=torch.long))
        check(slots, fed, logits)
        backend.truncate(torch.tensor(slots), [len(committed[s]) - 1 for s in slots])
    return rounds


CACHE_SETTINGS = settings(max_examples=20, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                 HealthCheck.too_slow, HealthCheck.data_too_large])


@CACHE_SETTINGS
@given(st.data())
def test_synthetic_cache_equals_a_fresh_one_after_any_accept_pattern(data):
    run_rounds(*synthetic_pair(), data)


@pytest.fixture(scope="module")
def kept_backends(tiny_llama_dir):
    return {forward: hf_pair(tiny_llama_dir, forward) for forward in ("hf", "lean")}


@pytest.mark.parametrize("forward", ["hf", "lean"])
@CACHE_SETTINGS
@given(data=st.data())
def test_slot_kv_cache_equals_a_fresh_forward_after_any_accept_pattern(tiny_llama_dir,
                                                                       kept_backends, forward, data):
    # a fresh backend (its buffers grow from nothing past 64 positions) or a kept one (its buffers
    # hold stale keys and values of earlier examples beyond every slot's length)
    fresh = data.draw(st.booleans(), label="fresh backend")
    backend, reference, atol = hf_pair(tiny_llama_dir, forward) if fresh else kept_backends[forward]
    assert (backend.lean is None) == (forward == "hf")
    run_rounds(backend, reference, atol, data)
