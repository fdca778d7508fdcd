"""Grammar masks (`constraint=json_schema|regex|choice`), identical on draft and target.

Each request keeps only its committed DFA state. A shaped position's state is reached by walking
the drafts it sees from the committed state, so drafting never moves the committed state and a
rejection needs no undo (pitfall 3 in docs/design.md); the committed state advances in specflow_sync_cache over the
tokens actually committed. A draft the grammar forbids (an n-gram proposal, say) leaves a dead
state: the target's mask gives it probability 0, so the verifier rejects it and the positions
after it are never used (pitfall 1 in docs/design.md). The draft model is masked by this same stage, so it never
proposes what the target cannot accept (pitfall 4 in docs/design.md). EOS is allowed only where the grammar can end;
an EOS accepted mid-window ends the request through the stop trimmer.

A request may bring its own grammar (`generate(grammar=...)`, the server's `response_format`):
it replaces the configured one for that request. Without `constraint=...` the pipeline still
registers this stage, unconfigured, for such requests; rows without a grammar are not masked.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from specflow.backends.contract import grammar_vocabulary
from specflow.constraints.index import (choice_regex, compile_index, load_schema, schema_regex)
from specflow.errors import ConfigError, InputError
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


def request_regex(spec, index: int) -> tuple[str, str]:
    """A request's grammar -> (regex, what to name in errors). `spec`: {"json_schema": a schema
    (dict or JSON text)}, {"regex": pattern} or {"choice": [strings]}. A schema is never read
    from a path here: request fields do not reach the file system."""
    kinds = ("json_schema", "regex", "choice")
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in kinds:
        raise InputError(f"prompt {index}: grammar={spec!r} must be one of {{'json_schema': "
                         f"schema}}, {{'regex': pattern}}, {{'choice': [strings]}}")
    kind, value = next(iter(spec.items()))
    what = f"prompt {index}: grammar {kind}"
    try:
        if kind == "json_schema":
            text = value if isinstance(value, str) else json.dumps(value)
            if not isinstance(value, (str, dict)) or not text.lstrip().startswith("{"):
                raise InputError(f"{what} must be a JSON Schema object")
            return schema_regex(load_schema(text, None), None), what
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise InputError(f"{what} must be a non-empty regular expression")
            return value, what
        if not isinstance(value, list) or not value or \
                not all(isinstance(c, str) and c for c in value):
            raise InputError(f"{what} must be a non-empty list of non-empty strings")
        return choice_regex(value), what
    except ConfigError as exc:
        raise InputError(f"{what}: {str(exc).replace('constraint.schema ', '')}") from None


class GrammarConstraint:
    def __init__(self, cfg, ctx):
        self.eos_id = ctx.target.eos_token_id
        self.vocabulary = grammar_vocabulary(ctx.tokenizer, self.eos_id)   # the tokens' bytes
        if self.vocabulary is None:
            raise ConfigError(f"grammar constraints need a tokenizer that spells its tokens as "
                              f"bytes, and {type(ctx.tokenizer).__name__} gives none "
                              f"(Tokenizer.grammar_vocabulary); use model=hf or model=demo")
        self.index = None                          # the configured grammar (None: requests' only)
        if cfg is not None:
            regex, what = constraint_regex(cfg)
            self.index = compile_index(regex, self.vocabulary, self.eos_id, what)
        self.V = ctx.target.vocab_size
        self.indexes: dict[int, object] = {}      # request id -> its grammar, while it runs
        self.state: dict[int, int] = {}           # committed DFA state per request
        self.seen: dict[int, int] = {}            # committed tokens already walked
        self._masks: dict[tuple[int, int], torch.Tensor] = {}  # (grammar, state) -> allowed [V]
        self._compiled: dict[str, object] = {}     # requests' grammars by spec, 64 most recent
        self._lock = threading.RLock()             # guards _compiled and the mask cache's drops

    def compile(self, spec, index: int):
        """A request's grammar, compiled (cached per spec); InputError names what is wrong."""
        try:
            key = json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError):
            key = None
        with self._lock:        # a server compiles in its handlers' threads, runs in another
            if key is not None and key in self._compiled:
                self._compiled[key] = self._compiled.pop(key)     # most recently used last
                return self._compiled[key]
        regex, what = request_regex(spec, index)
        try:
            compiled = compile_index(regex, self.vocabulary, self.eos_id, what)
        except ConfigError as exc:
            raise InputError(str(exc)) from None
        if key is not None:
            with self._lock:
                self._compiled[key] = compiled
                while len(self._compiled) > 64:
                    self._release(self._compiled.pop(next(iter(self._compiled))))
        return compiled

    def _release(self, index) -> None:
        """Drop the cached masks of a grammar nothing holds any more (masks are keyed by the
        object's id, which a new grammar could reuse once this one is freed)."""
        with self._lock:
            if index is self.index or any(i is index for i in list(self.indexes.values())) \
                    or any(i is index for i in self._compiled.values()):
                return
            for key in [k for k in list(self._masks) if k[0] == id(index)]:
                self._masks.pop(key, None)

    # --- DFA helpers ---------------------------------------------------------------------------

    def step(self, state: int, token: int, index=None) -> int:
        index = self.index if index is None else index
        if state == DEAD:
            return DEAD
        if token == self.eos_id:
            return state if index.is_final_state(state) else DEAD
        nxt = index.get_next_state(state, token)
        return DEAD if nxt is None else nxt

    def allowed(self, state: int, index=None) -> torch.Tensor:
        index = self.index if index is None else index
        key = (id(index), state)
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.zeros(self.V, dtype=torch.bool)
            if state == DEAD:
                mask[:] = True            # never reached: a rejected draft sits before it
            else:
                mask[index.get_allowed_tokens(state)] = True
                if self.eos_id is not None:        # EOS exactly where the grammar may end
                    mask[self.eos_id] = bool(index.is_final_state(state))
            self._masks[key] = mask
        return mask

    def keeps_argmax(self, request_ids: list[int], sampling, greedy: bool) -> bool:
        """None of these rows' requests runs a grammar (their logits are not masked)."""
        return not any(rid in self.indexes for rid in request_ids)

    # --- hooks ----------------------------------------------------------------------------------

    @hookimpl
    def specflow_request_start(self, slot, request):
        grammar = getattr(request, "grammar", None)
        index = self.compile(grammar, request.request_id) if grammar else self.index
        if index is None:
            return
        self.indexes[request.request_id] = index
        self.state[request.request_id] = index.get_initial_state()
        self.seen[request.request_id] = len(request.prompt_ids)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        index = self.indexes.pop(request.request_id, None)
        self.state.pop(request.request_id, None)
        self.seen.pop(request.request_id, None)
        if index is not None:
            self._release(index)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        for rid, ids in zip(batch.request_ids, batch.token_ids):
            index = self.indexes.get(rid)
            if index is None:
                continue
            state = self.state[rid]
            for t in ids[self.seen[rid]:]:
                state = self.step(state, t, index)
            self.state[rid], self.seen[rid] = state, len(ids)

    @hookimpl
    def specflow_mask_logits(self, shaping):
        if not self.indexes or not any(r in self.indexes for r in shaping.request_ids):
            return                     # no row here has a grammar
        B, P, V = shaping.logits.shape
        drafts = shaping.draft_id_lists()
        everything = torch.ones(self.V, dtype=torch.bool)
        masks = []
        for b, rid in enumerate(shaping.request_ids):
            index = self.indexes.get(rid)
            if index is None:
                masks += [everything] * P
                continue
            state = self.state[rid]
            row = drafts[b]
            for j in range(shaping.first_draft_index):          # drafts before position 0
                state = self.step(state, row[j], index) if row[j] != PAD else state
            for p in range(P):
                masks.append(self.allowed(state, index))
                j = shaping.first_draft_index + p
                if p + 1 < P and j < len(row) and row[j] != PAD:
                    state = self.step(state, row[j], index)
        allowed = torch.stack(masks).view(B, P, -1).to(shaping.logits.device)          # [B, P, V']
        logits = shaping.logits
        if allowed.shape[-1] < V:        # rows past the tokenizer's vocabulary: never allowed
            pad = torch.zeros(B, P, V - allowed.shape[-1], dtype=torch.bool, device=logits.device)
            allowed = torch.cat([allowed, pad], -1)
        shaping.logits = logits.masked_fill(~allowed[..., :V], float("-inf"))

    def committed_state(self, request_id: int) -> int:
        return self.state[request_id]
