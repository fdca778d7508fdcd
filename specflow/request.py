"""A request, the row it becomes while it runs, and the result it ends as."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# what a -inf logprob is written as (vLLM's value): JSON has no -inf. The logprobs a run records
# are already finite (zero-probability alternatives left out); JSON writers floor again.
LOGPROB_FLOOR = -9999.0


@dataclass
class Request:
    request_id: int
    prompt: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop: list[str] | None       # None: the config's stop strings
    seed: int
    logprobs: int | None = None  # None: off; 0: the chosen tokens' logprobs; n: also the top n
    sampling: dict | None = None  # its own temperature / top_k / top_p / min_p / penalties
    grammar: dict | None = None   # its own grammar: {"json_schema": ...} | {"regex": ...} | {"choice": [...]}


@dataclass
class GenerationResult:
    index: int
    prompt: str
    text: str                    # never includes a stop string (unless stop.include_stop_str)
    token_ids: list[int]         # generated tokens only; never after EOS or a stop
    finish_reason: str           # "stop" | "eos" | "length"
    stats: dict[str, Any] = field(default_factory=dict)   # docs/design.md §3 names
    logprobs: list[float] | None = None          # target logprob of each returned token
    top_logprobs: list[dict[int, float]] | None = None   # the top-n alternatives per position

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "GenerationResult":
        """Back from `to_json()` (a requests.jsonl line; extra keys are ignored)."""
        return cls(row["index"], row["prompt"], row["text"], row["token_ids"],
                   row["finish_reason"], row.get("stats", {}), row.get("logprobs"),
                   row.get("top_logprobs"))

    def to_json(self) -> dict[str, Any]:
        out = {"index": self.index, "prompt": self.prompt, "text": self.text,
               "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "stats": self.stats}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
            out["top_logprobs"] = self.top_logprobs
        return out


@dataclass
class Row:
    """A request while it runs: its slot, tokens so far (prompt included), sampling state."""

    request: Request
    slot: int
    token_ids: list[int]
    generator: torch.Generator | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
