"""`specflow train-head`: self-distil an EAGLE-3 draft head for the configured target.

1. the target continues the workload's prompts (plain decoding, batched);
2. one forward over each whole sequence records the head's inputs and the target's last state;
3. the head trains with training-time test (loop.py), checkpointing as it goes; a rerun with the
   same output folder resumes from the last checkpoint (and reuses the recorded data);
4. the head is written in the published EAGLE-3 layout (config.json + model.safetensors), with
   the held-out acceptance and the recipe under config.json's "specflow" key.
"""
from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError


@dataclass
class TrainHeadConfig:
    output: str = "???"                 # folder the head is written to
    prompts: int = 512                  # sequences to generate: the workload's first distinct prompts
    prompt_tokens: int = 64             # each prompt cut to its first tokens
    new_tokens: int = 192               # the target's continuation per prompt
    generate_batch: int = 16            # rows decoded together while generating
    draft_vocab_size: int | None = None  # null: min(vocabulary, 32000), EAGLE-3's usual size
    intermediate_size: int | None = None  # null: the target's
    layers: list[int] | None = None     # target layers whose inputs the head reads; null: (2, L/2, L-3)
    steps: int = 600
    batch: int = 4
    seq: int = 256
    ttt_steps: int = 3
    lr: float = 1e-3
    heldout: float = 0.05               # share of the sequences held out for the acceptance figure
    checkpoint_every: int = 100
    resume: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.output or self.output == "???":
            raise ConfigError("train_head.output is not set; give the folder the head is "
                              "written to, e.g. train_head.output=heads/mine")
        for name in ("prompts", "prompt_tokens", "new_tokens", "generate_batch", "steps",
                     "batch", "seq", "ttt_steps", "checkpoint_every"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"train_head.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.heldout < 1:
            raise ConfigError(f"train_head.heldout={self.heldout} must be in [0, 1)")
        if self.lr <= 0:
            raise ConfigError(f"train_head.lr={self.lr} must be > 0")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ConfigError(f"train_head.draft_vocab_size={self.draft_vocab_size} must be >= 2")


def head_shape_for(target, cfg: TrainHeadConfig, vocab: int):
    from specflow.models.eagle_head import HeadShape, default_layer_ids

    c = target.model.config
    layers = [int(i) for i in cfg.layers] if cfg.layers else default_layer_ids(target.num_layers)
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if bad or len(layers) != 3:
        raise ConfigError(f"train_head.layers={layers}: give three layer indices in "
                          f"0..{target.num_layers - 1} (the inputs of those layers are read)")
    heads = c.num_attention_heads
    return HeadShape(
        hidden_size=c.hidden_size,
        intermediate_size=int(cfg.intermediate_size or c.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        vocab_size=vocab, draft_vocab_size=min(vocab, int(cfg.draft_vocab_size or 32000)),
        target_hidden_size=c.hidden_size, layer_ids=layers,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        rms_norm_eps=float(c.rms_norm_eps),
        rope_theta=float(getattr(c, "rope_theta", None)
                         or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)))


def run(cfg, prompts: list[str], progress) -> dict:
    """Everything train-head does; `progress(description, total)` returns an advance(n, **info)
    callable for each phase. Returns the summary written into config.json."""
    from omegaconf import OmegaConf, open_dict

    from specflow.models.eagle_head import init_head, save_head
    from specflow.models.hf import HFBackend
    from specflow.pipeline import Pipeline
    from specflow.training import data, loop

    th = TrainHeadConfig(**OmegaConf.to_container(cfg.train_head, resolve=True))
    out = pathlib.Path(th.output).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run_cfg = cfg.copy()
    with open_dict(run_cfg):
        run_cfg.proposer = OmegaConf.create({"name": "none"})
        run_cfg.policy = OmegaConf.create({"name": "static", "k": 0})
        run_cfg.max_batch_size = th.generate_batch
        run_cfg.pack = False
    threads = torch.get_num_threads()      # the pipeline picks its decoding threads; training
    pipe = Pipeline(run_cfg)               # gets them all back below
    target = pipe.target
    if not isinstance(target, HFBackend):
        raise ConfigError(f"train-head needs a transformers target (model=demo or model=hf); "
                          f"model={cfg.model.name} has no hidden states to learn from")
    shape = head_shape_for(target, th, target.vocab_size)
    cache = out / "train_data.pt"
    if th.resume and cache.is_file():
        seqs = torch.load(cache, weights_only=False)
    else:
        cut = data.cut_prompts(prompts, target.tokenizer, th.prompt_tokens, th.prompts)
        if not cut:
            raise ConfigError("train-head: the workload gave no non-empty prompts")
        adv = progress("target writes continuations", len(cut))
        sequences = data.continuations(pipe, cut, th.new_tokens, lambda: adv(1))
        lens = [len(target.tokenizer.encode(p)) for p in cut][:len(sequences)]
        adv = progress("target states of each sequence", len(sequences))
        seqs = data.target_states(target.model, sequences, shape.layer_ids, lens, adv)
        torch.save(seqs, cache)
    generated = time.perf_counter() - started
    torch.set_num_threads(threads)
    train_seqs, held = seqs.split(th.heldout)
    embed = target.model.get_input_embeddings().weight.detach().float()
    head = init_head(shape, embed, th.seed).float()
    used = data.draft_vocabulary(train_seqs, shape.draft_vocab_size, shape.vocab_size)
    head.set_vocab(used)
    with torch.no_grad():   # start from the target's own output layer: its final norm and the
        head.norm.weight.copy_(target.model.model.norm.weight.float())     # draft vocabulary's
        head.lm_head.weight.copy_(                                         # rows of its LM head
            target.model.get_output_embeddings().weight.detach().float()[used])
    head.to(target.device)      # trains where the target runs (device=cuda: on the GPU)
    head.embed = head.embed.to(target.device)
    lm = target.model.get_output_embeddings().weight.detach().float()[used.to(target.device)]
    settings = loop.Settings(steps=th.steps, batch=th.batch, seq=th.seq, ttt_steps=th.ttt_steps,
                             lr=th.lr, checkpoint_every=th.checkpoint_every, seed=th.seed)
    windows = loop.Windows(train_seqs, lm, th.seq, th.ttt_steps)
    adv = progress("training (training-time test)", th.steps)
    t0 = time.perf_counter()
    log = loop.train(head, windows, settings, out / "checkpoint.pt", th.resume, adv)
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
        "recipe": {k: getattr(th, k) for k in ("prompts", "prompt_tokens", "new_tokens", "steps",
                                               "batch", "seq", "ttt_steps", "lr", "seed")},
        "seconds": {"data": round(generated, 1), "train": round(trained, 1)},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "heldout_greedy": figure, "log": log[-3:],
        "params": sum(p.numel() for p in head.parameters()),
    }
    save_head(head, out, summary)
    return summary
