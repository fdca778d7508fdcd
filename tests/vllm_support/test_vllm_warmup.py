"""An engine=vllm arm's first timed request comes after vLLM's warm-up (a stand-in LLM whose first
generate() call is COLD seconds dearer, with vLLM's request timestamps; no vLLM needed)."""
from __future__ import annotations

import sys
import time
import types
from types import SimpleNamespace

import pytest

from specflow.app.warmup import WARMUP_PROMPT, WARMUP_TOKENS
from specflow.config import compose
from specflow.vllm.engine import VllmRunner

COLD = 0.3
PROMPTS = [(0, "def add(a, b): return a + b"), (1, "x = 1, z = 3, x = 1, z = 3")]


class Tokenizer:
    eos_token_ids = frozenset()

    def encode(self, text):
        return [ord(c) % 97 for c in text]


class FakeLLM:
    """vLLM's LLM.generate as the runner reads it: the first call (of the process) costs COLD
    more; each request's metrics span the call, as vLLM's scheduled and last-token times do."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], int]] = []     # (prompt ids, max_tokens)
        self.events: list[str] = []

    def generate(self, prompts, params, use_tqdm=False):
        start = time.monotonic()
        if not self.calls:
            time.sleep(COLD)
        self.calls.append(([list(p["prompt_token_ids"]) for p in prompts], params.max_tokens))
        self.events.append("generate")
        end = time.monotonic()
        done = SimpleNamespace(text="ab", token_ids=[5, 6], finish_reason="length", stop_reason=None,
                               spec_decode_metrics=None)
        return [SimpleNamespace(outputs=[done], metrics=SimpleNamespace(scheduled_ts=start,
                                                                        last_token_ts=end))
                for _ in prompts]

    def reset_prefix_cache(self):
        self.events.append("reset")


@pytest.fixture
def runner(monkeypatch):
    """A VllmRunner on the stand-in (vLLM's SamplingParams and TokensPrompt faked where vLLM is
    not installed)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        fake = types.ModuleType("vllm")
        fake.SamplingParams = lambda **kw: SimpleNamespace(**kw)
        inputs = types.ModuleType("vllm.inputs")
        inputs.TokensPrompt = dict
        monkeypatch.setitem(sys.modules, "vllm", fake)
        monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    r = object.__new__(VllmRunner)
    r.cfg = compose(["model=synthetic", "engine=vllm", "proposer=none", "max_new_tokens=2",
                     "max_batch_size=2"])
    r.args = {"speculative_config": None}
    r.tokenizer, r.llm, r.session = Tokenizer(), FakeLLM(), "test"
    return r


def timed(r: VllmRunner, warm_up: bool) -> list[float]:
    rows: list[dict] = []
    r.generate(PROMPTS, rows.append, warm_up=warm_up)
    return [row["stats"]["seconds"]["engine"] for row in rows]


def test_the_first_timed_call_comes_after_the_warm_up_and_an_empty_prefix_cache(runner):
    seconds = timed(runner, warm_up=True)
    assert max(seconds) < COLD, seconds
    (warm, warm_tokens), (timed_ids, tokens) = runner.llm.calls
    assert warm == [Tokenizer().encode(WARMUP_PROMPT)] * 2 and warm_tokens == WARMUP_TOKENS
    assert timed_ids == [Tokenizer().encode(p) for _, p in PROMPTS] and tokens == 2
    assert runner.llm.events == ["generate", "reset", "generate"]


def test_without_the_warm_up_the_first_timed_call_pays_the_first_call(runner):
    """The stand-in is felt where nothing warms up: the test above can fail."""
    assert min(timed(runner, warm_up=False)) >= COLD
    assert len(runner.llm.calls) == 1
