"""proposer=self: the target's own layers in int4 (or int8) draft for it. Greedy output equals
plain decoding token for token, chains and trees; a sampled run keeps the target's distribution;
the draft is the target's checkpoint quantized, and a target it cannot copy is one line."""
from __future__ import annotations

import numpy as np
import pytest

from specflow import ConfigError, Pipeline
from specflow.backends.lean.quantized import available
from specflow.stages.proposers.self_draft import SelfProposer

pytestmark = pytest.mark.skipif(not available(4), reason="no CPU weight-only int4 op here")

PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(",
           "import os\nimport", "class Stack:\n    def __init__(self):\n        self",
           "x = [i * i for i in"]
COMMON = ["model=demo", "threads=1", "max_new_tokens=32", "show_progress=false"]


@pytest.fixture(scope="module")
def plain_ids():
    pipe = Pipeline.from_config([*COMMON, "proposer=none", "draft=none"])
    return [r.token_ids for r in pipe.generate(PROMPTS)]


@pytest.mark.parametrize("extra", [[], ["proposer.topk=3", "proposer.num_draft_tokens=8"],
                                   ["proposer.dtype=int8"], ["proposer.draft_vocab=2040"],
                                   ["proposer.draft_vocab=2040", "proposer.topk=3",
                                    "proposer.num_draft_tokens=8", "max_batch_size=3"]])
def test_greedy_self_drafting_equals_plain_decoding(plain_ids, extra):
    pipe = Pipeline.from_config([*COMMON, "proposer=self", *extra])
    got = [r.token_ids for r in pipe.generate(PROMPTS)]
    assert got == plain_ids
    stats = pipe.last_stats
    assert stats["num_accepted_tokens"] > 0.4 * stats["num_draft_tokens"]    # it agrees often
    draft = _draft(pipe)
    bits = 8 if "proposer.dtype=int8" in extra else 4
    assert draft.lean.quantized == (bits, 32) and draft.path == pipe.target.path
    assert pipe.target.lean.quantized is None                     # the target keeps its weights
    cut = next((int(e.split("=")[1]) for e in extra if e.startswith("proposer.draft_vocab")),
               None)
    # the demo's 8192 tokens stay whole under auto; a count is rounded up to the tiles' 16
    rows = pipe.target.vocab_size if cut is None else -(-cut // 16) * 16
    assert draft.lean.lm_head.shape[0] == rows
    assert ("drafting among the first" in draft.describe()["weights"]) == (cut is not None)


def test_draft_vocab_auto_halves_large_vocabularies_only():
    from specflow.stages.proposers.draft import draft_rows

    assert draft_rows("auto", 49152) == 24576 and draft_rows("auto", 32768) == 16384
    assert draft_rows("auto", 128256) == 64128                    # half, up to the tiles' 16
    assert draft_rows("auto", 8192) is None and draft_rows(None, 49152) is None
    assert draft_rows(1000, 49152) == 1000 and draft_rows(50000, 49152) is None


def _draft(pipe):
    return next(p for p in pipe.pm.get_plugins() if isinstance(p, SelfProposer)).model


@pytest.mark.parametrize("prefill", ["target", "own"])
def test_the_drafts_prompt_cache_is_the_targets_unless_it_prefills_its_own(plain_ids, prefill):
    pipe = Pipeline.from_config([*COMMON, "proposer=self", f"proposer.prefill={prefill}"])
    draft, target = _draft(pipe), pipe.target
    prefills = []
    real = draft.prefill_many
    draft.prefill_many = lambda slots, prompts, *a: (prefills.append(slots), real(slots, prompts, *a))[1]
    prompt = PROMPTS[0]
    got = pipe.generate([prompt])[0].token_ids
    assert got == plain_ids[0]
    n = len(target.tokenizer.encode(prompt)) - 1           # the prompt the target prefilled
    same = [bool((draft.cache.keys[layer][0, :, :n] == target.cache.keys[layer][0, :, :n]).all()
                 and (draft.cache.values[layer][0, :, :n] == target.cache.values[layer][0, :, :n]).all())
            for layer in range(draft.num_layers)]
    if prefill == "target":      # copied, bit for bit; the draft never ran its own prefill
        assert all(same) and prefills == []
        assert pipe.last_stats["num_accepted_tokens"] > 0.4 * pipe.last_stats["num_draft_tokens"]
    else:                        # its own int4 layers computed them: not the float target's
        assert not any(same[1:]) and prefills == [[0]]


def test_only_a_cache_of_the_same_layers_and_context_is_adopted():
    import torch

    from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig

    def load(folder, **kw):
        return HFBackend(HFModelConfig(path=str(DEMO_DIR / folder), **kw), torch.device("cpu"), 2)

    target = load("target")
    assert load("target", dtype="int4").can_adopt_cache(target) is None
    assert load("draft").can_adopt_cache(target) is not None               # another model
    assert "context" in load("target", dtype="int4", max_model_len=64).can_adopt_cache(target)


def test_a_target_it_cannot_copy_and_a_bad_dtype_are_one_line():
    with pytest.raises(ConfigError, match="proposer=self drafts with the target's own weights"):
        Pipeline.from_config(["model=synthetic", "draft=synthetic", "proposer=self"])
    with pytest.raises(ConfigError, match="proposer.dtype='float16'; use auto"):
        Pipeline.from_config([*COMMON, "proposer=self", "proposer.dtype=float16"])
    with pytest.raises(ConfigError, match="proposer.prefill='mine'; use target"):
        Pipeline.from_config([*COMMON, "proposer=self", "proposer.prefill=mine"])


@pytest.mark.slow
@pytest.mark.parametrize("cut", [[], ["proposer.draft_vocab=256"]])
def test_sampled_self_drafting_keeps_the_first_two_tokens_distributions(cut):
    """With draft_vocab, tokens past the first ids have q = 0: their mass reaches the output
    through the verifier's residual only."""
    from specflow.experiments.chi_square import independence

    common = ["model=demo", "threads=2", "logits=[temperature,top_p]",
              "logits.temperature.value=1.0", "logits.top_p.p=0.9", "max_batch_size=32",
              "show_progress=false"]
    prompt = "def add(a, b):\n    return"
    n = 1200
    out = {}
    for name in ("plain", "self"):
        # seeds from disjoint ranges: the two arms' samples are independent
        arm = ["proposer=self", "proposer.k=3", f"seed={n}", *cut] if name == "self" \
            else ["proposer=none", "draft=none", "seed=0"]
        pipe = Pipeline.from_config([*arm, *common])
        res = pipe.generate([prompt] * n, max_new_tokens=3)
        out[name] = np.array([(r.token_ids + [-1, -1])[:2] for r in res])   # -1: ended early
        if name == "self" and not cut:
            assert pipe.last_stats["num_accepted_tokens"] > n / 2
        if name == "self" and cut:        # tokens the draft could not propose, drawn all the same
            assert (out["self"] >= 256).any() and pipe.last_stats["num_draft_tokens"] > n
    for pos in (0, 1):
        values = np.unique(np.concatenate([out["plain"][:, pos], out["self"][:, pos]]))
        table = np.stack([[np.sum(out[a][:, pos] == v) for v in values] for a in ("plain", "self")])
        table = table[:, table.sum(0) >= 10]
        assert independence(table).pvalue > 1e-3
