"""`specflow train-head`: self-distil an EAGLE-3 draft head for the configured target.

1. the target continues the workload's prompts (plain decoding, batched), and, with
   `chat_turns`, answers user turns it wrote itself through its chat template (user_turns.py);
2. the same decoding passes record the head's inputs and the target's final normed state
   (data.StateRecorder), saved in parts as they are decoded (train_data.parts/, and the sampled
   user turns in user_turns.json), so an interrupted data phase resumes too;
3. the head trains with training-time test (loop.py), checkpointing as it goes; a rerun with the
   same output folder and settings resumes from the last checkpoint (and reuses the recorded
   data); one with other settings is refused (train_settings.json records them);
4. the head is written in the published EAGLE-3 layout (config.json + model.safetensors), with
   the held-out acceptance and the recipe under config.json's "specflow" key;
5. the written head drafts a few tokens through the real proposer=eagle pipeline, so a head that
   cannot run fails train-head itself.
"""
from __future__ import annotations

import gc
import json
import pathlib
import shutil
import time
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError


HEAD_FORMATS = ("eagle3", "speculators")
PRECISIONS = ("float32", "bfloat16")


@dataclass
class TrainHeadConfig:
    output: str = "???"                 # folder the head is written to
    prompts: int = 512                  # sequences to generate: the workload's first distinct prompts
    prompt_tokens: int = 64             # each prompt cut to its first tokens
    new_tokens: int = 192               # the target's continuation per prompt
    generate_batch: int = 16            # rows decoded together while generating
    chat_turns: int = 0                 # more sequences: user turns the target writes, answered
    draft_vocab_size: int | None = None  # null: min(vocabulary, 32000), EAGLE-3's usual size
    intermediate_size: int | None = None  # null: the target's
    layers: list[int] | None = None     # distinct layers whose inputs it reads; null: (2, L/2, L-3)
    steps: int = 600
    batch: int = 4
    seq: int = 256
    ttt_steps: int = 3
    lr: float = 1e-3
    heldout: float = 0.05               # share of the sequences held out for the acceptance figure
    checkpoint_every: int = 100
    precision: str = "float32"          # float32 | bfloat16: the steps' products (bfloat16:
    #                                     autocast; weights, gradients and AdamW stay float32)
    resume: bool = True
    seed: int = 0
    format: str = "eagle3"              # eagle3: the published layout; speculators: vLLM's format
    sequences: str | None = None        # a head-data folder (token ids) to learn from instead of
    #                                     writing sequences now; its states are recomputed
    sequences_limit: int | None = None  # train on the folder's first N sequences only (null: all)
    init: str | None = None             # a head folder to start from (its weights and draft
    #                                     vocabulary) instead of a fresh head; null: fresh
    states_from: str | None = None      # an earlier run's output on the same folder: its
    #                                     recorded states are reused, only the rest prefilled
    user_weight: float = 1.0            # a folder's turns people wrote (kind user) drawn this
    #                                     many times as often as other sequences, per position

    def __post_init__(self) -> None:
        if self.format not in HEAD_FORMATS:
            raise ConfigError(f"train_head.format={self.format!r}; use eagle3 (the published "
                              f"EAGLE-3 layout) or speculators (the speculators package's format); "
                              f"vLLM and specflow load both")
        if not self.output or self.output == "???":
            raise ConfigError("train_head.output is not set; give the folder the head is "
                              "written to, e.g. train_head.output=heads/mine")
        for name in ("prompts", "prompt_tokens", "new_tokens", "generate_batch", "steps",
                     "batch", "seq", "ttt_steps", "checkpoint_every"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"train_head.{name}={getattr(self, name)} must be >= 1")
        if int(self.chat_turns) < 0:
            raise ConfigError(f"train_head.chat_turns={self.chat_turns} must be >= 0 (0: no "
                              f"chat data)")
        if not 0 <= self.heldout < 1:
            raise ConfigError(f"train_head.heldout={self.heldout} must be in [0, 1)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train_head.precision={self.precision!r}; use float32 or bfloat16 "
                              f"(autocast products: 1.37x faster steps on a 2-core Zen 4 "
                              f"with AVX512-BF16)")
        if self.lr <= 0:
            raise ConfigError(f"train_head.lr={self.lr} must be > 0")
        if self.sequences_limit is not None and self.sequences_limit < 1:
            raise ConfigError(f"train_head.sequences_limit={self.sequences_limit} must be >= 1 "
                              f"(null: every sequence of the folder)")
        if self.user_weight <= 0:
            raise ConfigError(f"train_head.user_weight={self.user_weight} must be > 0 (1: the "
                              f"turns people wrote drawn as often as the rest)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ConfigError(f"train_head.draft_vocab_size={self.draft_vocab_size} must be >= 2")


def head_shape_for(target, cfg: TrainHeadConfig, vocab: int):
    from specflow.backends.heads.eagle import HeadShape, train_layer_ids

    c = target.decoder_shape()
    if c is None:
        raise ConfigError(f"train-head needs the target's decoder sizes, and its "
                          f"{type(target).__name__} backend gives none (Backend.decoder_shape); "
                          f"use model=hf")
    layers = train_layer_ids(cfg.layers, target)
    return HeadShape(
        hidden_size=c.hidden_size,
        intermediate_size=int(cfg.intermediate_size or c.intermediate_size),
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        vocab_size=vocab, draft_vocab_size=min(vocab, int(cfg.draft_vocab_size or 32000)),
        target_hidden_size=c.hidden_size, layer_ids=layers, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings)


def run(cfg, prompts: list[str], progress) -> dict:
    """Everything train-head does; `progress(description, total)` returns an advance(n, **info)
    callable for each phase, and `progress.note(text)`, where it has one, hears what a resumed
    run picked up (specflow/app/progress.py). Returns the summary written into config.json."""
    from omegaconf import OmegaConf

    from specflow.backends.heads.eagle import check_head_folder, target_dims, train_layer_ids

    th = TrainHeadConfig(**OmegaConf.to_container(cfg.train_head, resolve=True))
    out = pathlib.Path(th.output).expanduser()
    if th.init:             # before the data phase: a wrong folder is found in a second
        check_head_folder(th.init, target_dims(cfg), f"train_head.init={th.init!r}")
    settings = settings_of(cfg, th, train_layer_ids(th.layers, target_dims(cfg)))
    if th.sequences:        # a grown folder is other data: a rerun on it starts over
        from specflow.training import head_data

        count = head_data.count(th.sequences)
        settings["head_data.sequences"] = min(count, th.sequences_limit or count)
    if th.resume:
        check_rerun(out, settings)
    summary, check_prompts = _train(cfg, th, out, settings, prompts, progress)
    gc.collect()                    # the training pipeline's target, before the check loads one
    check_head_runs(cfg, out, check_prompts)
    return summary


def _train(cfg, th: TrainHeadConfig, out: pathlib.Path, settings: dict, prompts: list[str],
           progress) -> tuple[dict, list[str]]:
    """Data, training, the head's files. -> (summary, two prompts for check_head_runs); the
    target and the data are released when it returns."""
    from specflow.backends.heads.eagle import save_head
    from specflow.training import data, loop

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    threads = torch.get_num_threads()      # the pipeline picks its decoding threads; training
    pipe, run_cfg = _decoding_pipeline(cfg, th)     # gets them all back below
    target = pipe.target
    shape = head_shape_for(target, th, target.vocab_size)
    seqs, n_held = _target_written(pipe, run_cfg, th, out, {**settings, "train_head.layers":
                                                            shape.layer_ids}, prompts, shape,
                                   progress)
    check_prompts = data.cut_prompts(prompts, target.tokenizer, th.prompt_tokens, 2)
    generated = time.perf_counter() - started
    torch.set_num_threads(threads)
    train_seqs, held = seqs.split_last(n_held)
    head, lm = _head_from_target(target, shape, train_seqs, th.seed) if not th.init else \
        _head_from_folder(target, shape, th.init, train_seqs)
    schedule = loop.Settings(steps=th.steps, batch=th.batch, seq=th.seq, ttt_steps=th.ttt_steps,
                             lr=th.lr, checkpoint_every=th.checkpoint_every, seed=th.seed,
                             bfloat16=th.precision == "bfloat16")
    windows = loop.Windows(train_seqs, lm, th.seq, th.ttt_steps, kind_weights(train_seqs, th))
    adv = progress("training (training-time test)", th.steps)
    t0 = time.perf_counter()
    log = loop.train(head, windows, schedule, out / "checkpoint.pt", th.resume, adv,
                     getattr(progress, "note", lambda text: None))
    trained = time.perf_counter() - t0
    figure = loop.heldout_acceptance(head, loop.Windows(held, lm, th.seq, 4), 4) if len(held) \
        else None
    wanted = torch.cat([t[p:] for t, p in zip(train_seqs.tokens, train_seqs.prompt_lens)])
    coverage = float(head.t2d.cpu()[wanted].float().mean()) if wanted.numel() else None
    summary = {
        "target": {"layers": target.num_layers, "hidden_size": target.hidden_size,
                   "vocab_size": target.vocab_size}, "sequences": len(seqs), "train_positions":
            train_seqs.positions(), "heldout_sequences": len(held),
        "draft_vocab_coverage": round(coverage, 4) if coverage is not None else None,
        "recipe": {k: getattr(th, k) for k in ("prompts", "chat_turns", "prompt_tokens",
                                               "new_tokens", "steps", "batch", "seq", "ttt_steps",
                                               "lr", "seed")} if not th.sequences else
        {"sequences": settings["head_data.sequences"],
         **{k: getattr(th, k) for k in ("steps", "batch", "seq", "ttt_steps", "lr", "seed")}},
        "precision": th.precision,
        **({"init": _init_record(th.init)} if th.init else {}),
        "seconds": {"data": round(generated, 1), "train": round(trained, 1)},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "heldout_greedy": figure, "log": log[-3:],
        "params": sum(p.numel() for p in head.parameters()),
    }
    save_head(head, out, summary)
    if th.format == "speculators":          # the same weights under the speculators config
        from specflow.backends.heads.speculators_format import write_speculators

        write_speculators(out, out, verifier=str(target.path))
    return summary, check_prompts


def _decoding_pipeline(cfg, th: TrainHeadConfig):
    """The target's plain decoding pipeline, `generate_batch` rows at once. -> (pipeline, its
    config)."""
    from omegaconf import OmegaConf, open_dict

    from specflow.backends.hf.backend import HFBackend
    from specflow.pipeline import Pipeline

    run_cfg = cfg.copy()
    with open_dict(run_cfg):
        run_cfg.proposer = OmegaConf.create({"name": "none"})
        run_cfg.policy = OmegaConf.create({"name": "static", "k": 0})
        run_cfg.max_batch_size = th.generate_batch
    pipe = Pipeline(run_cfg)
    if not isinstance(pipe.target, HFBackend):
        raise ConfigError(f"train-head needs a transformers target (model=demo or model=hf); "
                          f"model={cfg.model.name} has no hidden states to learn from")
    return pipe, run_cfg


def _target_written(pipe, run_cfg, th: TrainHeadConfig, out: pathlib.Path, settings: dict,
                    prompts: list[str], shape, progress):
    """The target's continuations of the prompts and their states at the head's layers: read
    back from train_data.pt when resuming a finished data phase, else decoded now (in parts a
    rerun resumes); with train_head.sequences, the folder's sequences and their states
    recomputed by prefill. -> (data.Sequences, how many of them, at the end, are held out)"""
    from specflow.training import data, user_turns

    target = pipe.target
    cache, parts = out / "train_data.pt", out / PARTS
    if not th.resume:                     # start over: what an earlier run decoded goes
        shutil.rmtree(parts, ignore_errors=True)
        (out / TURNS).unlink(missing_ok=True)
    note = getattr(progress, "note", lambda text: None)
    if th.resume and cache.is_file():
        seqs = torch.load(cache, weights_only=False)
        check_recorded_width(cache, seqs, shape)
        note(f"resuming: the data phase is done ({len(seqs)} target-written sequences, "
             f"{seqs.positions()} positions, read from {cache})")
        held = getattr(seqs, "heldout_count", None)        # None: a share, or an older file
        return seqs, held if held is not None else seqs.heldout_share(th.heldout)
    if th.sequences:
        write_settings(out, settings)
        seqs = _prefilled(pipe, th, shape, progress)
        data.save_whole(seqs, cache)
        return seqs, seqs.heldout_count
    cut = data.cut_prompts(prompts, target.tokenizer, th.prompt_tokens, th.prompts)
    if not cut:
        raise ConfigError("train-head: the workload gave no non-empty prompts")
    write_settings(out, settings)
    if th.chat_turns:                 # the target's own user turns, answered like the rest
        user_turns.pre_query_template(target.tokenizer)    # no chat template: one line, now
        cut = user_turns.interleave(cut, chat_prompts(run_cfg, th, progress, out / TURNS))
    # the states come from the decoding passes themselves (no second forward)
    recorder = data.StateRecorder(shape.layer_ids, target.num_layers)
    pipe.register(recorder, "train-head.states")
    adv = progress("target writes continuations", len(cut))
    sequences, lens, states = data.continuations_in_parts(pipe, cut, th.new_tokens,
                                                          lambda: adv(1), recorder, parts, note)
    seqs = data.recorded_sequences(sequences, lens, states, len(shape.layer_ids))
    del states
    data.save_whole(seqs, cache)
    shutil.rmtree(parts, ignore_errors=True)          # train_data.pt holds them all now
    return seqs, seqs.heldout_share(th.heldout)


def kind_weights(seqs, th: TrainHeadConfig) -> list[float] | None:
    """How often each sequence's positions are drawn (train_head.user_weight for the turns
    people wrote, 1 for the rest), or None: all alike."""
    from specflow.training.head_data import KINDS

    if seqs.kinds is None or th.user_weight == 1.0:
        return None
    user = KINDS.index("user")
    return [th.user_weight if kind == user else 1.0 for kind in seqs.kinds]


def _prefilled(pipe, th: TrainHeadConfig, shape, progress):
    """A head-data folder's sequences with their states recomputed by one prefill each (or read
    from train_head.states_from's train_data.pt where it holds them), the held-out ones
    (head_data.IdSequences.heldout: by index, stable as the folder grows) moved to the end.
    -> data.Sequences with heldout_count set"""
    from specflow.training import data, head_data

    ids, manifest = head_data.read(th.sequences)
    target = pipe.target
    if manifest["target"]["vocab_size"] != target.vocab_size:
        raise ConfigError(f"train_head.sequences={th.sequences!r} was written by a target with "
                          f"{manifest['target']['vocab_size']} tokens "
                          f"({manifest['target']['file']}), this one has {target.vocab_size}; "
                          f"pick the folder written by this target")
    held = ids.heldout()     # over the whole folder: every limit is scored on the same ones
    limit = th.sequences_limit or len(ids)
    order = [i for i, h in enumerate(held) if not h and i < limit] + \
        [i for i, h in enumerate(held) if h]
    keep = [i for i in order if len(ids.tokens[i]) > 3]
    fed = {i: ids.tokens[i][:-1].tolist() for i in keep}     # the positions decoding fed
    earlier = _earlier_states(th.states_from, pipe, shape, fed) if th.states_from else {}
    todo = [i for i in keep if tuple(fed[i]) not in earlier]
    sub = head_data.IdSequences([ids.tokens[i] for i in todo], [ids.prompt_lens[i] for i in todo],
                                [ids.kinds[i] for i in todo])
    adv = progress("target reads the sequences (prefill)", len(sub))
    states = head_data.prefilled_states(target, sub, shape.layer_ids, th.generate_batch, adv)
    fresh = data.recorded_sequences([fed[i] for i in todo], sub.prompt_lens, states,
                                    len(shape.layer_ids))
    rows = dict(zip(todo, zip(fresh.tokens, fresh.states, fresh.finals)))
    rows.update({i: earlier[tuple(fed[i])] for i in keep if i not in rows})
    seqs = data.Sequences([rows[i][0] for i in keep], [rows[i][1] for i in keep],
                          [rows[i][2] for i in keep], [ids.prompt_lens[i] for i in keep])
    seqs.heldout_count = sum(held[i] for i in keep)
    seqs.kinds = [ids.kinds[i] for i in keep]
    return seqs


def _earlier_states(folder: str, pipe, shape, fed: dict[int, list[int]]) -> dict:
    """The states an earlier train-head run on a head-data folder recorded (its
    train_data.pt), for the sequences it shares with `fed`: {token ids: (tokens [T], states
    [T, nE], finals [T, E])}. Its first shared sequence is prefilled again and must match (the
    same target, dtype and layers), else one line."""
    from specflow.training import head_data

    where = f"train_head.states_from={folder!r}"
    path = pathlib.Path(folder).expanduser() / "train_data.pt"
    if not path.is_file():
        raise ConfigError(f"{where} holds no train_data.pt; give the output folder of an earlier "
                          f"train-head run with train_head.sequences, or drop the setting")
    seqs = torch.load(path, weights_only=False)
    check_recorded_width(where, seqs, shape, "drop the setting to recompute them")
    wanted = {tuple(t) for t in fed.values()}
    found = {}
    for t, s, f in zip(seqs.tokens, seqs.states, seqs.finals):
        key = tuple(t.tolist())
        if key in wanted:
            found[key] = (t, s, f)
    del seqs
    if found:                    # one sequence prefilled again: the same target computed them
        key = next(iter(found))
        probe = head_data.IdSequences([torch.tensor([*key, 0])], [1], [0])
        again = head_data.prefilled_states(pipe.target, probe, shape.layer_ids, 1,
                                           lambda n: None)[0].float()            # [T, (k+1)E]
        had = torch.cat(found[key][1:], dim=-1).float()
        err = float(((again - had).abs() / (had.abs() + 1.0)).max())
        if err > STATES_TOLERANCE:
            raise ConfigError(f"{where} holds states this target does not compute (a relative "
                              f"difference of {err:.3g} on a sequence prefilled again: another "
                              f"model, dtype or layers); drop the setting to recompute them")
    return found


def _head_from_target(target, shape, train_seqs, seed: int):
    """A fresh head on the target's device: the target's embedding, its final norm and the
    draft vocabulary's rows of its LM head to start from. -> (head, lm [Vd, E] the target's
    LM head rows the training-time test scores with)."""
    from specflow.backends.heads.eagle import init_head
    from specflow.training import data

    embed = target.input_embeddings().detach().float()                              # [V, E]
    head = init_head(shape, embed, seed).float()
    used = data.draft_vocabulary(train_seqs, shape.draft_vocab_size, shape.vocab_size)
    head.set_vocab(used)
    with torch.no_grad():   # start from the target's own output layer: its final norm and the
        head.norm.weight.copy_(target.final_norm().float())                # draft vocabulary's
        head.lm_head.weight.copy_(target.output_head().detach().float()[used])   # LM head rows
    head.to(target.device)      # trains where the target runs (device=cuda: on the GPU)
    head.embed = head.embed.to(target.device)
    lm = target.output_head().detach().float()[used.to(target.device)]              # [Vd, E]
    return head, lm


def _head_from_folder(target, shape, init: str, train_seqs):
    """The head in folder `init` (train_head.init) to train on from where it stopped: its weights
    (float32 from here on) and its draft vocabulary; its shape must be this run's, but for a
    larger draft vocabulary (grown, _grown_vocabulary). -> (head, lm [Vd, E] the target's LM
    head rows of its draft vocabulary)."""
    from dataclasses import asdict

    from specflow.backends.heads.eagle import read_head

    what = f"train_head.init={init!r}"
    head, _ = read_head(init, target, what)
    theirs, ours = asdict(head.shape), asdict(shape)
    diffs = [f"{k} {theirs[k]} (this run: {ours[k]})" for k in ours if theirs[k] != ours[k]
             and not (k == "draft_vocab_size" and ours[k] > theirs[k])]
    if diffs:
        raise ConfigError(f"{what} has another shape: {'; '.join(diffs)}; train with its settings "
                          f"(train_head.layers, intermediate_size; draft_vocab_size may only "
                          f"grow) or start fresh with train_head.init=null")
    head.check_finite()                     # a torn head would train on NaN
    head = head.float()                         # d2t and t2d keep their integer types
    if shape.draft_vocab_size > head.shape.draft_vocab_size:
        head = _grown_vocabulary(head, shape, target, train_seqs)
    head = head.to(target.device)
    head.embed = target.input_embeddings().detach().float().to(target.device)
    head.requires_grad_(True)
    lm = target.output_head().detach().float()[head.draft_ids.to(target.device)]    # [Vd, E]
    return head, lm


def _grown_vocabulary(head, shape, target, train_seqs):
    """`head` (float32, on the CPU) with its draft vocabulary grown to shape.draft_vocab_size:
    every token it had, then the training sequences' most frequent others; the LM head rows of
    its tokens kept as trained, the new ones the target's own (as a fresh head starts), every
    other weight as it was."""
    from specflow.backends.heads.eagle import init_head
    from specflow.training import data

    old = head.draft_ids.cpu()                                                       # [Vo]
    used = data.draft_vocabulary(train_seqs, shape.draft_vocab_size, shape.vocab_size,
                                 keep=old)                                           # [Vd]
    grown = init_head(shape, head.embed.float().cpu()).float()     # every weight replaced below
    state = {k: v for k, v in head.state_dict().items()
             if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = grown.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight", "d2t", "t2d"}, (missing, unexpected)
    grown.set_vocab(used)
    with torch.no_grad():
        rows = target.output_head().detach().float().cpu()[used].clone()              # [Vd, E]
        rows[torch.searchsorted(used, old)] = head.lm_head.weight.detach().float().cpu()
        grown.lm_head.weight.copy_(rows)
    return grown


def _init_record(init: str) -> dict:
    """What the head trained on from was: its folder and the recipe its config.json records
    (itself with any head it started from), so a card can add up the steps."""
    from specflow.io import read_json

    config = read_json(pathlib.Path(init).expanduser() / "config.json", "train_head.init",
                       "copy the head again", ConfigError)
    made = config.get("specflow") or {}
    return {"path": str(init), **{k: made[k] for k in ("recipe", "precision", "init",
                                                        "heldout_greedy") if k in made}}


def chat_prompts(run_cfg, th: TrainHeadConfig, progress, saved: pathlib.Path) -> list[str]:
    """th.chat_turns user turns sampled from the target (a sampling pipeline of its own,
    released before the greedy one decodes), each through the chat template; kept in `saved`
    (JSON), which a rerun with the same settings reads instead of sampling again."""
    from specflow.experiments.workloads import apply_chat_template
    from specflow.io import atomic_write_json
    from specflow.pipeline import Pipeline
    from specflow.training import user_turns

    if saved.is_file():
        prompts = json.loads(saved.read_text())
        getattr(progress, "note", lambda text: None)(
            f"resuming: {len(prompts)} user turns the target wrote earlier, read from {saved}")
        return prompts
    pipe = Pipeline(user_turns.sampling_config(run_cfg))
    try:
        adv = progress("target writes user turns", th.chat_turns)
        turns = user_turns.sample_user_turns(pipe, th.chat_turns, th.seed, adv)
        prompts = apply_chat_template(turns, pipe.tokenizer, "on")
    finally:
        del pipe
        gc.collect()
    atomic_write_json(saved, prompts)
    return prompts


# --- a rerun into the same folder ----------------------------------------------------------------

SETTINGS_FILE = "train_settings.json"
STATES_TOLERANCE = 2.5e-3  # train_head.states_from: about two float16 steps (|a - b| / (|b| + 1))
PARTS = "train_data.parts"        # the data phase's decoded parts, until train_data.pt holds them
TURNS = "user_turns.json"         # the sampled user turns (train_head.chat_turns), as prompts
RESULTS = ("train_data.pt", "checkpoint.pt", "model.safetensors", PARTS, TURNS)
# what the recorded data, the head's shape and its training depend on, besides the target, the
# workload, the logits settings and the layers: a rerun must keep them to resume (steps may
# grow; checkpoint_every, generate_batch, device and threads may change)
KEPT = ("prompts", "chat_turns", "prompt_tokens", "new_tokens", "draft_vocab_size", "intermediate_size",
        "batch", "seq", "ttt_steps", "lr", "heldout", "seed", "sequences", "sequences_limit",
        "init", "user_weight")

# settings newer than some folders: their values then
ADDED_SINCE = {"train_head.chat_turns": 0, "train_head.sequences": None,
               "train_head.sequences_limit": None, "train_head.init": None,
               "train_head.user_weight": 1.0}


def settings_of(cfg, th: TrainHeadConfig, layers: list[int]) -> dict:
    """The settings a folder's results are made with, flat as overrides ("workload.limit": 40),
    as they read back from SETTINGS_FILE; `layers`: the resolved ones ([]: known after load)."""
    from omegaconf import OmegaConf

    flat = {"model.path": str(OmegaConf.select(cfg, "model.path", throw_on_missing=False)),
            "train_head.layers": layers or th.layers}
    for group in ("workload", "logits"):         # greedy (no logits): no keys
        node = cfg.get(group)
        if node:
            flat.update(_flat(OmegaConf.to_container(node, resolve=True), group))
    flat.update({f"train_head.{k}": getattr(th, k) for k in KEPT})
    return json.loads(json.dumps(flat))


def _flat(value, prefix: str) -> dict:
    if not isinstance(value, dict):
        return {prefix: value}
    return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}.{key}").items()}


def write_settings(out: pathlib.Path, settings: dict) -> None:
    tmp = out / (SETTINGS_FILE + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2) + "\n")
    tmp.replace(out / SETTINGS_FILE)


def check_rerun(out: pathlib.Path, settings: dict) -> None:
    """Refuse to resume in a folder whose data, checkpoint or head were made with other settings
    (other sizes crash on load; other data or a recipe would be mixed into one head)."""
    from specflow.io import read_json

    path = out / SETTINGS_FILE
    if not path.is_file() or not any((out / name).exists() for name in RESULTS):
        return
    fix = (f"pick another train_head.output, delete {out}, or pass train_head.resume=false to "
           f"start it over")
    recorded = read_json(path, str(path), fix, ConfigError)
    if not isinstance(recorded, dict):
        raise ConfigError(f"{path} is not a JSON object; {fix}")
    recorded = {**ADDED_SINCE, **recorded}       # a folder from before a setting existed
    if settings.get("train_head.layers") is None:        # resolved only once the target loads
        recorded = {**recorded, "train_head.layers": None}
    unset = object()

    def show(value) -> str:
        return "unset" if value is unset else value if isinstance(value, str) else json.dumps(value)
    diffs = [f"{key}={show(recorded.get(key, unset))} there, {show(settings.get(key, unset))} now"
             for key in sorted(set(recorded) | set(settings))
             if recorded.get(key, unset) != settings.get(key, unset)]
    if diffs:
        raise ConfigError(f"train_head.output={str(out)!r} holds a head trained with other "
                          f"settings ({'; '.join(diffs)}); rerun with those to resume it, or "
                          f"{fix}")


def check_recorded_width(cache, seqs, shape, fix: str = "pick another train_head.output, "
                         "delete the folder, or pass train_head.resume=false") -> None:
    """train_data.pt of a folder without SETTINGS_FILE (written before it was), or
    train_head.states_from's: its states must be as wide as the head's input."""
    width = shape.target_hidden_size * len(shape.layer_ids)
    got = int(seqs.states[0].shape[-1]) if len(seqs) else width
    if got != width:
        raise ConfigError(f"{cache} holds target states {got} wide, but layers "
                          f"{shape.layer_ids} of this target are {width}: it was recorded with "
                          f"other train_head.layers or another target; {fix}")


# --- the closing check ---------------------------------------------------------------------------

def check_head_runs(cfg, out: pathlib.Path, prompts: list[str], new_tokens: int = 8) -> None:
    """Run the written head the way `proposer=eagle proposer.path=<out>` will: the real pipeline
    (the target loaded again, the proposer's own loading and drafting) on a few tokens of two
    prompts. A head that cannot run fails train-head here, in one line, before any figure is
    reported."""
    from omegaconf import OmegaConf, open_dict

    from specflow.errors import SpecflowError
    from specflow.pipeline import Pipeline

    check_cfg = cfg.copy()
    with open_dict(check_cfg):
        check_cfg.proposer = OmegaConf.create({"name": "eagle", "k": 4, "path": str(out)})
        check_cfg.policy = OmegaConf.create({"name": "static", "k": 4})
        check_cfg.stop = OmegaConf.create({"name": "default", "eos": False})   # all the tokens
        check_cfg.max_batch_size = 2
        check_cfg.pack = False
        check_cfg.threads = torch.get_num_threads()
    what = f"train-head: the head written to {str(out)!r}"
    try:
        pipe = Pipeline(check_cfg)
        pipe.generate(prompts, max_new_tokens=new_tokens)
    except SpecflowError as exc:
        raise ConfigError(f"{what} fails under proposer=eagle: {exc}") from exc
    except (RuntimeError, ValueError, IndexError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"{what} does not run under proposer=eagle ({type(exc).__name__}: "
                          f"{reason}); do not use it: delete the folder and report this with "
                          f"the train-head command that wrote it") from exc
    if not pipe.last_stats.get("num_draft_tokens"):
        raise ConfigError(f"{what} drafted no token under proposer=eagle in {new_tokens} tokens "
                          f"of two prompts; do not use it: delete the folder and report this "
                          f"with the train-head command that wrote it")
