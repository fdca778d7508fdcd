"""Tree passes: every node scored in one forward equals its root path scored as a chain, and the
accepted path's cache entries, kept in place, equal a cache that only ever saw that path."""
from __future__ import annotations

import pytest
import torch

from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean.kernels import can_pack
from specflow.stages.tree import tree_layout

PARENTS = [-1, -1, 0, 0, 1, 2, 2, -1, 4]       # three roots' children, depth up to 3
NODES = [11, 12, 13, 14, 15, 16, 17, 18, 19]


def backend(forward: str, arch_path=None) -> HFBackend:
    path = arch_path or DEMO_DIR / "target"
    return HFBackend(HFModelConfig(path=str(path), forward=forward), torch.device("cpu"), slots=3)


def path_of(node: int) -> list[int]:
    out = []
    while node != -1:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


def tree_pass(model, slot: int, prompt: list[int]):
    model.reset(slot)
    model.prefill(slot, prompt[:-1])
    layout = tree_layout(torch.tensor([PARENTS]), [len(PARENTS)])
    ids = torch.tensor([[prompt[-1], *NODES]])
    return model.forward_tree(torch.tensor([slot]), ids, torch.tensor([len(NODES) + 1]),
                              layout)[0]                                               # [N+1, V]


@pytest.mark.parametrize("forward", ["lean", "hf", pytest.param("packed", marks=pytest.mark.skipif(
    not can_pack(torch.float32), reason="no oneDNN packed linear"))])
def test_each_node_equals_its_root_path_scored_as_a_chain(forward):
    model = backend("hf" if forward == "hf" else "lean")
    if forward == "packed":
        model.lean.pack()
    torch.manual_seed(0)
    prompt = torch.randint(1, 8000, (40,)).tolist()
    tree = tree_pass(model, 0, prompt)
    for node in range(len(NODES)):
        model.reset(1)
        path = [NODES[i] for i in path_of(node)]
        model.prefill(1, prompt[:-1])
        chain = model.forward(torch.tensor([1]), torch.tensor([[prompt[-1], *path]]),
                              torch.tensor([len(path) + 1]))[0]                          # [D+1, V]
        assert torch.allclose(tree[node + 1], chain[-1], atol=1e-4, rtol=1e-4), node
    assert torch.allclose(tree[0], chain[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_keeping_the_accepted_path_leaves_the_cache_a_chain_would(forward):
    model = backend(forward)
    torch.manual_seed(1)
    prompt = torch.randint(1, 8000, (30,)).tolist()
    tree_pass(model, 0, prompt)
    accepted = path_of(5)                                   # nodes 0, 2, 5
    base = len(prompt)                                      # the root sits at len - 1
    model.keep_cached([0], [base], [accepted])
    assert model.cache_length(0) == base + len(accepted)
    nxt = torch.tensor([[23]])
    after_tree = model.forward(torch.tensor([0]), nxt, torch.tensor([1]))[0, -1]
    model.reset(1)
    model.prefill(1, prompt + [NODES[i] for i in accepted])
    fresh = model.forward(torch.tensor([1]), nxt, torch.tensor([1]))[0, -1]
    assert torch.allclose(after_tree, fresh, atol=1e-4, rtol=1e-4)


def test_a_tree_pass_in_a_batch_with_a_short_row(hf_models):
    # rows of different tree sizes side by side: the short row's padding is never attended to
    model = backend("lean", hf_models["llama"])
    parents = torch.tensor([PARENTS, [-1, 0, -1] + [-1] * 6])
    layout = tree_layout(parents, [len(PARENTS), 3])
    for s in (0, 1):
        model.reset(s)
        model.prefill(s, [5, 6, 7, 8][: 4 - s])
    ids = torch.tensor([[9, *NODES], [9, 30, 31, 32] + [-1] * 6])
    both = model.forward_tree(torch.tensor([0, 1]), ids, torch.tensor([10, 4]), layout)
    model.reset(2)
    model.prefill(2, [5, 6, 7])
    alone = model.forward_tree(torch.tensor([2]), ids[1:, :4], torch.tensor([4]),
                               tree_layout(parents[1:, :3], [3]))
    assert torch.allclose(both[1, :4], alone[0], atol=1e-4, rtol=1e-4)
