"""Grammar constraints on the demo pair: valid output, exact speculation, rollback, bad input."""
from __future__ import annotations

import json

import jsonschema
import pytest

from specflow import ConfigError, Pipeline, hookimpl
from specflow.experiments.workloads import read_prompt_file
from specflow.backends.hf.backend import DEMO_DIR

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["class", "function", "module"]},
        "tags": {"type": "array", "items": {"enum": ["io", "net", "text"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "loc": {"type": "object",
                "properties": {"file": {"type": "string", "maxLength": 16},
                               "line": {"type": "string", "pattern": "[0-9]{1,4}"}},
                "required": ["file", "line"]},
    },
    "required": ["name", "kind", "tags", "ok", "loc"],
}
JSON = ["constraint=json_schema", f"constraint.schema={json.dumps(json.dumps(SCHEMA))}"]
CODE = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"))
PROMPTS = [p + "\n# as JSON:\n" for p in CODE[:40]] + [f"# record {i}\n" for i in range(10)]


def pipe(*overrides):
    return Pipeline.from_config([*overrides, "max_batch_size=16"])


@pytest.fixture(scope="module")
def plain_json():
    return [r.token_ids for r in pipe("proposer=none", *JSON).generate(PROMPTS, max_new_tokens=120)]


@pytest.mark.parametrize("proposer, sampling", [
    ("draft", False),
    # the other proposers and sampling: 15-25 s each, run with the slow tests (CI runs both);
    # greedy grammar exactness for ngram and eagle is also checked by the regex/choice tests
    *[pytest.param(p, False, marks=pytest.mark.slow) for p in ("ngram", "eagle")],
    *[pytest.param(p, True, marks=pytest.mark.slow) for p in ("draft", "ngram", "eagle")],
])
def test_fifty_generations_parse_and_validate(proposer, sampling, plain_json):
    extra = ["logits=[temperature]", "logits.temperature.value=0.8"] if sampling else []
    p = pipe(f"proposer={proposer}", *JSON, *extra)
    results = p.generate(PROMPTS, max_new_tokens=120, seed=5)
    assert len(results) == 50
    for r in results:
        assert r.finish_reason == "eos", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
    if not sampling:     # constrained greedy with speculation == constrained greedy without
        assert [r.token_ids for r in results] == plain_json
    assert p.last_stats["num_accepted_tokens"] > 100


@pytest.mark.parametrize("constraint", [
    ["constraint=regex", "constraint.pattern='(def|class) [a-z_]{1,12}\\(\\):'"],
    ["constraint=choice", "constraint.choices=[yes,no,maybe,'not sure']"],
])
@pytest.mark.parametrize("proposer", ["draft", "ngram", "eagle"])
def test_regex_and_choice_are_exact_under_speculation(constraint, proposer):
    prompts = CODE[:6]
    expected = pipe("proposer=none", *constraint).generate(prompts, max_new_tokens=40)
    got = pipe(f"proposer={proposer}", *constraint).generate(prompts, max_new_tokens=40)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for r in got:    # every choice completes (no stall at the first free choice, pitfall 2 in docs/design.md)
        assert r.finish_reason == "eos"
        if "choice" in constraint[0]:
            assert r.text in ("yes", "no", "maybe", "not sure")


class GrammarProbe:
    """Checks drafts against the grammar and the committed state against a fresh walk."""

    def __init__(self, pipeline):
        self.grammar = pipeline.pm.get_plugin("constraint.json_schema")
        self.drafts_checked = self.states_checked = 0
        self.illegal_drafts = 0

    def walk(self, tokens):
        g = self.grammar
        state = g.index.get_initial_state()
        for t in tokens:
            state = g.step(state, t)
        return state

    @hookimpl(wrapper=True)
    def specflow_propose(self, batch, k):
        proposal = yield
        ids = proposal.draft_token_ids.tolist()
        parents = None if proposal.parents is None else proposal.parents.tolist()
        for b, rid in enumerate(batch.request_ids):
            root, after = self.grammar.committed_state(rid), []    # the state after each node
            for i, t in enumerate(ids[b]):
                if t < 0:
                    break
                parent = i - 1 if parents is None else parents[b][i]     # a tree: its parent's
                after.append(self.grammar.step(root if parent == -1 else after[parent], t))
                self.drafts_checked += 1
                self.illegal_drafts += after[-1] < 0
        return proposal

    @hookimpl(trylast=True)
    def specflow_sync_cache(self, batch, result):
        for b, rid in enumerate(batch.request_ids):
            generated = batch.token_ids[b][batch.prompt_lens[b]:]
            assert self.grammar.committed_state(rid) == self.walk(generated)
            self.states_checked += 1


def test_draft_model_never_proposes_what_the_grammar_forbids_and_state_rolls_back():
    p = pipe("proposer=draft", *JSON, "logits=[temperature]")
    probe = GrammarProbe(p)
    p.register(probe)
    p.generate(PROMPTS[:16], max_new_tokens=120, seed=1)
    assert probe.drafts_checked > 200 and probe.states_checked > 50
    assert probe.illegal_drafts == 0                        # the draft is masked (pitfall 4 in docs/design.md)
    assert p.last_stats["alpha"] < 1                        # rejections happened and rolled back


@pytest.mark.parametrize("proposer", ["draft", "eagle"])
def test_tree_nodes_are_never_ones_the_grammar_forbids(proposer):
    """Every node of a draft model's or a draft head's tree is shaped with its own root path, so
    the grammar masks each branch: no node leaves the grammar, and the output is plain's."""
    tree = [f"proposer={proposer}", "proposer.topk=4", "proposer.num_draft_tokens=16"]
    expected = pipe("proposer=none", *JSON).generate(PROMPTS[:8], max_new_tokens=64)
    p = pipe(*tree, *JSON)
    probe = GrammarProbe(p)
    p.register(probe)
    got = p.generate(PROMPTS[:8], max_new_tokens=64)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert probe.drafts_checked > 300 and probe.states_checked > 50
    assert probe.illegal_drafts == 0
    assert p.last_stats["num_tree_drafts"] > 0


def test_ngram_drafts_the_grammar_forbids_are_rejected_without_a_crash():
    # the prompt is full of text the JSON grammar forbids: n-gram lookup proposes it (pitfall 1 in docs/design.md)
    p = pipe("proposer=ngram", *JSON)
    probe = GrammarProbe(p)
    p.register(probe)
    prompts = ['{"name": "x"} def f(): pass {"name": "x"} def f(): pass {"name": "']
    r = p.generate(prompts, max_new_tokens=120)[0]
    jsonschema.validate(json.loads(r.text), SCHEMA)
    assert probe.illegal_drafts > 0


def test_eos_accepted_inside_a_window_ends_the_request():
    # short answers end with EOS right after the closing brace, usually inside a draft window
    p = pipe("proposer=draft", "proposer.k=8", "constraint=choice", "constraint.choices=[yes,no]")
    for r in p.generate(CODE[:8], max_new_tokens=40):
        assert r.finish_reason == "eos" and r.text in ("yes", "no")
        assert r.stats["num_committed_tokens"] == len(r.token_ids)


@pytest.mark.parametrize("overrides,message", [
    (["constraint=json_schema", "constraint.schema='{\"type\": \"objekt\"}'"],
     "not a valid JSON Schema"),
    (["constraint=json_schema", "constraint.schema='{\"type\": '"], "not valid JSON"),
    (["constraint=json_schema", "constraint.schema=/no/such/schema.json"], "neither inline JSON"),
    (["constraint=json_schema"], "needs constraint.schema"),
    # (a pattern no token can spell: test_unicode_grammar.py, on a word-level tokenizer; the
    # demo's byte-level tokens spell any UTF-8 text)
    (["constraint=regex", "constraint.pattern='abc('"], "not a regex"),
    (["constraint=choice", "constraint.choices=[]"], "at least one"),
    (["model=synthetic", "draft=synthetic", "constraint=regex", "constraint.pattern=ab"],
     "need a tokenizer that spells its tokens as bytes"),
])
def test_bad_constraints_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        Pipeline.from_config(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_pydantic_model_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "shapes.py").write_text(
        "from pydantic import BaseModel, Field\n"
        "class Point(BaseModel):\n"
        "    x: bool\n"
        "    label: str = Field(max_length=6)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    p = pipe("proposer=draft", "constraint=json_schema", "constraint.model=shapes:Point")
    r = p.generate(["# a point\n"], max_new_tokens=60)[0]
    data = json.loads(r.text)
    assert set(data) == {"x", "label"} and isinstance(data["x"], bool)


def test_index_cache_is_keyed_by_the_vocabulary_not_the_object_id():
    from specflow.constraints import index

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

        def __len__(self):
            return len(self.vocab)

    a, b = Tok({"a": 0, "b": 1}), Tok({"a": 0, "c": 1})
    assert index.vocab_key(a, 2) != index.vocab_key(b, 2)
    assert index.vocab_key(a, 2) == index.vocab_key(Tok({"b": 1, "a": 0}), 2)


@pytest.mark.parametrize("path", ["json:loads", "os:getcwd", "collections:OrderedDict"])
def test_constraint_model_must_be_a_pydantic_model(path):
    with pytest.raises(ConfigError, match="is not a pydantic model class"):
        Pipeline.from_config(["proposer=ngram", "constraint=json_schema", f"constraint.model={path}"])


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_a_request_s_own_grammar_beside_free_rows(proposer, plain_json):
    """grammar= per prompt: those rows equal a pipeline configured with that constraint, the
    others stay free text, in one batch, speculation exact."""
    free = pipe("proposer=none").generate(PROMPTS[:6], max_new_tokens=120)
    p = pipe(f"proposer={proposer}")
    schema = {"json_schema": SCHEMA}
    got = p.generate(PROMPTS[:6], max_new_tokens=120,
                     grammar=[schema, None, schema, None, None, schema])
    for i, r in enumerate(got):
        if i in (0, 2, 5):
            assert r.token_ids == plain_json[i]
            jsonschema.validate(json.loads(r.text), SCHEMA)
        else:
            assert r.token_ids == free[i].token_ids
    grammar = p.grammars
    assert grammar.indexes == {} and grammar.state == {}       # released with their requests
    text = "".join(p.stream(PROMPTS[0], max_new_tokens=120, grammar=schema))
    assert text == got[0].text


def test_bad_request_grammars_are_one_clear_error():
    from specflow import InputError

    p = pipe("proposer=none")
    with pytest.raises(InputError, match=r"prompt 0: grammar=.* must be one of"):
        p.generate("x", grammar={"xml": "<a/>"})
    with pytest.raises(InputError, match="prompt 1: grammar json_schema: is not a valid JSON "
                                         "Schema"):
        p.generate(["x", "y"], grammar=[None, {"json_schema": {"type": "objekt"}}])
    with pytest.raises(InputError, match="must be a JSON Schema object"):
        p.generate("x", grammar={"json_schema": "/etc/passwd"})     # never read as a path
    with pytest.raises(InputError, match="grammar= needs a tokenizer that spells its tokens"):
        Pipeline.from_config(["model=synthetic", "draft=synthetic"]).generate(
            "x", grammar={"regex": "a+"})
