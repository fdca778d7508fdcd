"""proposer=eagle: hidden states from the target's pass, an EAGLE-3 head, exact speculation."""
from __future__ import annotations

import json

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.app.prompts import read_prompts
from specflow.config import compose
from specflow.backends.heads.eagle import HeadShape, init_head, load_head, save_head
from specflow.plugins import hookimpl

PROMPTS = ["def fib(n):\n    ", "import os", "class Stack:\n    def __init__(self):\n        self",
           "x", "for i in range(10):\n", "return {", "# utilities for json", "with open(path) as f:"]


def pipeline(models, *overrides, target="llama"):
    return Pipeline.from_config(["model=hf", f"model.path={models[target]}", "draft=none",
                                 "max_batch_size=8", *overrides])


TRAIN = ["model=hf", "draft=none", "workload.limit=40", "workload.chars=200",
         "train_head.prompts=40", "train_head.new_tokens=48", "train_head.steps=150",
         "train_head.seq=48", "train_head.draft_vocab_size=200", "train_head.checkpoint_every=50",
         "train_head.lr=0.003", "train_head.heldout=0.2"]


@pytest.fixture(scope="module")
def tiny_head(hf_models, tmp_path_factory):
    """A head trained for a few steps on the tiny llama target by train-head's own code."""
    from specflow.training import train_head

    out = tmp_path_factory.mktemp("head")
    cfg = compose(TRAIN + [f"model.path={hf_models['llama']}", f"train_head.output={out}"],
                  "train_head")
    summary = train_head.run(cfg, read_prompts(cfg), lambda *a: (lambda *b, **c: None))
    return out, summary


def test_captured_states_are_the_layer_inputs_transformers_reports(hf_models):
    """The lean and the transformers forward hand out the same states: inputs of each layer, and
    at index num_layers (2 here) the final normed state, transformers' last hidden_states entry."""
    got, logits = {}, {}
    for forward in ("lean", "hf"):
        pipe = pipeline(hf_models, "proposer=none", f"model.forward={forward}")
        target = pipe.target
        assert target.num_layers == 2
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, -1]])
        logits[forward], got[forward] = target.forward(torch.tensor([0, 1]), ids,
                                                       torch.tensor([4, 3]), (0, 1, 2))
        assert logits[forward].shape == (2, 4, target.vocab_size)
    h1, h2 = got["lean"], got["hf"]
    assert h1.shape == (2, 4, 3 * 64)
    torch.testing.assert_close(h1[0], h2[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1[1, :3], h2[1, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["lean"][1, :3], logits["hf"][1, :3], atol=1e-4, rtol=1e-4)
    # the LM head reads the final normed state: it gives the logits back
    head = pipe.target.model.get_output_embeddings().weight.detach()
    torch.testing.assert_close(h1[0, :, 128:] @ head.T, logits["lean"][0], atol=1e-4, rtol=1e-4)


class AsksForLayers:
    def __init__(self, layers):
        self.layers = layers

    @hookimpl
    def specflow_hidden_layers(self):
        return self.layers


def test_a_stage_asking_for_a_layer_the_target_lacks_is_one_line(hf_models):
    with pytest.raises(ConfigError, match=r"layers \[3\], but the target has 2 layers; ask for "
                                          r"0..1 \(the input of a layer\) or 2"):
        Pipeline.from_config(["model=hf", f"model.path={hf_models['llama']}", "draft=none",
                              "proposer=none"], plugins=[AsksForLayers([0, 3])])
    pipe = pipeline(hf_models, "proposer=none")
    with pytest.raises(ConfigError, match=r"layers \[-1\]"):
        pipe.register(AsksForLayers([-1]))


def save_tiny_head(pipe, folder, layer_ids: list[int]):
    """A fixed-seed head for the tiny target, reading the inputs of `layer_ids`, saved to folder
    (-> the head)."""
    shape = HeadShape(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=pipe.target.vocab_size,
                      draft_vocab_size=100, target_hidden_size=64, layer_ids=layer_ids)
    head = init_head(shape, pipe.target.model.get_input_embeddings().weight, seed=3)
    head.set_vocab(torch.arange(0, 300, 3))
    save_head(head, folder)
    return head


def test_a_head_written_in_the_published_layout_loads_back(hf_models, tmp_path):
    pipe = pipeline(hf_models, "proposer=none")
    head = save_tiny_head(pipe, tmp_path / "h", [0, 1])
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 100
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    back = load_head(str(tmp_path / "h"), pipe.target, torch.device("cpu"), torch.float32)
    for name, value in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value.half().to(value.dtype))
    assert back.draft_ids.tolist() == list(range(0, 300, 3))

    # vLLM's names (layers.0.*, a model. prefix) load too
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "h" / "model.safetensors")
    renamed = {("model." + k.replace("midlayer.", "layers.0.")) if k.startswith("midlayer.")
               else k: v for k, v in tensors.items()}
    (tmp_path / "v").mkdir()
    save_file(renamed, tmp_path / "v" / "model.safetensors")
    (tmp_path / "v" / "config.json").write_text(json.dumps(config))
    again = load_head(str(tmp_path / "v"), pipe.target, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(again.state_dict()["midlayer.self_attn.q_proj.weight"],
                               back.state_dict()["midlayer.self_attn.q_proj.weight"])


def test_training_time_test_computes_what_drafting_computes(hf_models, tiny_head):
    """Step j of the training forward at root t equals the j-th draft step at inference after
    pairs 0..t (the diagonal attention stands for the draft's own cache)."""
    from specflow.backends.slot_cache import SlotKVCache
    from specflow.stages.proposers.eagle import EagleProposer, EagleProposerConfig
    from specflow.training.ttt import chain_attention

    pipe = pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}",
                    "proposer.dtype=float32")     # the training forward's dtype, to 1e-5
    prop = next(p for p in pipe.pm.get_plugins() if isinstance(p, EagleProposer))
    head = prop.head
    T, steps = 10, 3
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(1, T, len(head.shape.layer_ids) * 64, generator=gen)
    tokens = torch.randint(0, 300, (1, T + 1 + steps), generator=gen)
    # training: all roots at once
    h = head.layer_input(states)
    keys, values, train_out = [], [], []
    pos = torch.arange(T)[None]
    for j in range(steps):
        q, k, v = head.qkv(h, tokens[:, 1 + j:1 + j + T], pos + j)
        keys.append(k)
        values.append(v)
        h = head.finish(h, chain_attention(q, keys, values, 2))
        train_out.append(h)
    # inference: root t, through the proposer's cached forward
    assert isinstance(EagleProposerConfig().k, int)
    prop.cache = SlotKVCache(1, 1, 64)
    for t in (0, 4, T - 1):
        prop.cache.reset(0)
        out = prop._forward([0], states[:, :t + 1], tokens[:, 1:t + 2], [t + 1])
        g = out[:, t:t + 1]
        torch.testing.assert_close(g[0, 0], train_out[0][0, t], atol=1e-5, rtol=1e-4)
        for j in range(1, steps):
            g = prop._forward([0], g, tokens[:, t + 1 + j:t + 2 + j], [1])
            torch.testing.assert_close(g[0, 0], train_out[j][0, t], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_greedy_eagle_equals_greedy_plain(hf_models, tiny_head, batch, forward):
    plain = pipeline(hf_models, "proposer=none", f"model.forward={forward}")
    expected = [plain.generate([p], max_new_tokens=32, max_batch_size=1)[0] for p in PROMPTS]
    pipe = pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}",
                    f"model.forward={forward}")
    got = pipe.generate(PROMPTS, max_new_tokens=32, max_batch_size=batch)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    s = pipe.last_stats
    assert s["num_draft_tokens"] > 0 and s["num_accepted_tokens"] > 0
    assert pipe.hidden_layers == tuple(pipe.pm.get_plugin("proposer.eagle").layers)


def test_a_head_drafts_in_the_dtype_it_was_saved_in_unless_told(hf_models, tiny_head):
    """train-head saves float16: auto drafts in it (half the bytes a step reads), an explicit
    proposer.dtype overrides, metrics say which, and greedy output is plain decoding's either way
    (draft numerics only change how often drafts are accepted)."""
    from specflow.backends.heads.eagle import saved_dtype

    plain = pipeline(hf_models, "proposer=none")
    expected = [r.token_ids for r in plain.generate(PROMPTS[:4], max_new_tokens=24)]
    for setting, dtype in (("auto", torch.float16), ("float32", torch.float32),
                           ("bfloat16", torch.bfloat16)):
        pipe = pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}",
                        f"proposer.dtype={setting}")
        prop = pipe.pm.get_plugin("proposer.eagle")
        assert {p.dtype for p in prop.head.parameters()} == {dtype}
        # auto's native step holds the weights in int8 blocks (test_native_step.py)
        said = "int8" if setting == "auto" and prop.native is not None else str(dtype)
        assert pipe.backends["proposer"]["dtype"] == said.removeprefix("torch.")
        assert [r.token_ids for r in pipe.generate(PROMPTS[:4], max_new_tokens=24)] == expected
        assert pipe.last_stats["num_accepted_tokens"] > 0
    # beside a 16-bit target, auto follows the target (no float16 head on a bfloat16 stream;
    # activations=bfloat16: a bfloat16 model, not bfloat16 weights with float32 activations)
    pipe = pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}",
                    "dtype=bfloat16", "model.activations=bfloat16")
    assert pipe.pm.get_plugin("proposer.eagle").head.fc.weight.dtype == torch.bfloat16
    assert pipe.generate(PROMPTS[:1], max_new_tokens=8)[0].token_ids
    assert saved_dtype({"fc.weight": torch.zeros(2, dtype=torch.float64)}) == torch.float32
    assert saved_dtype({"fc.weight": torch.zeros(2, dtype=torch.bfloat16)}) == torch.bfloat16


def test_an_unknown_head_dtype_is_one_line(hf_models, tiny_head):
    with pytest.raises(ConfigError, match=r"proposer.dtype='fp8'; use auto .* int8 or int4$"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}", "proposer.dtype=fp8")


def test_states_are_released_with_their_requests(hf_models, tiny_head):
    from specflow.stages.proposers.eagle import EagleProposer

    pipe = pipeline(hf_models, "proposer=eagle", f"proposer.path={tiny_head[0]}",
                    "logits=[temperature]")
    pipe.generate(PROMPTS * 2, max_new_tokens=40, max_batch_size=4, seed=1)
    prop = next(p for p in pipe.pm.get_plugins() if isinstance(p, EagleProposer))
    assert prop.pending == {}
    assert all(n == 0 for n in prop.cache.lengths)


def test_train_head_reports_held_out_acceptance(tiny_head):
    out, summary = tiny_head
    fig = summary["heldout_greedy"]
    assert 1.0 <= fig["tau"] <= 5.0 and len(fig["acceptance_by_step"]) == 4
    assert fig["acceptance_by_step"][0] > 0.2        # it learnt something in 150 steps
    assert fig["positions"] > 200                    # 8 held-out sequences, generated parts
    config = json.loads((out / "config.json").read_text())
    assert config["specflow"]["recipe"]["steps"] == 150
    assert (out / "checkpoint.pt").is_file()


def test_train_head_resumes_from_its_checkpoint(hf_models, tiny_head, tmp_path):
    import shutil

    from specflow.training import train_head

    out = tmp_path / "again"
    shutil.copytree(tiny_head[0], out)
    seen = []

    def progress(description, total):
        return lambda n=1, **info: seen.append((description, n))

    cfg = compose(TRAIN + [f"model.path={hf_models['llama']}", f"train_head.output={out}",
                           "train_head.steps=170"], "train_head")
    train_head.run(cfg, read_prompts(cfg), progress)
    phases = {d for d, _ in seen}
    assert not any("target" in d for d in phases)        # the recorded data was reused
    trained = [n for d, n in seen if d.startswith("training")]
    assert trained[0] == 150 and sum(trained) == 170     # resumed at step 150


# --- bad input ---------------------------------------------------------------------------------

def test_eagle_on_the_synthetic_model_is_one_clear_error():
    with pytest.raises(ConfigError, match="proposer=eagle reads the hidden states"):
        Pipeline.from_config(["model=synthetic", "proposer=eagle"])


def test_a_head_for_another_target_is_refused(hf_models, tiny_head, tmp_path):
    import shutil

    bad = tmp_path / "other"
    shutil.copytree(tiny_head[0], bad)
    config = json.loads((bad / "config.json").read_text())
    config["target_hidden_size"] = 4096
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="trained for another target.*4096"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={bad}")
    config["target_hidden_size"] = 64
    config["vocab_size"] = 128256
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="vocabulary 128256"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={bad}")


def test_missing_corrupt_or_non_head_folders_are_refused(hf_models, tiny_head, tmp_path):
    import shutil

    with pytest.raises(ConfigError, match="is not a folder"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match="has no config.json"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={tmp_path}")
    with pytest.raises(ConfigError, match="not an EAGLE-3 head"):     # a whole model
        pipeline(hf_models, "proposer=eagle", f"proposer.path={hf_models['llama_draft']}")
    torn = tmp_path / "torn"
    shutil.copytree(tiny_head[0], torn)
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match="damaged"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={torn}")
    (torn / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no .safetensors"):
        pipeline(hf_models, "proposer=eagle", f"proposer.path={torn}")


def test_a_target_without_a_built_in_head_needs_a_path(hf_models):
    with pytest.raises(ConfigError, match="proposer.path"):
        pipeline(hf_models, "proposer=eagle")


def test_train_head_refuses_a_missing_output_and_bad_settings():
    from specflow.training.train_head import TrainHeadConfig

    with pytest.raises(ConfigError, match="train_head.output is not set"):
        TrainHeadConfig()
    with pytest.raises(ConfigError, match="train_head.steps=0 must be >= 1"):
        TrainHeadConfig(output="x", steps=0)
    with pytest.raises(ConfigError, match=r"train_head.heldout=1.5 must be in \[0, 1\)"):
        TrainHeadConfig(output="x", heldout=1.5)
    with pytest.raises(ConfigError, match="train_head.precision='float16'; use float32 or bfloat16"):
        TrainHeadConfig(output="x", precision="float16")


# --- proposer.path and train_head.layers, checked at compose time (no model loads) -------------

def _head_copy(tiny_head, dst, **config_changes):
    """The tiny head's folder with its config.json changed (None deletes a key)."""
    import shutil

    shutil.copytree(tiny_head[0], dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if key == "layers":
            config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = value
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_proposer_path_problems_are_found_at_compose_time(hf_models, tiny_head, tmp_path):
    target = ["model=hf", f"model.path={hf_models['llama']}", "proposer=eagle"]
    cases = [
        (tmp_path / "nope", "is not a folder"),
        (tmp_path, "has no config.json, so it is not a draft head"),
        (hf_models["llama_draft"], "is not an EAGLE-3 head"),
        (_head_copy(tiny_head, tmp_path / "wide", target_hidden_size=4096),
         "trained for another target.*4096"),
        (_head_copy(tiny_head, tmp_path / "deep", layers=[0, 5]),
         r"trained for another target \(layers \[5\] of a 2-layer target"),
        (_head_copy(tiny_head, tmp_path / "repeat", layers=[1, 1]), "repeats layer 1"),
        (_head_copy(tiny_head, tmp_path / "negative", layers=[-1, 1]), r"has layers \[-1\]"),
    ]
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    cases.append((tmp_path / "garbled", "config.json is not valid JSON"))
    for path, message in cases:
        with pytest.raises(ConfigError, match=message):
            compose([*target, f"proposer.path={path}"])
    # the demo target (the default model): a head for the tiny llama fits neither its width nor
    # its vocabulary
    with pytest.raises(ConfigError, match="trained for another target.*vocabulary 400 vs"):
        compose(["proposer=eagle", f"proposer.path={tiny_head[0]}"])
    with pytest.raises(ConfigError, match="needs a head for"):     # no head, not the demo target
        compose(target)
    compose([*target, f"proposer.path={tiny_head[0]}"])             # the right one passes


def test_a_head_with_repeated_layers_is_refused_at_load_too(hf_models, tiny_head, tmp_path):
    pipe = pipeline(hf_models, "proposer=none")
    bad = _head_copy(tiny_head, tmp_path / "repeat", layers=[1, 1, 0])
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids repeats layer 1 in "
                                          r"\[1, 1, 0\].*cannot run"):
        load_head(str(bad), pipe.target, torch.device("cpu"), torch.float32)


def test_a_head_naming_its_layers_out_of_order_reads_them_in_layer_order(hf_models, tmp_path):
    """The lean forward hands out layer inputs in layer order: fc's blocks are sorted with them."""
    pipe = pipeline(hf_models, "proposer=none")
    head = save_tiny_head(pipe, tmp_path / "h", [1, 0])
    back = load_head(str(tmp_path / "h"), pipe.target, torch.device("cpu"), torch.float32)
    assert back.shape.layer_ids == [0, 1]
    layer0, layer1 = torch.randn(2, 1, 5, 64, generator=torch.Generator().manual_seed(0))
    head.fc.weight.data = head.fc.weight.data.half().float()        # as saved
    torch.testing.assert_close(back.layer_input(torch.cat([layer0, layer1], -1)),
                               head.layer_input(torch.cat([layer1, layer0], -1)))


def test_train_head_layers_are_checked_at_compose_time(hf_models, tmp_path):
    base = TRAIN + [f"model.path={hf_models['llama']}", f"train_head.output={tmp_path / 'h'}"]
    for layers, message in (("[1,1,0]", r"train_head.layers=\[1, 1, 0\] repeats layer 1"),
                            ("[0,5]", r"train_head.layers=\[0, 5\] has layers \[5\] of a 2-layer "
                                      r"target; give two or more distinct layer ids in 0..1"),
                            ("[-1,1]", r"has layers \[-1\]"), ("[1]", "names 1 layer")):
        with pytest.raises(ConfigError, match=message):
            compose(base + [f"train_head.layers={layers}"], "train_head")
    shallow = tmp_path / "one-layer"          # config.json is all compose reads
    shallow.mkdir()
    (shallow / "config.json").write_text(json.dumps(
        {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 400}))
    with pytest.raises(ConfigError, match="has 1 layer.*too few for a draft head"):
        compose(TRAIN + [f"model.path={shallow}", f"train_head.output={tmp_path / 'h'}"],
                "train_head")
