"""The untimed warm-up before an A/B arm's timed requests, in either engine.

An engine's first call pays costs that no later call pays: the first pass of each shape (oneDNN
primitives, allocator growth), a draft head's or a drafter's first call, lazy imports. vLLM's
CPU build with enforce_eager does no warm-up of its own. Timed inside the first request, they
made a short arm's tokens/s a measure of its start (vLLM plain measured 1.8 tokens/s at 2 prompts
x 16 tokens, its later requests ~30). So every arm first decodes WARMUP_TOKENS of a fixed prompt
that is not one of the workload's, in as many rows as its first timed call holds, and discards
the result; the timed requests start after it.

The warm-up changes no output and no count: greedy tokens do not depend on it, a request's
counts and seconds are its own, and vLLM's prefix cache is emptied after it. What remembers
across requests sees it: a proposer that learns from every request (a suffix cache), and a
policy's cost fits (goodput), which then start from warm passes, as they do in a server.
"""
from __future__ import annotations

from typing import Callable

# code with a repeat in it: n-gram proposers find matches, so drafting and verifying run too
WARMUP_PROMPT = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
WARMUP_TOKENS = 16


def warmup_prompts(tokenizer, mode: str, rows: int, max_length: int | None) -> list[str]:
    """The warm-up prompt (in the chat template where the run's prompts get it), `rows` times;
    [] where the tokenizer cannot take it or the context cannot hold it (a tiny synthetic model)."""
    from specflow.errors import SpecflowError
    from specflow.experiments.workloads import apply_chat_template

    try:
        prompt = apply_chat_template([WARMUP_PROMPT], tokenizer, mode)[0]
        length = len(tokenizer.encode(prompt))
    except SpecflowError:
        return []
    if rows < 1 or (max_length is not None and length + WARMUP_TOKENS >= max_length):
        return []
    return [prompt] * rows


def warm_up_pipeline(pipe, mode: str) -> Callable[[int], int]:
    """specflow's engine: rows -> how many warm-up requests ran, through `pipe.generate` (the
    same rounds, hooks and shapes as the timed call; its results are dropped)."""

    def warm(rows: int) -> int:
        rows = min(rows, int(pipe.cfg.max_batch_size))
        prompts = warmup_prompts(pipe.tokenizer, mode, rows, pipe.target.max_length)
        if prompts:
            pipe.generate(prompts, max_new_tokens=WARMUP_TOKENS, max_batch_size=rows)
        return len(prompts)

    return warm
