"""`specflow head-data` (training/head_data.py): a head's data kept as token ids, grown a part
at a time, and train-head learning from it with the states recomputed by prefill."""
from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from specflow import ConfigError, Pipeline
from specflow.app.prompts import read_prompts
from specflow.config import compose
from specflow.training import head_data, train_head, user_turns

GROW = ["model=hf", "draft=none", "head_data.new_tokens=10", "head_data.prompt_tokens=12",
        "head_data.generate_batch=3"]
TRAIN = ["model=hf", "draft=none", "train_head.steps=4", "train_head.batch=2",
         "train_head.seq=24", "train_head.draft_vocab_size=120", "train_head.checkpoint_every=2",
         "train_head.generate_batch=4", "train_head.layers=[0,1]"]


def quiet(*_args):
    return lambda *_a, **_k: None


@pytest.fixture
def chatty(hf_models, tmp_path, monkeypatch):
    """The tiny llama with a chat template and decisive logits (its LM head x 8: no near-ties
    for float rounding to flip between kernel choices), and user turns drawn by index (the
    tiny random model rarely ends one): draw i is "question i?", so continuing the draws gives
    new turns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / "chatty"
    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(hf_models["llama"])
    tok.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}"
                         "\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(path)

    def turns(pipe, count, seed, advance, start):
        assert set(pipe.cfg.logits.keys()) == {"temperature", "top_p"}   # a sampling pipeline
        return [f"question {i}?" for i in range(start, start + count)], start + count
    monkeypatch.setattr(user_turns, "draw_user_turns", turns)
    monkeypatch.setattr(head_data, "PART_SEQUENCES", 4)
    return path


def grow(model, folder, *more):
    cfg = compose(GROW + [f"model.path={model}", f"head_data.folder={folder}", *more],
                  "head_data")
    return head_data.grow(cfg, quiet)


def test_a_folder_grown_in_three_runs_holds_what_one_run_writes(chatty, tmp_path):
    one = "head_data.generate_batch=3"
    # the draws, code prompts and chat share continue exactly where the folder stopped
    grow(chatty, tmp_path / "a", "head_data.sequences=5", one)
    grow(chatty, tmp_path / "a", "head_data.sequences=2", one)
    manifest = grow(chatty, tmp_path / "a", "head_data.sequences=3", one)
    whole = grow(chatty, tmp_path / "b", "head_data.sequences=10", one)
    a, _ = head_data.read(tmp_path / "a")
    b, _ = head_data.read(tmp_path / "b")
    assert len(a) == 10 and a.positions() > 0
    # parts are cut where the runs stopped, so chat and code alternate differently; the set of
    # sequences written is the same: the code prompts and the draws continue where they stopped
    assert sorted(map(tuple, (t.tolist() for t in a.tokens))) == \
        sorted(map(tuple, (t.tolist() for t in b.tokens)))
    assert sum(a.kinds) == sum(b.kinds) == sum(p["chat"] for p in whole["parts"])
    assert [p["sequences"] for p in manifest["parts"]] == [4, 1, 2, 3]
    assert manifest["next_code_prompt"] == whole["next_code_prompt"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatty)
    model = AutoModelForCausalLM.from_pretrained(chatty, dtype=torch.float32)
    for t, n, kind in zip(a.tokens, a.prompt_lens, a.kinds):
        assert ("question" in tok.decode(t[:n].tolist())) == (kind == 1)
        # each sequence is its prompt and the target's greedy continuation of it
        ids = t[:n].tolist()
        with torch.no_grad():
            for _ in range(len(t) - n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids == t.tolist()
    with np.load(tmp_path / "a" / "part-0000.npz") as part:
        assert part["tokens"].dtype == np.uint16               # a small vocabulary: 2 bytes


def test_no_prompt_is_written_twice_in_a_folder(chatty, tmp_path):
    grow(chatty, tmp_path / "a", "head_data.sequences=6")
    grow(chatty, tmp_path / "a", "head_data.sequences=6")
    seqs, _ = head_data.read(tmp_path / "a")
    prompts = [tuple(t[:n].tolist()) for t, n in zip(seqs.tokens, seqs.prompt_lens)]
    assert len(set(prompts)) == len(prompts) == 12


def test_growing_with_other_settings_or_a_changed_part_is_one_line(chatty, tmp_path):
    grow(chatty, tmp_path / "a", "head_data.sequences=2")
    with pytest.raises(ConfigError, match=r"written with another target or settings "
                                          r"\(new_tokens=10 there, 11 now\)"):
        grow(chatty, tmp_path / "a", "head_data.sequences=2", "head_data.new_tokens=11")
    with open(tmp_path / "a" / "part-0000.npz", "ab") as f:
        f.write(b"x")
    with pytest.raises(ConfigError, match="part-0000.npz is missing or differs from its entry"):
        head_data.read(tmp_path / "a")
    with pytest.raises(ConfigError, match="holds no head data"):
        head_data.read(tmp_path / "nothing")


def test_code_only_needs_no_chat_template(hf_models, tmp_path, monkeypatch):
    monkeypatch.setattr(head_data, "PART_SEQUENCES", 4)
    grow(hf_models["llama"], tmp_path / "a", "head_data.sequences=3", "head_data.chat_share=0")
    seqs, manifest = head_data.read(tmp_path / "a")
    assert seqs.kinds == [0, 0, 0] and manifest["next_chat_draw"] == 0
    with pytest.raises(ConfigError, match="needs a target with a chat template .* set "
                                          "head_data.chat_share=0"):        # before writing
        grow(hf_models["llama"], tmp_path / "b", "head_data.sequences=2")
    assert not (tmp_path / "b" / head_data.MANIFEST).exists()


def test_user_prompts_are_answered_once_each_in_file_order(chatty, hf_models, tmp_path):
    turns = tmp_path / "turns.jsonl"
    turns.write_text("".join(json.dumps({"prompt": f"people ask {i}?"}) + "\n" for i in range(7)))
    user = f"head_data.user_prompts={turns}"
    grow(chatty, tmp_path / "a", "head_data.sequences=2")               # code and own turns
    grow(chatty, tmp_path / "a", "head_data.sequences=5", user)
    manifest = grow(chatty, tmp_path / "a", "head_data.sequences=5", user)  # 2 left: those
    seqs, _ = head_data.read(tmp_path / "a")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chatty)
    asked = [tok.decode(t[:n].tolist()) for t, n, k in zip(seqs.tokens, seqs.prompt_lens,
                                                           seqs.kinds) if k == 2]
    # each turn once, in file order, through the chat template, answered like any prompt
    assert [a.split("people ask ")[1].split("?")[0] for a in asked] == [str(i) for i in range(7)]
    assert all(a.rstrip().endswith("assistant:") for a in asked)
    assert all(k in (0, 1) for k in seqs.kinds[:2]) and seqs.kinds[2:] == [2] * 7
    assert [p["user"] for p in manifest["parts"]] == [0, 4, 1, 2]
    assert sum(p["chat"] for p in manifest["parts"]) == seqs.kinds.count(1)
    # every turn answered: a further run adds nothing and says so
    again = grow(chatty, tmp_path / "a", "head_data.sequences=3", user)
    assert again["parts"] == manifest["parts"]
    with pytest.raises(ConfigError, match="head_data.user_prompts=.* needs a target with a "
                                          "chat template .* drop head_data.user_prompts"):
        grow(hf_models["llama"], tmp_path / "b", "head_data.sequences=1", user)
    assert not (tmp_path / "b" / head_data.MANIFEST).exists()


def test_held_out_sequences_stay_held_out_as_the_folder_grows():
    ids = head_data.IdSequences([torch.arange(5)] * 45, [2] * 45, [0] * 45)
    held = ids.heldout()
    assert [i for i, h in enumerate(held) if h] == [19, 39]
    assert held == head_data.IdSequences(ids.tokens * 2, [2] * 90, [0] * 90).heldout()[:45]


def test_prefilled_states_are_those_of_a_forward_over_each_sequence(hf_models):
    """The states train-head recomputes for a folder: for every position but a sequence's last,
    the inputs of the head's layers and the final normed state, equal (in fp16) to one forward
    of transformers over the whole sequence; three slots for five sequences of other lengths."""
    from transformers import AutoModelForCausalLM

    pipe = Pipeline.from_config(["model=hf", f"model.path={hf_models['llama']}", "draft=none",
                                 "proposer=none", "max_batch_size=3"])
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 200, (n,), generator=gen) for n in (9, 30, 4, 17, 12)]
    seqs = head_data.IdSequences(tokens, [2] * 5, [0] * 5)
    seen = []
    states = head_data.prefilled_states(pipe.target, seqs, [0, 1], 3, seen.append)
    assert seen == [3, 2]
    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32)
    for t, st in zip(tokens, states):
        with torch.no_grad():
            hs = model(t[None, :-1], output_hidden_states=True).hidden_states
        want = torch.cat([hs[0], hs[1], hs[-1]], -1)[0].half().float()      # [T-1, 3E]
        assert st.dtype == torch.float16 and st.shape == want.shape
        torch.testing.assert_close(st.float(), want, atol=3e-3, rtol=3e-3)
    assert all(pipe.target.cache_length(s) == 0 for s in range(3))      # slots released


def test_train_head_learns_from_a_folder_and_a_grown_folder_is_other_data(chatty, tmp_path):
    grow(chatty, tmp_path / "data", "head_data.sequences=24")
    out = tmp_path / "head"
    args = TRAIN + [f"model.path={chatty}", f"train_head.output={out}",
                    f"train_head.sequences={tmp_path / 'data'}"]
    cfg = compose(args, "train_head")
    summary = train_head.run(cfg, read_prompts(cfg), quiet)          # ends with the head running
    ids, _ = head_data.read(tmp_path / "data")
    assert summary["sequences"] == 24 and summary["heldout_sequences"] == 1     # index 19
    assert summary["recipe"]["sequences"] == 24
    seqs = torch.load(out / "train_data.pt", weights_only=False)
    assert seqs.tokens[-1].tolist() == ids.tokens[19][:-1].tolist()
    assert seqs.tokens[0].tolist() == ids.tokens[0][:-1].tolist()
    assert seqs.positions() == ids.positions() - 24
    settings = json.loads((out / train_head.SETTINGS_FILE).read_text())
    assert settings["head_data.sequences"] == 24
    train_head.run(cfg, read_prompts(cfg), quiet)                     # a rerun resumes
    grow(chatty, tmp_path / "data", "head_data.sequences=2")
    with pytest.raises(ConfigError, match="head_data.sequences=24 there, 26 now"):
        train_head.run(cfg, read_prompts(cfg), quiet)


def test_user_weight_draws_the_turns_people_wrote_more_often(chatty, tmp_path):
    turns = tmp_path / "turns.jsonl"
    turns.write_text("".join(json.dumps({"prompt": f"people ask {i}?"}) + "\n" for i in range(4)))
    grow(chatty, tmp_path / "data", "head_data.sequences=6")
    grow(chatty, tmp_path / "data", "head_data.sequences=4", f"head_data.user_prompts={turns}")
    out = tmp_path / "head"
    cfg = compose(TRAIN + [f"model.path={chatty}", f"train_head.output={out}",
                           f"train_head.sequences={tmp_path / 'data'}",
                           "train_head.user_weight=5"], "train_head")
    train_head.run(cfg, read_prompts(cfg), quiet)
    ids, _ = head_data.read(tmp_path / "data")
    seqs = torch.load(out / "train_data.pt", weights_only=False)
    # folder order (none of these 10 is held out): the 4 turns people wrote weigh 5 each
    assert [ids.kinds[i] for i in range(10)][6:] == [2] * 4
    th = train_head.TrainHeadConfig(output="x", user_weight=5)
    assert seqs.kinds == ids.kinds[:10]
    weights = train_head.kind_weights(seqs, th)
    assert weights == [1.0] * 6 + [5.0] * 4
    assert train_head.kind_weights(seqs, train_head.TrainHeadConfig(output="x")) is None
    from specflow.training import loop

    train, _ = seqs.split_last(1)
    windows = loop.Windows(train, torch.zeros(8, 4), 4, 1, train_head.kind_weights(train, th))
    lengths = torch.tensor([len(t) for t in train.tokens], dtype=torch.float)
    assert torch.equal(windows.weights, (lengths - 2).clamp(min=1) * torch.tensor(weights[:9]))
    with pytest.raises(ConfigError, match="train_head.user_weight=0.0 must be > 0"):
        train_head.TrainHeadConfig(output="x", user_weight=0.0)


def test_a_folder_of_another_vocabulary_is_one_line(chatty, hf_models, tmp_path):
    grow(chatty, tmp_path / "data", "head_data.sequences=2")
    manifest = json.loads((tmp_path / "data" / head_data.MANIFEST).read_text())
    manifest["target"]["vocab_size"] += 1
    (tmp_path / "data" / head_data.MANIFEST).write_text(json.dumps(manifest))
    cfg = compose(TRAIN + [f"model.path={chatty}", f"train_head.output={tmp_path / 'h'}",
                           f"train_head.sequences={tmp_path / 'data'}"], "train_head")
    with pytest.raises(ConfigError, match="was written by a target with"):
        train_head.run(cfg, read_prompts(cfg), quiet)


def test_the_command_grows_a_folder_and_refuses_a_missing_one_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    specflow = os.path.join(os.path.dirname(sys.executable), "specflow")
    args = [specflow, "head-data", "--quiet", "model=demo", "head_data.chat_share=0",
            "head_data.sequences=3", "head_data.new_tokens=4", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(args + [f"head_data.folder={tmp_path / 'data'}"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{tmp_path / 'data'}: 3 sequences (0 chat, 0 user)" in done.stdout
    assert f"train_head.sequences={tmp_path / 'data'}" in done.stdout
    bad = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "specflow: error: head_data.folder is not set; give the folder the sequences are kept "
        "in, e.g. head_data.folder=head_data/smollm2"]


def test_a_limit_trains_on_the_first_sequences_scored_on_the_whole_folder_s_held_out(chatty,
                                                                                     tmp_path):
    """train_head.sequences_limit=N: the folder's first N sequences (held-out ones excepted) are
    trained on, the held-out ones are the whole folder's; the folder growing past N leaves such
    a run as it was (a rerun resumes)."""
    grow(chatty, tmp_path / "data", "head_data.sequences=24")
    out = tmp_path / "head"
    cfg = compose(TRAIN + [f"model.path={chatty}", f"train_head.output={out}",
                           f"train_head.sequences={tmp_path / 'data'}",
                           "train_head.sequences_limit=12"], "train_head")
    summary = train_head.run(cfg, read_prompts(cfg), quiet)
    ids, _ = head_data.read(tmp_path / "data")
    assert summary["sequences"] == 13 and summary["heldout_sequences"] == 1     # 0..11 and 19
    assert summary["recipe"]["sequences"] == 12
    seqs = torch.load(out / "train_data.pt", weights_only=False)
    assert [t.tolist() for t in seqs.tokens] == [t[:-1].tolist() for t in
                                                 ids.tokens[:12] + [ids.tokens[19]]]
    grow(chatty, tmp_path / "data", "head_data.sequences=2")
    train_head.run(cfg, read_prompts(cfg), quiet)                      # resumes: same data
    with pytest.raises(ConfigError, match="sequences_limit=0 must be >= 1"):
        train_head.run(compose(TRAIN + [f"model.path={chatty}", f"train_head.output={out}",
                                        "train_head.sequences_limit=0"], "train_head"), [], quiet)


def test_states_from_an_earlier_run_prefill_only_the_new_sequences(chatty, tmp_path, monkeypatch):
    """train_head.states_from=<an earlier run's output>: the sequences it recorded keep their
    states, only the folder's new ones (and one probe) are prefilled, and the data equals a run
    that prefills everything."""
    grow(chatty, tmp_path / "data", "head_data.sequences=12")
    base = TRAIN + [f"model.path={chatty}", f"train_head.sequences={tmp_path / 'data'}"]
    train_head.run(cfg := compose(base + [f"train_head.output={tmp_path / 'a'}"], "train_head"),
                   read_prompts(cfg), quiet)
    grow(chatty, tmp_path / "data", "head_data.sequences=12")
    prefilled = []
    real = head_data.prefilled_states

    def counted(target, seqs, *args):
        prefilled.append(len(seqs))
        return real(target, seqs, *args)
    monkeypatch.setattr(head_data, "prefilled_states", counted)
    for out, more in (("b", [f"train_head.states_from={tmp_path / 'a'}"]), ("c", [])):
        cfg = compose(base + [f"train_head.output={tmp_path / out}", *more], "train_head")
        train_head.run(cfg, read_prompts(cfg), quiet)
    assert prefilled == [1, 12, 24]         # the probe, the 12 new sequences; all 24 without it
    b, c = (torch.load(tmp_path / out / "train_data.pt", weights_only=False) for out in "bc")
    assert [t.tolist() for t in b.tokens] == [t.tolist() for t in c.tokens]
    assert b.heldout_count == c.heldout_count == 1 and b.prompt_lens == c.prompt_lens
    for x, y in zip(b.states + b.finals, c.states + c.finals):
        torch.testing.assert_close(x.float(), y.float(), atol=3e-3, rtol=3e-3)
    cfg = compose(base + [f"train_head.output={tmp_path / 'd'}",
                          f"train_head.states_from={tmp_path / 'none'}"], "train_head")
    gone = "holds no train_data.pt; give the output folder of an earlier train-head run"
    with pytest.raises(ConfigError, match=gone):
        train_head.run(cfg, read_prompts(cfg), quiet)
    cfg = compose(base + [f"train_head.output={tmp_path / 'e'}", "dtype=bfloat16",
                          f"train_head.states_from={tmp_path / 'a'}"], "train_head")
    with pytest.raises(ConfigError, match="holds states this target does not compute"):
        train_head.run(cfg, read_prompts(cfg), quiet)
