"""A third-party backend that implements only the `Backend` contract (no transformers) runs every
proposer that needs no transformers model, under every policy, greedy-equal to plain decoding;
and a third-party proposer reads the target's hidden states through the contract alone
(specflow_hidden_layers / specflow_target_states), as an EAGLE, MTP or Medusa head would."""
from __future__ import annotations

import os
import sys

import pytest

from fake_plugins import install_fake_plugin
from specflow import plugins

# The toy model: logits at position t are A[x_t] + B[x_{t-1}] (fixed random tables), so a pass
# must read the cache; a tree node's previous token is its parent's. The "input of layer i" at
# position t is (i + 1) * [onehot(x_t), onehot(x_{t-1})]: a proposer that decodes x_{t-1} from
# it drafts exactly what the target will say, if and only if the states are the right ones.
TOY_SOURCE = '''
from dataclasses import dataclass

import torch

from specflow import hookimpl
from specflow.backends.contract import Backend
from specflow.state import PAD, Proposal

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?\\n"


class Tok:
    eos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [CHARS.index(c) for c in text]

    def decode(self, ids):
        return "".join(CHARS[i] for i in ids)


@dataclass
class ToyConfig:
    name: str = "toy"
    seed: int = 0
    noise: float = 0.0          # a draft: its tables moved toward another draw


class Toy(Backend):
    name = "toy"
    supports_trees = True
    supports_hidden_states = True

    def __init__(self, cfg, ctx):
        V = self.vocab_size = len(CHARS)
        g = torch.Generator().manual_seed(cfg.seed)
        self.A, self.B = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
        if cfg.noise:
            h = torch.Generator().manual_seed(cfg.seed + 1)
            self.A = self.A + cfg.noise * torch.randn(V, V, generator=h)
        self.tokenizer, self.max_length = Tok(), 4096
        self.cache = {}                     # slot -> cached tokens, with each one's predecessor
        self.passes = 0

    def reset(self, slot):
        self.cache[slot] = []

    def cache_length(self, slot):
        return len(self.cache.setdefault(slot, []))

    def truncate(self, slots, lengths):
        for s, n in zip(slots.tolist(), lengths):
            del self.cache[s][n:]

    def _states(self, pairs, layers):
        V = self.vocab_size
        one = torch.eye(V)
        base = torch.stack([torch.cat([one[x], one[prev]]) for x, prev in pairs])  # [T, 2V]
        return torch.cat([(i + 1) * base for i in sorted(layers)], -1)           # [T, n 2V]

    def forward(self, slots, input_ids, input_lens, hidden_layers=(), tree=None):
        B, T = input_ids.shape
        self.passes += 1
        logits = torch.zeros(B, T, self.vocab_size)
        hidden = torch.zeros(B, T, 2 * self.vocab_size * len(hidden_layers))
        for b, (s, n) in enumerate(zip(slots.tolist(), input_lens.tolist())):
            row = self.cache.setdefault(s, [])          # (token, position) per cached entry
            pairs = []
            for t in range(n):
                x = int(input_ids[b, t])
                if tree is None:
                    pos, seen = len(row), row[-1:]
                else:                 # a tree query sees the prefix and the keys `see` marks
                    pos, vb = int(tree.positions[b, t]), tree.visible_below[b]
                    seen = row[:vb] + [e for j, e in enumerate(row[vb:]) if tree.see[b, t, j]]
                # the previous token: the visible entry at the position before this one
                prev = next((tok for tok, p in reversed(seen) if p == pos - 1), 0)
                pairs.append((x, prev))
                row.append((x, pos))
                logits[b, t] = self.A[x] + self.B[prev]
            if hidden_layers and n:
                hidden[b, :n] = self._states(pairs, hidden_layers)
        return (logits, hidden) if hidden_layers else logits

    def keep_cached(self, slots, base, picks):
        for s, b, pick in zip(slots, base, picks):
            row = self.cache[s]
            kept = [(row[b + i][0], b + j) for j, i in enumerate(pick)]
            del row[b:]
            row.extend(kept)


@dataclass
class ReadStatesConfig:
    name: str = "readstates"
    k: int = 3


class ReadStates:
    """Drafts k tokens with the toy target's own tables, reading x_{t-1} from the target's state
    at the last position it scored (never from the committed tokens)."""

    def __init__(self, cfg, ctx):
        self.k, self.target = cfg.k, ctx.target
        self.states = {}                    # slot -> {position: state [n 2V]}
        self.mismatches = 0
        self.read = 0

    @hookimpl
    def specflow_hidden_layers(self):
        return [1]

    @hookimpl
    def specflow_target_states(self, states):
        h = states.select((1,))
        for b, (s, start, n) in enumerate(zip(states.slots, states.starts, states.lens)):
            row = self.states.setdefault(s, {})
            for t in range(n):
                row[start + t] = h[b, t]

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        for s, ids in zip(batch.slots.tolist(), batch.token_ids):   # only committed positions
            row = self.states.get(s, {})
            for p in [p for p in row if p >= len(ids) - 1]:
                del row[p]

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.states[slot] = {}

    @hookimpl
    def specflow_propose(self, batch, k):
        V = self.target.vocab_size
        K = int(k.max()) if len(k) else 0
        out = torch.full((batch.size, K), PAD, dtype=torch.long)
        for b, (s, ids) in enumerate(zip(batch.slots.tolist(), batch.token_ids)):
            state = self.states.get(s, {}).get(len(ids) - 2)
            if state is None or int(k[b]) == 0:
                continue
            self.read += 1
            # the state at position len - 2 holds (x_{len-2}, x_{len-3}) times 2 (layer 1)
            seen = int(state[:V].argmax())
            if seen != ids[-2]:
                self.mismatches += 1
            prev, x = seen, ids[-1]
            for i in range(int(k[b])):
                nxt = int((self.target.A[x] + self.target.B[prev]).argmax())
                out[b, i] = nxt
                prev, x = x, nxt
        return Proposal(out)


@hookimpl
def specflow_register(registry):
    registry.add("model", "toy", Toy, ToyConfig)
    registry.add("draft", "toy", Toy, ToyConfig)
    registry.add("proposer", "readstates", ReadStates, ReadStatesConfig)


@hookimpl
def specflow_config_searchpath():
    return "pkg://{module}.conf"
'''

MODULE = "fake_specflow_toy"
PROMPTS = ["hello world", "abc abc abc abc", "the quick brown fox"]
PROPOSERS = {
    "ngram": ["proposer=ngram", "proposer.k=3"],
    "ngram tree": ["proposer=ngram", "proposer.k=3", "proposer.topk=2",
                   "proposer.num_draft_tokens=6"],
    "draft": ["proposer=draft", "draft=toy", "draft.noise=1.5", "proposer.k=3"],
    "draft tree": ["proposer=draft", "draft=toy", "draft.noise=1.5", "proposer.k=3",
                   "proposer.topk=2", "proposer.num_draft_tokens=6"],
    "readstates": ["proposer=readstates"],
}
POLICIES = ["static", "adaptive", "heuristic", "goodput"]


@pytest.fixture(scope="module")
def toy_plugin(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    install_fake_plugin(root, MODULE, TOY_SOURCE, extra_conf=False)
    conf = root / MODULE / "conf"
    for group, text in {"model": "name: toy\nseed: 0\nnoise: 0.0\n",
                        "draft": "name: toy\nseed: 0\nnoise: 0.0\n",
                        "proposer": "name: readstates\nk: 3\n"}.items():
        (conf / group).mkdir(parents=True)
        name = "readstates" if group == "proposer" else "toy"
        (conf / group / f"{name}.yaml").write_text(text)
    (conf / "__init__.py").write_text("")
    sys.path.insert(0, str(root))
    autoload = os.environ.pop(plugins.AUTOLOAD_ENV, None)
    plugins.reset()
    yield
    sys.path.remove(str(root))
    if autoload is not None:
        os.environ[plugins.AUTOLOAD_ENV] = autoload
    plugins.reset()
    for name in [m for m in sys.modules if m.startswith(MODULE)]:
        del sys.modules[name]


def toy_pipeline(*overrides):
    from specflow import Pipeline

    return Pipeline.from_config(["model=toy", "max_new_tokens=24", *overrides])


@pytest.fixture(scope="module")
def plain(toy_plugin):
    pipe = toy_pipeline("proposer=none")
    return [r.token_ids for r in pipe.generate(PROMPTS, max_batch_size=1)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("arm", list(PROPOSERS))
def test_every_proposer_and_policy_on_a_contract_only_backend_equals_plain(plain, arm, policy):
    pipe = toy_pipeline(*PROPOSERS[arm], f"policy={policy}", "max_batch_size=3")
    for batch in (1, 3):
        got = pipe.generate(PROMPTS, max_batch_size=batch)
        assert [r.token_ids for r in got] == plain, f"{arm} under {policy} at batch {batch}"
    if policy == "static":          # speculation ran (a policy may rightly choose not to)
        assert pipe.last_stats["num_draft_tokens"] > 0


def test_a_plugin_proposer_reads_the_targets_hidden_states_through_the_contract(plain):
    pipe = toy_pipeline("proposer=readstates", "max_batch_size=3")
    got = pipe.generate(PROMPTS, max_batch_size=3)
    assert [r.token_ids for r in got] == plain
    prop = pipe.pm.get_plugin("proposer.readstates")
    assert pipe.hidden_layers == (1,)
    # every drafting row found the state of its position, and it was that position's
    assert prop.read > 10 and prop.mismatches == 0
    stats = pipe.last_stats
    # drafts computed from the right states are the target's own tokens: all accepted
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0


def test_a_backend_without_hidden_states_is_refused_when_a_stage_asks_for_them(toy_plugin):
    from specflow.errors import ConfigError

    with pytest.raises(ConfigError, match="does not hand them out"):
        toy_pipeline("model=synthetic", "proposer=readstates")
