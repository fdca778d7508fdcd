"""A pass of a few queries as one native call (backends/lean/native_pass.py, gemv.c's
specflow_layers): the eager layers' results up to rounding, a query's bits independent of its
pass and of the threads, a tree node's bits those of the same tokens in a chain, and every pass
whose mask is not the plan's own left to the eager layers."""
from __future__ import annotations

import shutil

import pytest
import torch

from specflow.backends.lean import native
from specflow.backends.contract import TreeAttention
from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig
from specflow.backends.lean.kernels import Kernels, can_pack
from specflow.backends.lean.native_pass import NativePass

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP here")


def backend_for(path, slots: int = 3) -> HFBackend:
    backend = HFBackend(HFModelConfig(path=str(path)), torch.device("cpu"), slots=slots)
    backend.lean.kernels = Kernels("native", "native", "linear")      # what pick() takes on x86
    backend.lean.mm = backend.lean.kernels.matmul
    return backend


def tiny_llama(tmp_path, name: str = "llama", **config) -> str:
    """A 3-layer Llama with grouped heads (6 query heads, 2 key/value heads) and the demo
    tokenizer; `config` overrides (a sliding window, biases)."""
    import transformers as tf

    torch.manual_seed(11)
    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[name]
    cfg = cls(vocab_size=8192, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, **config)
    path = tmp_path / name
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "target" / f, path / f)
    return str(path)


MODELS = ["demo", "tiny llama", "tiny llama, 64-wide heads"]


def model_path(tmp_path, model: str) -> str:
    """The demo target (8 heads of 64, one query head per key head), the tiny Llama (heads of 16:
    the native attention's any-width loop), or the tiny Llama with heads of 64 (its grouped
    loop: 3 query heads read each key head, 1-3 at a time)."""
    if model == "demo":
        return DEMO_DIR / "target"
    return tiny_llama(tmp_path, head_dim=64) if "64" in model else tiny_llama(tmp_path)


class Spy:
    """Counts the passes the native call took."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = NativePass.__call__

        def counted(pass_, *args, **kwargs):
            out = real(pass_, *args, **kwargs)
            self.calls += out is not None
            return out

        monkeypatch.setattr(NativePass, "__call__", counted)


def prefill(backend, lengths: list[int], seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for slot, n in enumerate(lengths):
        backend.reset(slot)
        backend.forward(torch.tensor([slot]), torch.randint(1, 8000, (1, n), generator=g),
                        torch.tensor([n]), logits=False)


def run(backend, lengths, fed, native_layers: bool, hidden=(), spy=None, lens=None):
    """Logits (and captured states) of feeding `fed` [B, T] (row b its first lens[b] tokens;
    all T by default) after prompts of `lengths`, and the keys the pass wrote; the prompts take
    the same layers as the pass; `spy` counts this pass only."""
    backend.lean.native_layers = native_layers
    prefill(backend, lengths)
    if spy is not None:
        spy.calls = 0
    B, T = fed.shape
    lens = lens or [T] * B
    out = backend.forward(torch.arange(B), fed, torch.tensor(lens), hidden_layers=hidden)
    written = [backend.cache.keys[i][b, :, n:n + m].clone()
               for i in range(len(backend.lean.layers)) for b, (n, m) in enumerate(zip(lengths, lens))]
    return out, written


@pytest.mark.parametrize("model", MODELS)
# (1, 17): a 16-draft token tree's verify pass; (2, 16): 32 queries
@pytest.mark.parametrize("rows,width", [(1, 1), (1, 5), (3, 1), (3, 5), (2, 8), (1, 17), (2, 16)])
def test_the_native_pass_computes_the_eager_layers(tmp_path, monkeypatch, model, rows, width):
    path = model_path(tmp_path, model)
    backend = backend_for(path)
    spy = Spy(monkeypatch)
    lengths = [37, 5, 120][:rows]
    fed = torch.randint(1, 8000, (rows, width), generator=torch.Generator().manual_seed(1))
    layers = len(backend.lean.layers)
    hidden = (0, layers - 1, layers)         # the first, the last layer's input, the final state
    (logits, states), keys = run(backend, lengths, fed, True, hidden, spy)
    assert spy.calls == 1
    (want, want_states), want_keys = run(backend, lengths, fed, False, hidden, spy)
    assert spy.calls == 0                               # the eager layers, this time
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, want_states, atol=1e-4, rtol=1e-4)
    for got, ref in zip(keys, want_keys):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_a_ragged_batch_runs_its_real_queries_natively(tmp_path, monkeypatch, model):
    # rows of different lengths (a policy's per-row draft lengths) took the eager layers,
    # padding and all: at batch 16 such passes cost 1.5-2x the native call of their real queries
    backend = backend_for(model_path(tmp_path, model))
    spy = Spy(monkeypatch)
    lengths, lens = [37, 5, 120], [3, 1, 2]
    fed = torch.randint(1, 8000, (3, 3), generator=torch.Generator().manual_seed(4))
    layers = len(backend.lean.layers)
    hidden = (0, layers - 1, layers)
    grown = [n + m for n, m in zip(lengths, lens)]
    (logits, states), keys = run(backend, lengths, fed, True, hidden, spy, lens)
    assert spy.calls == 1 and backend.cache.lengths[:3] == grown
    (want, want_states), want_keys = run(backend, lengths, fed, False, hidden, spy, lens)
    assert spy.calls == 0 and backend.cache.lengths[:3] == grown
    for b, m in enumerate(lens):                           # the real positions; padding is not read
        torch.testing.assert_close(logits[b, :m], want[b, :m], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[b, :m], want_states[b, :m], atol=1e-4, rtol=1e-4)
    for got, ref in zip(keys, want_keys):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # and each real query is the one it is alone, bit for bit
    backend.lean.native_layers = True        # the prompts too, as the ragged pass's were
    for b, m in enumerate(lens):
        prefill(backend, lengths)
        alone, alone_states = backend.forward(torch.tensor([b]), fed[b:b + 1, :m],
                                              torch.tensor([m]), hidden_layers=hidden)
        assert torch.equal(alone[0], logits[b, :m]), b
        assert torch.equal(alone_states[0], states[b, :m]), b


def test_a_fresh_caches_first_pass_runs_natively_as_every_later_one(tmp_path, monkeypatch):
    # the cache's buffers used to appear on the eager layers' first write: a backend's first
    # pass took them, and the same prompt later the native call, a float rounding apart
    backend = backend_for(tiny_llama(tmp_path))
    spy = Spy(monkeypatch)
    prefill(backend, [20])
    assert spy.calls == 1
    first = [k[0, :, :20].clone() for k in backend.cache.keys]
    prefill(backend, [20])
    assert spy.calls == 2
    assert all(torch.equal(a, k[0, :, :20]) for a, k in zip(first, backend.cache.keys))


@pytest.mark.parametrize("model", MODELS[1:])
def test_a_query_does_not_depend_on_its_pass_or_the_threads(tmp_path, model):
    # alone on 2 threads, a query's 3 query heads of a key head are split in two attention
    # units (1 and 2 heads); in the pass of 12 queries, or on 1 thread, they are one
    backend = backend_for(model_path(tmp_path, model))
    fed = torch.randint(1, 8000, (3, 4), generator=torch.Generator().manual_seed(2))
    lengths = [20, 9, 64]
    together, _ = run(backend, lengths, fed, True)                                  # [3, 4, V]
    threads = torch.get_num_threads()
    try:
        for alone_threads in (1, 2):
            torch.set_num_threads(alone_threads)
            for b in range(len(lengths)):
                for t in range(4):      # row b's query t alone, after the t tokens before it
                    prefill(backend, lengths)
                    slot = torch.tensor([b])
                    if t:
                        backend.forward(slot, fed[b:b + 1, :t], torch.tensor([t]), logits=False)
                    alone = backend.forward(slot, fed[b:b + 1, t:t + 1], torch.tensor([1]))[0, 0]
                    assert torch.equal(alone, together[b, t]), (alone_threads, b, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["int4", "int8", "bfloat16"])
def test_a_block_models_query_does_not_depend_on_its_pass_or_the_threads(tmp_path, monkeypatch,
                                                                        dtype):
    # weights in tiles (Q4_1, Q8_0, BF16 where the CPU multiplies bfloat16): on 2 threads each
    # product's tiles go to the threads from both ends of a shared count, so which thread
    # computes a row depends on timing, and the 48 queries' inputs are quantized by both
    # threads together (a query's alone by each); a row's bits must not change
    from specflow.backends.lean import blocks

    if not blocks.available():
        pytest.skip("no native block product here")
    backend = HFBackend(HFModelConfig(path=tiny_llama(tmp_path, head_dim=64), dtype=dtype),
                        torch.device("cpu"), slots=3)
    spy = Spy(monkeypatch)
    fed = torch.randint(1, 8000, (3, 16), generator=torch.Generator().manual_seed(5))
    lengths = [20, 9, 64]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together, _ = run(backend, lengths, fed, True, spy=spy)                      # [3, 16, V]
        assert spy.calls == 1
        torch.set_num_threads(1)
        assert torch.equal(run(backend, lengths, fed, True)[0], together)
        for alone_threads in (1, 2, 1, 2):
            torch.set_num_threads(alone_threads)
            for b in range(len(lengths)):
                prefill(backend, lengths)
                slot = torch.tensor([b])
                backend.forward(slot, fed[b:b + 1, :2], torch.tensor([2]), logits=False)
                alone = backend.forward(slot, fed[b:b + 1, 2:3], torch.tensor([1]))[0, 0]
                assert torch.equal(alone, together[b, 2]), (dtype, alone_threads, b)
    finally:
        torch.set_num_threads(threads)


def test_repacking_the_weights_rebuilds_the_native_tables(monkeypatch):
    # pack() and unpack() replace the layer tuples in place: tables built on the old ones would
    # read freed weights
    backend = backend_for(DEMO_DIR / "target")
    spy = Spy(monkeypatch)
    fed = torch.randint(1, 8000, (1, 3), generator=torch.Generator().manual_seed(3))
    first, _ = run(backend, [30], fed, True, spy=spy)
    assert spy.calls == 1
    if can_pack(torch.float32):
        backend.lean.pack()
        packed, _ = run(backend, [30], fed, True, spy=spy)   # packed weights: the eager layers
        assert spy.calls == 0
        torch.testing.assert_close(packed, first, atol=1e-4, rtol=1e-4)
        backend.lean.unpack()
    backend.lean.kernels = Kernels("native", "native", "linear")
    again, _ = run(backend, [30], fed, True, spy=spy)
    assert spy.calls == 1
    assert torch.equal(again, first)


def test_passes_whose_mask_is_not_the_plans_run_the_eager_layers(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    backend = backend_for(DEMO_DIR / "target")
    # (a ragged batch runs natively: test_a_ragged_batch_runs_its_real_queries_natively)
    # a tree whose marks reach past the cache's columns (the eager mask stops at kv_len)
    prefill(backend, [backend.cache.max_capacity - 2])
    start = backend.cache.max_capacity - 2
    wide = TreeAttention(positions=torch.tensor([[start]]), visible_below=[start],
                         see=torch.ones(1, 1, 4, dtype=torch.bool))
    backend.forward(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([1]), tree=wide)
    # more queries than the native product takes (the prompts too)
    longer = native.MAX_ROWS + 8
    prefill(backend, [longer])
    backend.forward(torch.tensor([0]), torch.ones(1, native.MAX_ROWS + 1, dtype=torch.long),
                    torch.tensor([native.MAX_ROWS + 1]))
    # a product form other than the native one
    backend.lean.kernels = Kernels("linear", "linear", "linear")
    prefill(backend, [longer])
    backend.forward(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([1]))
    assert spy.calls == 0
    # Mistral's window, once the context is longer than it; inside it the pass is plain causal
    mistral = backend_for(tiny_llama(tmp_path, "mistral", sliding_window=8), slots=1)
    prefill(mistral, [20])
    spy.calls = 0
    mistral.forward(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([1]))
    assert spy.calls == 0
    prefill(mistral, [5])
    spy.calls = 0
    mistral.forward(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([1]))
    assert spy.calls == 1
    # biases (Qwen2's q/k/v) are not in the native layers
    qwen = backend_for(tiny_llama(tmp_path, "qwen2"), slots=1)
    assert not NativePass.supported(qwen.lean)
    prefill(qwen, [5])
    qwen.forward(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([1]))
    assert spy.calls == 1


def test_a_16_bit_model_runs_the_eager_layers(monkeypatch):
    """A bfloat16 model (activations too); dtype=bfloat16 alone holds bfloat16 weights against
    float32 activations, which the native pass runs (tests/backends/lean/test_bf16_weights.py)."""
    spy = Spy(monkeypatch)
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype="bfloat16",
                                      activations="bfloat16"), torch.device("cpu"), slots=1)
    assert not NativePass.supported(backend.lean)
    prefill(backend, [8])
    backend.forward(torch.tensor([0]), torch.tensor([[5]]), torch.tensor([1]))
    assert spy.calls == 0


def tree_pass(backend, start: int, tokens: list[int], parents: list[int], native_layers: bool):
    """Logits [T, V] of one row's token tree after `start` cached tokens: node t holds tokens[t]
    and hangs under node parents[t] (-1: the committed prefix)."""
    T = len(tokens)
    see = torch.zeros(1, T, T, dtype=torch.bool)
    depth = []
    for t, p in enumerate(parents):
        see[0, t, t] = True
        if p >= 0:
            see[0, t] |= see[0, p]
        depth.append(0 if p < 0 else depth[p] + 1)
    tree = TreeAttention(positions=torch.tensor([[start + d for d in depth]]),
                         visible_below=[start], see=see)
    backend.truncate(torch.tensor([0]), [start])
    backend.lean.native_layers = native_layers
    return backend.forward(torch.tensor([0]), torch.tensor([tokens]), torch.tensor([T]),
                           tree=tree)[0]


def last_of_chain(backend, start: int, chain: list[int]) -> torch.Tensor:
    """Logits [V] of the last of `chain`'s tokens fed as one causal pass after `start` cached
    tokens (natively)."""
    backend.truncate(torch.tensor([0]), [start])
    backend.lean.native_layers = True
    return backend.forward(torch.tensor([0]), torch.tensor([chain]),
                           torch.tensor([len(chain)]))[0, -1]


@pytest.mark.parametrize("model", MODELS)
def test_a_tree_node_scores_as_its_tokens_in_a_chain(tmp_path, monkeypatch, model):
    path = model_path(tmp_path, model)
    backend = backend_for(path, slots=1)
    spy = Spy(monkeypatch)
    prefill(backend, [30])
    #            a   b   c   d   e       b, c under a; d under b; e under c
    tokens = [101, 202, 303, 404, 505]
    parents = [-1, 0, 0, 1, 2]
    spy.calls = 0
    tree = tree_pass(backend, 30, tokens, parents, True)                          # [5, V]
    assert spy.calls == 1
    eager = tree_pass(backend, 30, tokens, parents, False)
    assert spy.calls == 1
    torch.testing.assert_close(tree, eager, atol=1e-4, rtol=1e-4)
    for node, chain in ((3, [101, 202, 404]), (4, [101, 303, 505]), (2, [101, 303])):
        assert torch.equal(last_of_chain(backend, 30, chain), tree[node]), node


def test_a_sixteen_draft_tree_runs_natively_and_scores_as_its_chains(tmp_path, monkeypatch):
    backend = backend_for(tiny_llama(tmp_path), slots=1)
    spy = Spy(monkeypatch)
    prefill(backend, [40])
    parents = [-1] + [(t - 1) // 2 for t in range(1, 17)]       # a binary tree of 17 nodes
    tokens = [100 + 37 * t for t in range(17)]
    spy.calls = 0
    tree = tree_pass(backend, 40, tokens, parents, True)                          # [17, V]
    assert spy.calls == 1
    torch.testing.assert_close(tree, tree_pass(backend, 40, tokens, parents, False),
                               atol=1e-4, rtol=1e-4)
    for node in (16, 9, 6):
        chain, at = [], node
        while at >= 0:
            chain.insert(0, tokens[at])
            at = parents[at]
        assert torch.equal(last_of_chain(backend, 40, chain), tree[node]), node


def test_metrics_say_which_passes_run_natively():
    backend = backend_for(DEMO_DIR / "target", slots=1)
    assert backend.describe()["native_pass"] == f"1-{native.MAX_ROWS} queries"
    backend.lean.kernels = Kernels("native", "linear", "linear")
    assert backend.describe()["native_pass"] == "1 query"
    backend.lean.native_layers = False
    assert backend.describe()["native_pass"] is None


@pytest.mark.parametrize("dtype", ["float32", "int4"])
@pytest.mark.parametrize("rows,width", [(1, 1), (1, 5), (3, 2)])
def test_the_lm_head_in_the_pass_call_is_the_heads_own_product(monkeypatch, dtype, rows, width):
    # the logits of a pass come out of its one native call (specflow_layers_head) with the
    # bits the head's own product gives after the pass: dense float32 rows, held blocks
    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype=dtype),
                        torch.device("cpu"), slots=3)
    if dtype == "float32":
        backend.lean.kernels = Kernels("native", "native", "linear")
        backend.lean.mm = backend.lean.kernels.matmul
    fed = torch.randint(1, 8000, (rows, width), generator=torch.Generator().manual_seed(2))
    kinds = []
    real = Kernels.fused_kind

    def spied(kernels, *args):
        kinds.append(real(kernels, *args))
        return kinds[-1]

    monkeypatch.setattr(Kernels, "fused_kind", spied)
    fused, _ = run(backend, [30, 7, 64][:rows], fed, True)
    assert kinds[-1] is not None                    # the pass computed the logits itself
    monkeypatch.setattr(Kernels, "fused_kind", real)
    call = NativePass.__call__                       # the pass without the head: a second call
    monkeypatch.setattr(NativePass, "__call__", lambda pass_, *args: call(pass_, *args[:6]))
    apart, _ = run(backend, [30, 7, 64][:rows], fed, True)
    assert torch.equal(fused, apart)


def test_a_prefill_computes_no_lm_head(monkeypatch):
    # a prefill only caches: its last row's logits were computed and thrown away
    from specflow.backends.lean.forward import LeanLlama

    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target")), torch.device("cpu"), 1)
    heads = []
    real = LeanLlama._normed_mm
    monkeypatch.setattr(LeanLlama, "_normed_mm", lambda *a: heads.append(1) or real(*a))
    kinds = []
    monkeypatch.setattr(Kernels, "fused_kind", lambda *a: kinds.append(1))
    lean, mm = backend.lean, backend.lean.mm
    lean.mm = lambda x, w: heads.append(1) if w is lean.lm_head else mm(x, w)
    layers = len(backend.lean.layers)
    for hidden in ((), (0, layers)):                  # the final state handed out too
        backend.reset(0)
        out = backend.forward(torch.tensor([0]), torch.tensor([[5, 90, 313, 7]]),
                              torch.tensor([4]), hidden_layers=hidden, logits=False)
        assert (out if not hidden else out[0]) is None
        assert heads == [] and kinds == []
    assert backend.cache.lengths[0] == 4
