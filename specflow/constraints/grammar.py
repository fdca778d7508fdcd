"""Grammar masks (`constraint=json_schema|regex|choice`), identical on draft and target.

Each request keeps only its committed DFA state. A shaped position's state is reached by walking
the drafts it sees from the committed state, so drafting never moves the committed state and a
rejection needs no undo (pitfall 3 in docs/design.md); the committed state advances in specflow_sync_cache over the
tokens actually committed. A draft the grammar forbids (an n-gram proposal, say) leaves a dead
state: the target's mask gives it probability 0, so the verifier rejects it and the positions
after it are never used (pitfall 1 in docs/design.md). The draft model is masked by this same stage, so it never
proposes what the target cannot accept (pitfall 4 in docs/design.md). EOS is allowed only where the grammar can end;
an EOS accepted mid-window ends the request through the stop trimmer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.constraints.index import (choice_regex, compile_index, load_schema, schema_regex)
from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.state import PAD

DEAD = -1


@dataclass
class JsonSchemaConfig:
    name: str = "json_schema"
    schema: str | None = None             # inline JSON, or a path to a .json file
    model: str | None = None              # or a pydantic model by import path (pkg.mod:Model)
    whitespace_pattern: str | None = None  # outlines' default: an optional single space


@dataclass
class RegexConfig:
    name: str = "regex"
    pattern: str = "???"

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ConfigError("constraint.pattern is empty; give a regular expression")


@dataclass
class ChoiceConfig:
    name: str = "choice"
    choices: list[str] | None = None

    def __post_init__(self) -> None:
        if not self.choices or any(c == "" for c in self.choices):
            raise ConfigError("constraint.choices needs at least one non-empty string")


def constraint_regex(cfg) -> tuple[str, str]:
    """(regex, config value to name in errors)."""
    if cfg.name == "json_schema":
        return schema_regex(load_schema(cfg.schema, cfg.model), cfg.whitespace_pattern), \
            "constraint.schema"
    if cfg.name == "regex":
        return cfg.pattern, f"constraint.pattern={cfg.pattern!r}"
    return choice_regex(list(cfg.choices)), "constraint.choices"


class GrammarConstraint:
    def __init__(self, cfg, ctx):
        tok = getattr(ctx.tokenizer, "tok", None)
        if tok is None:
            raise ConfigError("grammar constraints need a transformers tokenizer (model=hf or "
                              "model=demo), not the synthetic model's")
        self.eos_id = ctx.target.eos_token_id
        regex, what = constraint_regex(cfg)
        self.index = compile_index(regex, tok, self.eos_id, what)
        self.V = ctx.target.vocab_size
        self.state: dict[int, int] = {}           # committed DFA state per request
        self.seen: dict[int, int] = {}            # committed tokens already walked
        self._masks: dict[int, torch.Tensor] = {}  # DFA state -> allowed [V] (bool)

    # --- DFA helpers ---------------------------------------------------------------------------

    def step(self, state: int, token: int) -> int:
        if state == DEAD:
            return DEAD
        if token == self.eos_id:
            return state if self.index.is_final_state(state) else DEAD
        nxt = self.index.get_next_state(state, token)
        return DEAD if nxt is None else nxt

    def allowed(self, state: int) -> torch.Tensor:
        mask = self._masks.get(state)
        if mask is None:
            mask = torch.zeros(self.V, dtype=torch.bool)
            if state == DEAD:
                mask[:] = True            # never reached: a rejected draft sits before it
            else:
                mask[self.index.get_allowed_tokens(state)] = True
                if self.eos_id is not None:        # EOS exactly where the grammar may end
                    mask[self.eos_id] = bool(self.index.is_final_state(state))
            self._masks[state] = mask
        return mask

    # --- hooks ----------------------------------------------------------------------------------

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.state[request.request_id] = self.index.get_initial_state()
        self.seen[request.request_id] = len(request.prompt_ids)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.state.pop(request.request_id, None)
        self.seen.pop(request.request_id, None)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        for rid, ids in zip(batch.request_ids, batch.token_ids):
            state = self.state[rid]
            for t in ids[self.seen[rid]:]:
                state = self.step(state, t)
            self.state[rid], self.seen[rid] = state, len(ids)

    @hookimpl
    def specflow_mask_logits(self, shaping):
        B, P, V = shaping.logits.shape
        drafts = shaping.draft_id_lists()
        masks = []
        for b, rid in enumerate(shaping.request_ids):
            state = self.state[rid]
            row = drafts[b]
            for j in range(shaping.first_draft_index):          # drafts before position 0
                state = self.step(state, row[j]) if row[j] != PAD else state
            for p in range(P):
                masks.append(self.allowed(state))
                j = shaping.first_draft_index + p
                if p + 1 < P and j < len(row) and row[j] != PAD:
                    state = self.step(state, row[j])
        allowed = torch.stack(masks).view(B, P, -1).to(shaping.logits.device)          # [B, P, V']
        logits = shaping.logits
        if allowed.shape[-1] < V:        # rows past the tokenizer's vocabulary: never allowed
            pad = torch.zeros(B, P, V - allowed.shape[-1], dtype=torch.bool, device=logits.device)
            allowed = torch.cat([allowed, pad], -1)
        shaping.logits = logits.masked_fill(~allowed[..., :V], float("-inf"))

    def committed_state(self, request_id: int) -> int:
        return self.state[request_id]
