"""Property tests (hypothesis): grammar state after any accept/reject history equals a fresh walk.

Several requests run rounds as the pipeline drives the constraint: drafts (mostly legal random walks
of the DFA from the committed state, sometimes a token the grammar forbids) are shaped by the draft
(one position at a time) and by the target (all K+1 positions), which walks them tentatively; then
only an accepted prefix of the legal drafts plus one allowed token is committed and
specflow_sync_cache runs. After every round the committed state, and the allowed-token mask there,
must equal those of a fresh constraint that consumed the committed tokens in one go; the masks the
target saw must be the grammar's masks after each draft prefix.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specflow.constraints.grammar import (DEAD, ChoiceConfig, GrammarConstraint, JsonSchemaConfig,
                                          RegexConfig)
from specflow.backends.hf.backend import DEMO_DIR, HFTokenizer
from specflow.state import PAD, ShapingBatch

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["io", "net"]}, "maxItems": 2}},
          "required": ["name", "ok"]}
CONSTRAINTS = {
    "regex": RegexConfig(pattern=r"(def|class) [a-z_]{1,12}\(\):"),
    "choice": ChoiceConfig(choices=["yes", "no", "maybe", "not sure"]),
    "json_schema": JsonSchemaConfig(schema=json.dumps(SCHEMA)),
}


@pytest.fixture(scope="module")
def ctx():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    return SimpleNamespace(tokenizer=HFTokenizer(tok, frozenset([tok.eos_token_id])),
                           target=SimpleNamespace(eos_token_id=tok.eos_token_id,
                                                  vocab_size=len(tok)))


def step(g: GrammarConstraint, state: int, token: int) -> int:
    """One DFA step read off the index (not GrammarConstraint.step): EOS only where it may end."""
    if state == DEAD:
        return DEAD
    if token == g.eos_id:
        return state if g.index.is_final_state(state) else DEAD
    nxt = g.index.get_next_state(state, token)
    return DEAD if nxt is None else nxt


def fresh_state(g: GrammarConstraint, generated: list[int]) -> int:
    state = g.index.get_initial_state()
    for t in generated:
        state = step(g, state, t)
    return state


def legal_tokens(g: GrammarConstraint, state: int) -> list[int]:
    """What the grammar allows after `state`: EOS exactly where it may end."""
    if state == DEAD:
        return []
    allowed = set(g.index.get_allowed_tokens(state)) - {g.eos_id}
    return sorted(allowed | ({g.eos_id} if g.index.is_final_state(state) else set()))


def run_rounds(ctx, cfg, data) -> None:
    g = GrammarConstraint(cfg, ctx)
    V = ctx.target.vocab_size
    R = data.draw(st.integers(1, 3), label="requests")
    prompts = {rid: data.draw(st.lists(st.integers(1, V - 1), min_size=1, max_size=4))
               for rid in range(R)}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid in range(R):
        g.specflow_request_start(slot=rid, request=SimpleNamespace(request_id=rid,
                                                                   prompt_ids=prompts[rid]))
    live = list(range(R))
    for _ in range(data.draw(st.integers(1, 10), label="rounds")):
        if not live:
            break
        rows = data.draw(st.permutations(live), label="row order")
        committed = {rid: g.committed_state(rid) for rid in rows}
        # drafts: a random walk of the grammar, now and then a forbidden token; each row its own k
        drafts, legal_prefix = [], []
        for rid in rows:
            state, row, legal = committed[rid], [], None
            for j in range(data.draw(st.integers(0, 5), label="k")):
                options = legal_tokens(g, state)
                if options and data.draw(st.integers(0, 7), label="illegal?") != 0:
                    t = data.draw(st.sampled_from(options), label="draft")
                else:
                    t = data.draw(st.integers(0, V - 1), label="any draft")
                if legal is None and step(g, state, t) == DEAD:
                    legal = j
                row.append(t)
                state = step(g, state, t)
                if t == g.eos_id:
                    break
            drafts.append(row)
            legal_prefix.append(len(row) if legal is None else legal)
            if legal is not None:
                event("a draft the grammar forbids")
        K = max((len(d) for d in drafts), default=0)
        draft_ids = torch.tensor([d + [PAD] * (K - len(d)) for d in drafts],
                                 dtype=torch.long).view(len(rows), K)
        token_ids = [tokens[rid] for rid in rows]

        def expected_mask(b: int, n_drafts: int, rows=rows, drafts=drafts) -> torch.Tensor | None:
            """The grammar's mask after the row's committed tokens and its first n drafts."""
            rid = rows[b]
            state = fresh_state(g, tokens[rid][len(prompts[rid]):] + drafts[b][:n_drafts])
            if state == DEAD:
                return None         # after a forbidden draft: never used
            mask = torch.zeros(V, dtype=torch.bool)
            mask[legal_tokens(g, state)] = True
            return mask

        # the draft model's steps (step i shapes one position, after drafts [0, i)), then the
        # target's K+1 positions
        for i in range(K + 1):
            shaping = ShapingBatch(torch.zeros(len(rows), 1, V), token_ids, draft_ids[:, :i], i,
                                   list(rows), "draft")
            g.specflow_mask_logits(shaping)
            # never an all -inf row (softmax would give NaN), even after a forbidden draft
            assert torch.isfinite(shaping.logits).any(-1).all()
            for b in range(len(rows)):
                want = expected_mask(b, i) if i <= len(drafts[b]) else None
                if want is not None:
                    assert torch.equal(torch.isfinite(shaping.logits[b, 0]), want), (rows[b], i)
        shaping = ShapingBatch(torch.zeros(len(rows), K + 1, V), token_ids, draft_ids, 0,
                               list(rows), "target")
        g.specflow_mask_logits(shaping)
        allowed_seen = torch.isfinite(shaping.logits)                                 # [B, K+1, V]
        assert allowed_seen.any(-1).all()
        for b, rid in enumerate(rows):
            # shaping never moves the committed state
            assert g.committed_state(rid) == committed[rid]
            for p in range(len(drafts[b]) + 1):
                want = expected_mask(b, p)
                if want is not None:
                    assert torch.equal(allowed_seen[b, p], want), (rid, p)
        # verification: an accepted prefix of the legal drafts, then one token the mask allows
        ended = []
        for b, rid in enumerate(rows):
            n = data.draw(st.integers(0, legal_prefix[b]), label="accepted")
            accepted = drafts[b][:n]
            after = fresh_state(g, tokens[rid][len(prompts[rid]):] + accepted)
            options = legal_tokens(g, after)
            new = list(accepted)
            if g.eos_id not in accepted:      # an accepted EOS ends the row (the stop trimmer)
                assert options, "a legal state with nothing allowed"
                new.append(data.draw(st.sampled_from(options), label="recovered/bonus"))
            tokens[rid] += new
            event("drafts rejected" if n < len(drafts[b]) else "all drafts accepted")
            if g.eos_id in new:
                ended.append(rid)
        g.specflow_sync_cache(batch=SimpleNamespace(request_ids=list(rows),
                                                    token_ids=[tokens[rid] for rid in rows]),
                              result=None)
        # the committed state is where a fresh constraint lands on the committed tokens
        for rid in rows:
            generated = tokens[rid][len(prompts[rid]):]
            other = GrammarConstraint(CONSTRAINTS[cfg.name], ctx)
            other.specflow_request_start(slot=0, request=SimpleNamespace(
                request_id=rid, prompt_ids=prompts[rid]))
            other.specflow_sync_cache(batch=SimpleNamespace(request_ids=[rid],
                                                            token_ids=[list(tokens[rid])]),
                                      result=None)
            state = g.committed_state(rid)
            assert state == other.committed_state(rid) == fresh_state(g, generated)
            assert state != DEAD                      # only legal tokens were committed
            assert torch.equal(g.allowed(state), other.allowed(other.committed_state(rid)))
            mask = torch.zeros(V, dtype=torch.bool)
            mask[legal_tokens(g, state)] = True
            assert torch.equal(g.allowed(state), mask)
        for rid in ended:
            event("a request ended with EOS")
            g.specflow_request_end(slot=rid, request=SimpleNamespace(request_id=rid),
                                   finish_reason="eos")
            live.remove(rid)


@pytest.mark.parametrize("name", list(CONSTRAINTS))
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_committed_state_equals_a_fresh_walk_after_any_accept_pattern(ctx, name, data):
    run_rounds(ctx, CONSTRAINTS[name], data)
