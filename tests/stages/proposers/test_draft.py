"""proposer=draft caches a row only when the row drafts, and that catch-up is prefill, not drafting."""
from __future__ import annotations

import torch

from specflow.stages.proposers.draft import DraftModelProposer
from specflow.state import PAD, DecodeBatch


class CountingForwards:
    """Wraps a backend's forward and prefill_many to count the positions it computed."""

    def __init__(self, backend):
        self.positions, self.prefilled = 0, []
        forward, prefill_many = backend.forward, backend.prefill_many

        def counted_forward(slots, input_ids, input_lens, *a, **k):
            self.positions += int(input_lens.sum())
            return forward(slots, input_ids, input_lens, *a, **k)

        def counted_prefill(slots, prompts):
            self.prefilled.append([len(p) for p in prompts])
            return prefill_many(slots, prompts)
        backend.forward, backend.prefill_many = counted_forward, counted_prefill


def _proposer(pipe) -> DraftModelProposer:
    return next(p for p in pipe.pm.get_plugins() if isinstance(p, DraftModelProposer))


def test_the_draft_model_never_runs_while_no_row_drafts(make_pipeline):
    # under load a policy sets k = 0 for everyone; the draft then costs nothing (it used to
    # prefill every prompt on admission and lag behind anyway)
    pipe = make_pipeline("proposer=draft", "proposer.k=0", "max_batch_size=3", "max_new_tokens=12")
    seen = CountingForwards(pipe.draft)
    out = pipe.generate(["def fib(n):", "class A:", "import os"])
    assert all(r.token_ids for r in out)
    assert seen.positions == 0 and seen.prefilled == []
    assert all(pipe.draft.cache_length(s) == 0 for s in range(3))


def test_rows_that_start_drafting_late_catch_up_and_stay_exact(make_pipeline):
    # k = 0 while three rows run, k = 4 once one is left: the last row's draft cache is empty
    # when it starts drafting, so its prompt and every token committed so far are cached in one
    # prefill call before the first draft step; greedy output equals plain decoding's
    ranges = "policy.ranges=[{up_to: 1, k: 4}, {up_to: null, k: 0}]"
    prompts = ["def fib(n):", "class A:", "import os"]
    budgets = [4, 8, 40]
    plain = make_pipeline("proposer=none", "max_batch_size=3")
    want = [plain.generate(p, max_new_tokens=n)[0].token_ids for p, n in zip(prompts, budgets)]
    pipe = make_pipeline("proposer=draft", "policy=schedule", ranges, "max_batch_size=3")
    seen = CountingForwards(pipe.draft)
    rounds = []
    pipe.register(_RoundSpy(rounds))
    got = [None] * 3
    with pipe.engine() as engine:
        ids = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    got[ids.index(o.request_id)] = o.result.token_ids
    assert got == want
    assert len(seen.prefilled) == 1 and len(seen.prefilled[0]) == 1      # one row, once
    assert seen.prefilled[0][0] > len(pipe.tokenizer.encode(prompts[2]))  # prompt + generated
    drafting = [r for r in rounds if any(r.num_drafts)]
    assert drafting and "prefill" in drafting[0].seconds                  # timed as prefill
    assert all("prefill" not in r.seconds for r in drafting[1:])          # steady: no catch-up


class _RoundSpy:
    def __init__(self, rounds):
        self.rounds = rounds

    from specflow.plugins import hookimpl

    @hookimpl
    def specflow_round_end(self, result, pipeline):
        self.rounds.append(result)


def test_catch_up_pads_no_row_to_another_s_lag(make_pipeline):
    # row 0 is steady (its draft cache lacks only its last token), row 1 has never drafted: row 1
    # alone is prefilled, and each draft step then feeds one token per row instead of padding
    # row 0 to row 1's whole lag
    pipe = make_pipeline("proposer=draft", "proposer.k=2", "max_batch_size=2")
    prop, draft = _proposer(pipe), pipe.draft
    ids0 = pipe.tokenizer.encode("def fib(n): return n")
    ids1 = pipe.tokenizer.encode("class A: pass  # a longer prompt than the other one")
    draft.prefill(0, ids0[:-1])
    seen = CountingForwards(draft)
    widths = []
    forward = draft.forward

    def spy(slots, input_ids, input_lens, *a, **k):
        widths.append((len(slots), input_ids.shape[1]))
        return forward(slots, input_ids, input_lens, *a, **k)
    draft.forward = spy
    batch = DecodeBatch(slots=torch.tensor([0, 1]), request_ids=[0, 1], token_ids=[ids0, ids1],
                        prompt_lens=[len(ids0), len(ids1)], max_new_tokens=[8, 8],
                        generators=[None, None], greedy=True, max_batch_size=2, shaper=pipe.shape)
    proposal = prop.specflow_propose(batch=batch, k=torch.tensor([2, 2]))
    assert (proposal.draft_token_ids != PAD).sum().item() == 4
    assert seen.prefilled == [[len(ids1) - 1]] and proposal.catch_up_seconds > 0
    steps = [w for w in widths if w[0] == 2]
    assert steps == [(2, 1), (2, 1)]                    # k = 2 steps, one token per row each
    assert draft.cache_length(0) == len(ids0) + 1 and draft.cache_length(1) == len(ids1) + 1


def test_the_draft_proposer_says_what_each_row_must_catch_up_on(make_pipeline):
    """specflow_catch_up_tokens: per row, the tokens its draft cache lags beyond the CATCH_UP a
    first step feeds, exactly what the proposer prefills before the row drafts (what a policy
    prices; answered through the pipeline's hooks, for any proposer that has such a cost)."""
    pipe = make_pipeline("proposer=draft", "proposer.k=2", "max_batch_size=2")
    prop, draft = _proposer(pipe), pipe.draft
    ids0 = pipe.tokenizer.encode("def fib(n): return n")
    ids1 = pipe.tokenizer.encode("class A: pass  # a longer prompt than the other one")
    batch = DecodeBatch(slots=torch.tensor([0, 1]), request_ids=[0, 1], token_ids=[ids0, ids1],
                        prompt_lens=[len(ids0), len(ids1)], max_new_tokens=[8, 8],
                        generators=[None, None], greedy=True, max_batch_size=2, shaper=pipe.shape)
    free = DraftModelProposer.CATCH_UP
    assert pipe.hook.specflow_catch_up_tokens(batch=batch) == [len(ids0) - free, len(ids1) - free]
    draft.prefill(0, ids0[:-1])                         # row 0's draft holds all but the last
    assert pipe.hook.specflow_catch_up_tokens(batch=batch) == [0, len(ids1) - free]
    seen = CountingForwards(draft)
    prop.specflow_propose(batch=batch, k=torch.tensor([2, 2]))
    assert seen.prefilled == [[len(ids1) - 1]]          # the lagging row alone, caught up
    batch.token_ids = [ids0 + [5], ids1 + [5]]           # committed, drafts rolled back
    prop.specflow_sync_cache(batch=batch, result=None)
    assert pipe.hook.specflow_catch_up_tokens(batch=batch) == [0, 0]
    assert make_pipeline("proposer=ngram").hook.specflow_catch_up_tokens(batch=batch) is None


def test_a_draft_model_cut_to_its_first_token_ids_keeps_greedy_output():
    """proposer.draft_vocab on a draft model of the target's tokenizer: its LM head's first rows
    (rounded up to 16), the note in its weights, greedy output plain decoding's (chains and
    trees, batch 3). pack=false: a head in oneDNN's packed rows is not cut."""
    import pytest

    from specflow import ConfigError, Pipeline

    base = ["model=demo", "threads=1", "max_new_tokens=24", "show_progress=false", "pack=false",
            "max_batch_size=3"]
    prompts = ["def fib(n):\n", "import os\n", "class Stack:\n    def push(self, x):\n"]
    plain = [r.token_ids for r in Pipeline.from_config([*base, "proposer=none", "draft=none"])
             .generate(prompts)]
    for tree in ([], ["proposer.topk=3", "proposer.num_draft_tokens=8"]):
        pipe = Pipeline.from_config([*base, "proposer=draft", "proposer.draft_vocab=2040", *tree])
        assert [r.token_ids for r in pipe.generate(prompts)] == plain
        draft = _proposer(pipe).model
        assert draft.lean.lm_head.shape[0] == 2048
        assert draft.describe()["weights"].endswith(
            "drafting among the first 2048 of 8192 tokens (proposer.draft_vocab)")
    whole = _proposer(Pipeline.from_config([*base, "proposer=draft"])).model   # auto: 8192 stay
    assert whole.lean.lm_head.shape[0] == 8192
    with pytest.raises(ConfigError, match="proposer.draft_vocab='half'; use auto"):
        Pipeline.from_config([*base, "proposer=draft", "proposer.draft_vocab=half"])
