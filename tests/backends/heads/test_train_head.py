"""`specflow train-head` with its defaults, a rerun into a used folder, and its closing check."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.app.prompts import read_prompts
from specflow.config import compose
from specflow.backends.heads.eagle import default_layer_ids
from specflow.training import train_head

SPECFLOW = os.path.join(os.path.dirname(sys.executable), "specflow")
PROMPTS = ["def fib(n):\n    ", "import os", "class Stack:\n    def __init__(self):\n        self"]
# tiny and short: the head need not be good, only be written and run
TRAIN = ["model=hf", "draft=none", "workload.limit=12", "workload.chars=120",
         "train_head.prompts=12", "train_head.new_tokens=24", "train_head.steps=6",
         "train_head.batch=2", "train_head.seq=24", "train_head.draft_vocab_size=120",
         "train_head.checkpoint_every=3", "train_head.heldout=0.2"]


def quiet(*_args):
    return lambda *_a, **_k: None


@pytest.fixture(scope="module")
def deep_target(hf_models, tmp_path_factory):
    """The tiny llama's shape with 4 layers, as the demo target has (defaults once gave 1, 2, 2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_models["llama"])
    config.num_hidden_layers = 4
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    path = tmp_path_factory.mktemp("deep") / "llama4"
    model.save_pretrained(path)
    hf_models["tokenizer"].save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deep_head(deep_target, tmp_path_factory):
    """train-head with its default layers on the 4-layer target, under a umask of 022."""
    out = tmp_path_factory.mktemp("deep-head") / "head"
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={out}"], "train_head")
    old = os.umask(0o022)
    try:
        train_head.run(cfg, read_prompts(cfg), quiet)
    finally:
        os.umask(old)
    return out


def test_default_layers_are_distinct_and_valid_for_any_depth():
    for depth in range(2, 130):
        ids = default_layer_ids(depth)
        assert ids == sorted(set(ids)) and len(ids) == min(3, depth), (depth, ids)
        assert 0 <= ids[0] and ids[-1] < depth, (depth, ids)
        if depth >= 7:                                    # vLLM's and SafeAILab's (2, L/2, L-3)
            assert ids == [2, depth // 2, depth - 3]
    assert default_layer_ids(4) == [1, 2, 3]              # the demo target: the shipped head's


def test_a_default_head_for_a_4_layer_target_runs_under_proposer_eagle(deep_target, deep_head):
    config = json.loads((deep_head / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    base = ["model=hf", f"model.path={deep_target}", "draft=none", "max_batch_size=3"]
    plain = Pipeline.from_config([*base, "proposer=none"]).generate(PROMPTS, max_new_tokens=16)
    for forward in ("lean", "hf"):
        pipe = Pipeline.from_config([*base, "proposer=eagle", f"proposer.path={deep_head}",
                                     f"model.forward={forward}"])
        got = pipe.generate(PROMPTS, max_new_tokens=16)
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
        assert pipe.last_stats["num_draft_tokens"] > 0


def test_train_head_writes_its_weights_with_the_umask_like_its_other_files(deep_head):
    modes = {name: os.stat(deep_head / name).st_mode & 0o777
             for name in ("model.safetensors", "config.json", "checkpoint.pt")}
    assert set(modes.values()) == {0o644}, modes


def test_a_rerun_with_other_sizes_is_one_line_naming_them(deep_target, deep_head):
    base = TRAIN + [f"model.path={deep_target}", f"train_head.output={deep_head}"]
    cfg = compose(base + ["train_head.draft_vocab_size=100", "train_head.seq=16"], "train_head")
    with pytest.raises(ConfigError) as info:
        train_head.run(cfg, read_prompts(cfg), quiet)
    message = str(info.value)
    assert "holds a head trained with other settings" in message and "\n" not in message
    assert "train_head.draft_vocab_size=120 there, 100 now" in message
    assert "train_head.seq=24 there, 16 now" in message
    assert "pick another train_head.output" in message
    cfg = compose(base + ["train_head.layers=[0,3]"], "train_head")
    with pytest.raises(ConfigError, match=r"train_head.layers=\[1, 2, 3\] there, \[0, 3\] now"):
        train_head.run(cfg, read_prompts(cfg), quiet)


def test_the_cli_refuses_a_rerun_with_other_sizes_before_loading(deep_target, deep_head, tmp_path):
    args = TRAIN + [f"model.path={deep_target}", f"train_head.output={deep_head}",
                    "train_head.ttt_steps=2", f"hydra.run.dir={tmp_path}/run"]
    out = subprocess.run([SPECFLOW, "train-head", *args, "--quiet"], capture_output=True,
                         timeout=300, env={**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"})
    err = out.stderr.decode().strip()
    assert out.returncode == 2, err
    assert err.startswith("specflow: error:") and len(err.splitlines()) == 1, err
    assert "train_head.ttt_steps=3 there, 2 now" in err


def test_a_folder_written_before_settings_were_recorded_is_checked_by_width(
        deep_target, deep_head, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(deep_head, old)
    (old / train_head.SETTINGS_FILE).unlink()
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={old}",
                           "train_head.layers=[0,3]"], "train_head")
    with pytest.raises(ConfigError, match="holds target states 192 wide, but layers"):
        train_head.run(cfg, read_prompts(cfg), quiet)


def test_a_head_that_cannot_run_fails_train_head_in_one_line(hf_models, tmp_path, monkeypatch):
    """The closing check drafts through proposer=eagle's own code: a head whose states do not fit
    (here the proposer's forward made to fail as a 1536-wide fc did on 1024-wide states) stops
    train-head instead of a held-out figure being reported."""
    from specflow.stages.proposers.eagle import EagleProposer

    def broken(*_args, **_kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (792x1024 and 1536x512)")

    monkeypatch.setattr(EagleProposer, "_forward", broken)
    cfg = compose(TRAIN + [f"model.path={hf_models['llama']}", f"train_head.output={tmp_path}",
                           "train_head.steps=2"], "train_head")
    with pytest.raises(ConfigError) as info:
        train_head.run(cfg, read_prompts(cfg), quiet)
    message = str(info.value)
    assert "does not run under proposer=eagle (RuntimeError: mat1 and mat2" in message
    assert "\n" not in message


def test_chat_turns_add_answered_user_turns_spread_among_the_workload_s(deep_target, tmp_path,
                                                                         monkeypatch):
    """train_head.chat_turns: the sampled turns (fixed here: the tiny random model rarely ends a
    turn) become chat prompts the target answers, recorded beside the workload's sequences."""
    import shutil

    from transformers import AutoTokenizer

    from specflow.training import user_turns

    chatty = tmp_path / "chatty"
    shutil.copytree(deep_target, chatty)
    tok = AutoTokenizer.from_pretrained(chatty)
    tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}"
                         "\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(chatty)
    asked = []

    def turns(pipe, count, seed, advance):
        asked.append((count, seed, set(pipe.cfg.logits.keys())))
        return [f"question {i}?" for i in range(count)]
    monkeypatch.setattr(user_turns, "sample_user_turns", turns)
    out = tmp_path / "head"
    cfg = compose(TRAIN + [f"model.path={chatty}", f"train_head.output={out}",
                           "train_head.chat_turns=3"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    assert asked == [(3, 0, {"temperature", "top_p"})]        # a sampling pipeline of its own
    seqs = torch.load(out / "train_data.pt", weights_only=False)
    prompts = {tok.apply_chat_template([{"role": "user", "content": f"question {i}?"}],
                                       tokenize=False, add_generation_prompt=True)
               for i in range(3)}
    heads = [tok.decode(t[:n]) for t, n in zip(seqs.tokens, seqs.prompt_lens)]
    chat = [i for i, h in enumerate(heads) if h in prompts]
    assert len(chat) == 3 and {heads[i] for i in chat} == prompts
    assert 0 < chat[0] and chat[-1] < len(seqs) - 1                  # spread, not appended
    assert all(len(seqs.tokens[i]) > seqs.prompt_lens[i] for i in chat)   # and answered
    recipe = json.loads((out / "config.json").read_text())["specflow"]["recipe"]
    assert recipe["chat_turns"] == 3
    # the turns are kept: a rerun that records its data again does not sample them again
    assert json.loads((out / "user_turns.json").read_text()) == sorted(
        prompts, key=lambda p: [f"question {i}?" in p for i in range(3)].index(True))
    (out / "train_data.pt").unlink()
    train_head.run(cfg, read_prompts(cfg), quiet)
    assert len(asked) == 1
    # train_head.resume=false starts over: it samples them again
    train_head.run(compose(TRAIN + [f"model.path={chatty}", f"train_head.output={out}",
                                    "train_head.chat_turns=3", "train_head.resume=false"],
                           "train_head"), read_prompts(cfg), quiet)
    assert len(asked) == 2


def test_train_head_format_speculators_writes_a_head_specflow_runs(deep_target, tmp_path):
    out = tmp_path / "head"
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={out}",
                           "train_head.format=speculators"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(deep_target)
    assert config["specflow"]["recipe"]["steps"] == 6              # the card travels along
    base = ["model=hf", f"model.path={deep_target}", "draft=none", "max_batch_size=3"]
    plain = Pipeline.from_config([*base, "proposer=none"]).generate(PROMPTS, max_new_tokens=12)
    pipe = Pipeline.from_config([*base, "proposer=eagle", f"proposer.path={out}"])
    assert [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=12)] == \
        [r.token_ids for r in plain]


def test_bfloat16_steps_train_float32_weights_that_draft_exactly(deep_target, deep_head,
                                                                  tmp_path):
    """train_head.precision=bfloat16: the steps' products under autocast (other weights than
    float32 steps from the same seed and windows), the weights and the card as float32's."""
    from safetensors.torch import load_file

    out = tmp_path / "head"
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={out}",
                           "train_head.precision=bfloat16"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    card = json.loads((out / "config.json").read_text())["specflow"]
    assert card["precision"] == "bfloat16"
    mine, theirs = load_file(out / "model.safetensors"), load_file(deep_head / "model.safetensors")
    assert mine.keys() == theirs.keys()
    assert any(not torch.equal(mine[k], theirs[k]) for k in mine if mine[k].is_floating_point())
    assert all(torch.isfinite(t).all() for t in mine.values() if t.is_floating_point())
    base = ["model=hf", f"model.path={deep_target}", "draft=none", "max_batch_size=3"]
    plain = Pipeline.from_config([*base, "proposer=none"]).generate(PROMPTS, max_new_tokens=12)
    pipe = Pipeline.from_config([*base, "proposer=eagle", f"proposer.path={out}"])
    assert [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=12)] == \
        [r.token_ids for r in plain]


def test_init_goes_on_from_a_head_s_weights_and_draft_vocabulary(deep_target, deep_head,
                                                                   tmp_path):
    """train_head.init: training starts from the folder's head, not a fresh one (a step too
    small to move a float16 weight leaves every tensor, d2t and t2d included, as it was), and
    the card records what it started from; the head drafts exactly."""
    from safetensors.torch import load_file

    out = tmp_path / "more"
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={out}",
                           f"train_head.init={deep_head}", "train_head.steps=1",
                           "train_head.lr=1e-12"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    mine, theirs = load_file(out / "model.safetensors"), load_file(deep_head / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    card = json.loads((out / "config.json").read_text())["specflow"]
    before = json.loads((deep_head / "config.json").read_text())["specflow"]
    assert card["init"]["path"] == str(deep_head)
    assert card["init"]["recipe"] == before["recipe"]
    fresh = tmp_path / "fresh"
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={fresh}",
                           "train_head.steps=1", "train_head.lr=1e-12"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    other = load_file(fresh / "model.safetensors")
    assert not torch.equal(other["fc.weight"], theirs["fc.weight"])
    base = ["model=hf", f"model.path={deep_target}", "draft=none", "max_batch_size=3"]
    plain = Pipeline.from_config([*base, "proposer=none"]).generate(PROMPTS, max_new_tokens=12)
    pipe = Pipeline.from_config([*base, "proposer=eagle", f"proposer.path={out}"])
    assert [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=12)] == \
        [r.token_ids for r in plain]


def test_init_grows_a_head_s_draft_vocabulary(deep_target, deep_head, tmp_path):
    """train_head.init with a larger draft_vocab_size: every token the head had stays, with its
    LM head row as trained; the new tokens start from the target's own rows; every other weight
    is the head's; it drafts exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "wider"
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={out}",
                           f"train_head.init={deep_head}", "train_head.draft_vocab_size=160",
                           "train_head.steps=1", "train_head.lr=1e-12"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    mine, theirs = load_file(out / "model.safetensors"), load_file(deep_head / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in mine:
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(mine[name], theirs[name]), name
    old = torch.arange(120) + theirs["d2t"]
    new = torch.arange(160) + mine["d2t"]
    assert new.tolist() == sorted(new.tolist()) and set(old.tolist()) < set(new.tolist())
    assert mine["t2d"].sum() == 160 and bool(mine["t2d"][old].all())
    at = torch.searchsorted(new, old)
    assert torch.equal(mine["lm_head.weight"][at], theirs["lm_head.weight"])
    fresh = torch.ones(160, dtype=torch.bool)
    fresh[at] = False
    target = AutoModelForCausalLM.from_pretrained(deep_target).get_output_embeddings().weight
    assert torch.equal(mine["lm_head.weight"][fresh], target[new[fresh]].to(torch.float16))
    base = ["model=hf", f"model.path={deep_target}", "draft=none", "max_batch_size=3"]
    plain = Pipeline.from_config([*base, "proposer=none"]).generate(PROMPTS, max_new_tokens=12)
    pipe = Pipeline.from_config([*base, "proposer=eagle", f"proposer.path={out}"])
    assert [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=12)] == \
        [r.token_ids for r in plain]


def test_init_from_a_head_of_another_shape_is_one_line(deep_target, deep_head, tmp_path):
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={tmp_path / 'h'}",
                           f"train_head.init={deep_head}", "train_head.draft_vocab_size=100"],
                  "train_head")
    with pytest.raises(ConfigError, match=r"train_head.init=.*another shape: draft_vocab_size "
                                          r"120 \(this run: 100\)") as info:
        train_head.run(cfg, read_prompts(cfg), quiet)
    assert "\n" not in str(info.value)
    cfg = compose(TRAIN + [f"model.path={deep_target}", f"train_head.output={tmp_path / 'g'}",
                           f"train_head.init={tmp_path / 'nowhere'}"], "train_head")
    with pytest.raises(ConfigError, match="train_head.init=.* is not a folder"):
        train_head.run(cfg, read_prompts(cfg), quiet)


def test_an_unknown_head_format_is_one_line():
    cfg = compose(["train_head.output=x", "train_head.format=onnx"], "train_head")
    with pytest.raises(ConfigError, match="train_head.format='onnx'; use eagle3"):
        train_head.run(cfg, read_prompts(cfg), quiet)


def test_the_states_recorded_while_decoding_are_those_of_a_forward_over_each_sequence(hf_models):
    """train-head records the head's data from its decoding passes (training/data.py
    StateRecorder): for every position but a sequence's last, the inputs of the head's layers
    and the final normed state, equal (in fp16) to what one forward of transformers over the
    whole sequence reports. Two slots for five prompts of different lengths: slots are reused
    and rows finish at different rounds."""
    from transformers import AutoModelForCausalLM

    from specflow.training import data

    pipe = Pipeline.from_config(["model=hf", f"model.path={hf_models['llama']}", "draft=none",
                                 "proposer=none", "max_batch_size=2"])
    recorder = data.StateRecorder([0, 1], pipe.target.num_layers)
    pipe.register(recorder)
    prompts = ["def fib(n):\n    ", "import os", "class Stack:\n    def __init__(self):\n",
               "x = [", "for i in range(10):\n"]
    seen = []
    sequences, lens, states = data.continuations(pipe, prompts, 12, lambda: seen.append(1),
                                                 recorder)
    assert len(seen) == len(prompts) and len(sequences) == len(prompts)
    assert recorder.chunks == {}                        # every request's states were taken
    seqs = data.recorded_sequences(sequences, lens, states, 2)
    assert states == []                                 # held once: the split emptied the list
    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    for i, ids in enumerate(sequences):
        generated = pipe.generate([prompts[i]], max_new_tokens=12)[0].token_ids
        assert ids == pipe.tokenizer.encode(prompts[i]) + generated[:-1]   # all but the last
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want_aux = torch.cat([hs[0], hs[1]], -1)[0].half().float()            # [T, 2E]
        assert seqs.states[i].shape == (len(ids), 128) and seqs.finals[i].shape == (len(ids), 64)
        torch.testing.assert_close(seqs.states[i].float(), want_aux, atol=3e-3, rtol=3e-3)
        torch.testing.assert_close(seqs.finals[i].float(), hs[-1][0].half().float(), atol=3e-3,
                                   rtol=3e-3)


def test_an_interrupted_data_phase_resumes_from_the_parts_it_saved(hf_models, tmp_path,
                                                                    monkeypatch):
    """The data phase is decoded and saved in parts: stopped inside its second part (Ctrl-C),
    a rerun loads the first instead of decoding it again, and ends with the data an
    uninterrupted run records."""
    from specflow.training import data

    monkeypatch.setattr(data, "PART_SEQUENCES", 4)            # 12 prompts: 3 parts
    decode = data.continuations
    calls = []

    def counted(pipe, prompts, *args, **kw):
        calls.append(len(prompts))
        if stop_at == len(calls):
            raise KeyboardInterrupt
        return decode(pipe, prompts, *args, **kw)
    monkeypatch.setattr(data, "continuations", counted)

    class Heard:                                 # a progress that keeps the notes it hears
        notes: list[str] = []

        def __call__(self, *_args):
            return quiet()

        def note(self, text):
            self.notes.append(text)

    def run(out):
        cfg = compose(TRAIN + [f"model.path={hf_models['llama']}", f"train_head.output={out}"],
                      "train_head")
        Heard.notes = []
        train_head.run(cfg, read_prompts(cfg), Heard())
        return torch.load(out / "train_data.pt", weights_only=False)

    stop_at = 2
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a" / "train_data.parts").iterdir()) == \
        ["part-0000.pt"]
    calls.clear()
    stop_at = 0
    resumed = run(tmp_path / "a")
    assert calls == [4, 4]                                    # the first part was loaded
    assert Heard.notes == [f"resuming the data phase: 4 of 12 sequences were decoded earlier "
                           f"(read from {tmp_path / 'a' / 'train_data.parts'}); decoding the rest"]
    run(tmp_path / "a")                        # once more: data and training are both done
    assert Heard.notes[0].startswith("resuming: the data phase is done (") and \
        Heard.notes[1].startswith("resuming training at step ")
    assert not (tmp_path / "a" / "train_data.parts").exists()   # train_data.pt holds it all
    whole = run(tmp_path / "b")
    assert [t.tolist() for t in resumed.tokens] == [t.tolist() for t in whole.tokens]
    for a, b in zip(resumed.states + resumed.finals, whole.states + whole.finals):
        torch.testing.assert_close(a, b)
