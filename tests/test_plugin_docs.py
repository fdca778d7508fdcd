"""Every recipe in docs/plugins.md runs in a pipeline and does what its text says."""
from __future__ import annotations

import re

import pytest

from specflow import Pipeline, hookdoc, hookimpl


def recipes() -> dict[str, dict]:
    """Namespace of each ```python block under '## Recipes', keyed by its '### ' heading."""
    text = hookdoc.DOC.read_text(encoding="utf-8")
    section = text.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    out = {}
    for part in section.split("\n### ")[1:]:
        title = part.splitlines()[0].strip()
        blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
        assert len(blocks) == 1, title
        namespace: dict = {}
        exec(compile(blocks[0], f"docs/plugins.md: {title}", "exec"), namespace)
        out[title] = namespace
    return out


RECIPES = recipes()
SYNTHETIC = ["model=synthetic", "draft=synthetic"]
PROMPTS = ["abcab", "xyz"]


def test_the_six_recipes_are_there():
    assert list(RECIPES) == ["A proposer", "A proposer that reads hidden states",
                             "A logit processor", "A constraint", "A policy", "An observer"]


def run(overrides, stage):
    pipe = Pipeline.from_config([*SYNTHETIC, *overrides], plugins=[stage])
    return pipe, pipe.generate(PROMPTS, max_new_tokens=24)


def test_proposer_recipe_is_exact_and_proposes():
    ns = RECIPES["A proposer"]
    plain = Pipeline.from_config([*SYNTHETIC, "proposer=none"]).generate(PROMPTS, max_new_tokens=24)
    pipe, out = run(["proposer=none", "policy.k=3"], ns["Echo"](ns["EchoConfig"](), None))
    assert pipe.last_stats["num_draft_tokens"] > 0
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    with pytest.raises(Exception, match="proposer.k=-1"):
        ns["EchoConfig"](k=-1)


def test_hidden_state_recipe_reads_the_states_drafts_and_stays_exact():
    """On the demo target (a transformers model with hidden states), batch 1 and 3."""
    ns = RECIPES["A proposer that reads hidden states"]
    prompts = ["def fib(n):", "class Stack:\n    def push(self, x):", "import os\n"]
    plain = Pipeline.from_config(["proposer=none"]).generate(prompts, max_new_tokens=12)
    for batch in (1, 3):
        pipe = Pipeline.from_config(["proposer=none", "policy.k=1", "draft=none"])
        head = ns["StateHead"](ns["StateHeadConfig"](), pipe.ctx)
        class Spy:
            seen: list[int] = []

            @hookimpl
            def specflow_target_states(self, states):
                self.seen.append(states.hidden.shape[-1])

        spy = Spy()
        pipe.register(head)
        pipe.register(spy)
        out = pipe.generate(prompts, max_new_tokens=12, max_batch_size=batch)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
        assert pipe.last_stats["num_draft_tokens"] > 0
        assert spy.seen and set(spy.seen) == {pipe.target.hidden_size}
        assert head.states == {}                       # every request's states released


def test_processor_recipe_bans_immediate_repeats():
    ns = RECIPES["A logit processor"]
    _, out = run(["proposer=draft"], ns["NoImmediateRepeat"](None, None))
    for r in out:
        ids = [*r.token_ids]
        assert all(a != b for a, b in zip(ids, ids[1:]))


def test_constraint_recipe_limits_runs():
    ns = RECIPES["A constraint"]
    _, out = run(["proposer=draft"], ns["MaxRun"](ns["MaxRunConfig"](run=1), None))
    for r in out:
        assert all(a != b for a, b in zip(r.token_ids, r.token_ids[1:]))


def test_policy_recipe_adapts_k():
    ns = RECIPES["A policy"]
    pipe = Pipeline.from_config([*SYNTHETIC, "proposer=draft", "proposer.k=8",
                                 "draft.noise=0.9", "logits=[temperature]"])
    pipe.pm.unregister(name="policy.static")
    policy = ns["Halving"](ns["HalvingConfig"](), None)
    pipe.register(policy)

    class Spy:
        ks: list = []

        @hookimpl(wrapper=True)
        def specflow_draft_length(self):
            k = yield
            self.ks += k.tolist()
            return k

    pipe.register(Spy())
    pipe.generate(PROMPTS, max_new_tokens=48)
    assert Spy.ks[0] == 8 and min(Spy.ks) < 8


def test_observer_recipe_times_the_proposer(capsys):
    ns = RECIPES["An observer"]
    timer = ns["ProposeTimer"](None, None)
    pipe, _ = run(["proposer=draft"], timer)
    assert timer.calls > 0 and timer.seconds > 0
    assert "propose:" in capsys.readouterr().out
