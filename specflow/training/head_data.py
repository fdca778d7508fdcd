"""A draft head's data kept as token ids, grown a part at a time: `specflow head-data`.

What a head learns from is the target's own writing: its greedy continuations of code prompts,
its answers to user turns it wrote itself (user_turns.py), and its answers to user turns people
wrote (`head_data.user_prompts`, a prompt file: a small model's own turns are narrower than what
people ask, and a head trained on them alone accepts far less on people's turns). The hidden states those
sequences produce are 4.6 KB a token for SmolLM2 (three layers' inputs and the final state, in
float16), while the sequences are 2 bytes a token: so the sequences are what is kept (in the
repository, where sessions add to them), and train-head recomputes the states by a batched
prefill of the whole sequences (`train_head.sequences=<folder>`; compute-bound and far faster
than writing them, which is token-by-token decoding).

A folder holds `manifest.json` (the target it was written by, the writing settings, and one
entry per part) and `part-NNNN.npz` files: each part's sequences concatenated (`tokens`, uint16
where the vocabulary allows), their `lengths`, `prompt_lens` and `kinds` (0 code, 1 chat, 2 user:
a turn people wrote). A run adds `head_data.sequences` more, PART_SEQUENCES to a part, each
written and entered in the manifest as soon as it is decoded (an interrupted run keeps every
finished part). The code prompts continue the stdlib workload's order where the last part
stopped, and the chat turns continue the sampling draws, so a folder grown in five runs holds
what one run of the same total writes; a prompt already in the folder is skipped (so a run with
user_prompts goes on where the file's last run stopped).
"""
from __future__ import annotations

import gc
import hashlib
import json
import pathlib
from dataclasses import dataclass

import numpy as np
import torch

from specflow.errors import ConfigError

FORMAT = 1
MANIFEST = "manifest.json"
PART_SEQUENCES = 256
KINDS = ("code", "chat", "user")
HELDOUT_EVERY = 20        # every 20th sequence (by its index in the folder) is held out


@dataclass
class HeadDataConfig:
    folder: str = "???"            # the data folder (created, or grown)
    sequences: int = 1024          # sequences to add in this run
    chat_share: float = 0.5        # of them, the share that answer user turns the target wrote
    prompt_tokens: int = 64        # each code prompt cut to its first tokens
    new_tokens: int = 128          # the target's continuation (or answer) per prompt
    generate_batch: int = 32       # rows decoded together
    seed: int = 0                  # the user turns' sampling seed
    user_prompts: str | None = None    # a prompt file of turns people wrote (JSONL `prompt`
                                   # rows, or one a line): this run answers those not yet in
                                   # the folder, in file order (kind user), nothing else

    def __post_init__(self) -> None:
        if not self.folder or self.folder == "???":
            raise ConfigError("head_data.folder is not set; give the folder the sequences are "
                              "kept in, e.g. head_data.folder=head_data/smollm2")
        for name in ("sequences", "prompt_tokens", "new_tokens", "generate_batch"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"head_data.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.chat_share <= 1:
            raise ConfigError(f"head_data.chat_share={self.chat_share} must be in [0, 1] (0: "
                              f"code only, 1: chat only)")


@dataclass
class IdSequences:
    """A folder's sequences in folder order."""

    tokens: list[torch.Tensor]     # [T_i] long each
    prompt_lens: list[int]
    kinds: list[int]               # index into KINDS

    def __len__(self) -> int:
        return len(self.tokens)

    def positions(self) -> int:
        return sum(len(t) for t in self.tokens)

    def heldout(self) -> list[bool]:
        """Held out or not, by index: stable as the folder grows (a sequence never moves
        between the training and the held-out share)."""
        return [i % HELDOUT_EVERY == HELDOUT_EVERY - 1 for i in range(len(self))]


# --- reading ----------------------------------------------------------------------------------

def read_manifest(folder: pathlib.Path) -> dict | None:
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}); restore it from the repository or "
                          f"start another folder") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a head-data manifest of format {FORMAT}; start "
                          f"another folder")
    return manifest


def read(folder: str | pathlib.Path) -> tuple[IdSequences, dict]:
    """(the sequences, the manifest) of a head-data folder; one line for a folder that is not
    one, or a part that does not match its manifest entry."""
    folder = pathlib.Path(folder).expanduser()
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(f"{str(folder)!r} holds no head data ({MANIFEST} is missing); write "
                          f"some with `specflow head-data head_data.folder={folder}`")
    out = IdSequences([], [], [])
    for entry in manifest["parts"]:
        path = folder / entry["file"]
        if not path.is_file() or _digest(path) != entry["sha256"]:
            raise ConfigError(f"{path} is missing or differs from its entry in {MANIFEST}; "
                              f"restore it from the repository, or remove its entry and the "
                              f"entries after it")
        with np.load(path) as part:
            tokens = torch.from_numpy(part["tokens"].astype(np.int64))
            lengths = part["lengths"].tolist()
            out.prompt_lens += part["prompt_lens"].tolist()
            out.kinds += part["kinds"].tolist()
        out.tokens += list(tokens.split(lengths))
    return out, manifest


def count(folder: str | pathlib.Path) -> int:
    """How many sequences a head-data folder holds (its manifest's count)."""
    folder = pathlib.Path(folder).expanduser()
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(f"train_head.sequences={str(folder)!r} holds no head data ({MANIFEST} "
                          f"is missing); write some with `specflow head-data "
                          f"head_data.folder={folder}`")
    return sum(p["sequences"] for p in manifest["parts"])


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- writing ----------------------------------------------------------------------------------

def target_identity(target) -> dict:
    """What says which target wrote a folder: the model's file (the GGUF file it was converted
    from, or its folder: name and bytes) and its vocabulary."""
    gguf = getattr(target, "gguf_file", lambda: None)()
    path = pathlib.Path(gguf or str(target.path))
    size = path.stat().st_size if path.is_file() else sum(
        p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else None
    return {"file": path.name, "bytes": size, "vocab_size": int(target.vocab_size)}


def writing_settings(cfg, hd: HeadDataConfig) -> dict:
    """What every part of a folder must share (the data is one distribution)."""
    from omegaconf import OmegaConf

    logits = cfg.get("logits")
    return {"prompt_tokens": hd.prompt_tokens, "new_tokens": hd.new_tokens,
            "logits": OmegaConf.to_container(logits, resolve=True) if logits else {},
            "workload": "stdlib", "stdlib_chars": 600}


def check_same(folder: pathlib.Path, manifest: dict, target: dict, settings: dict) -> None:
    diffs = [f"{k}={manifest['target'].get(k)!r} there, {v!r} now" for k, v in target.items()
             if k != "bytes" and manifest["target"].get(k) != v]
    diffs += [f"{k}={manifest['settings'].get(k)!r} there, {v!r} now"
              for k, v in settings.items() if manifest["settings"].get(k) != v]
    if diffs:
        raise ConfigError(f"head_data.folder={str(folder)!r} was written with another target or "
                          f"settings ({'; '.join(diffs)}); grow it with those, or pick another "
                          f"folder")


def write_part(folder: pathlib.Path, index: int, rows: list[tuple[list[int], int, int]],
               vocab: int) -> dict:
    """part-NNNN.npz from (ids, prompt length, kind) rows -> its manifest entry."""
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    flat = np.asarray([t for ids, _, _ in rows for t in ids], dtype=dtype)
    name = f"part-{index:04d}.npz"
    tmp = folder / (name + ".tmp.npz")
    np.savez_compressed(tmp, tokens=flat,
                        lengths=np.asarray([len(ids) for ids, _, _ in rows], dtype=np.int32),
                        prompt_lens=np.asarray([n for _, n, _ in rows], dtype=np.int32),
                        kinds=np.asarray([k for _, _, k in rows], dtype=np.uint8))
    tmp.replace(folder / name)
    return {"file": name, "sequences": len(rows), "tokens": int(flat.size),
            "generated": int(sum(len(ids) - n for ids, n, _ in rows)),
            "chat": int(sum(k == 1 for _, _, k in rows)),
            "user": int(sum(k == 2 for _, _, k in rows)), "sha256": _digest(folder / name)}


def grow(cfg, progress) -> dict:
    """`specflow head-data`: add head_data.sequences sequences to the folder. -> the manifest."""
    from omegaconf import OmegaConf

    from specflow.io import atomic_write_json

    hd = HeadDataConfig(**OmegaConf.to_container(cfg.head_data, resolve=True))
    folder = pathlib.Path(hd.folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(folder)
    pipe = _pipeline(cfg, hd.generate_batch)
    templated = getattr(getattr(pipe.tokenizer, "tok", pipe.tokenizer), "chat_template", None)
    if hd.user_prompts and not templated:
        raise ConfigError(f"head_data.user_prompts={hd.user_prompts!r} needs a target with a "
                          f"chat template (an instruction-tuned model) to answer user turns; "
                          f"this tokenizer has none: drop head_data.user_prompts")
    if hd.chat_share > 0 and not hd.user_prompts and not templated:
        raise ConfigError(f"head_data.chat_share={hd.chat_share} needs a target with a chat "
                          f"template (an instruction-tuned model) to write user turns; this "
                          f"tokenizer has none: set head_data.chat_share=0 (code only)")
    people = _user_prompts(hd.user_prompts, pipe.tokenizer) if hd.user_prompts else None
    identity = target_identity(pipe.target)
    settings = writing_settings(cfg, hd)
    if manifest is None:
        manifest = {"format": FORMAT, "target": identity, "settings": settings, "parts": [],
                    "next_code_prompt": 0, "next_chat_draw": 0, "prompts": [0, 0]}
    else:
        check_same(folder, manifest, identity, settings)
    seen = {tuple(t[:n].tolist()) for t, n in zip(*_prompts_of(folder, manifest))}
    note = getattr(progress, "note", lambda text: None)
    if manifest["parts"]:
        note(f"growing {folder}: {sum(p['sequences'] for p in manifest['parts'])} sequences in "
             f"{len(manifest['parts'])} parts")
    adv = progress("target writes sequences", hd.sequences)
    added = 0
    sampler = None                # the user turns' sampling pipeline, made once it is needed
    try:
        while added < hd.sequences:
            n = min(PART_SEQUENCES, hd.sequences - added)
            if people is not None:          # turns people wrote, those not in the folder yet
                prompts = [(text, 2) for text in _unseen(people, seen, n, pipe.tokenizer)]
                if not prompts:
                    note(f"every turn of {hd.user_prompts} is in {folder} already")
                    break
            else:
                code, chat = manifest["prompts"]      # the share holds over the folder, however
                n_chat = round((code + chat + n) * hd.chat_share) - chat  # its runs were cut
                n_chat = min(max(n_chat, 0), n)
                prompts = _code_prompts(pipe.tokenizer, manifest, hd, n - n_chat, seen)
                if n_chat and sampler is None:
                    sampler = _pipeline(cfg, hd.generate_batch, sampling=True)
                prompts += _chat_prompts(sampler, pipe.tokenizer, manifest, hd, n_chat, seen)
                manifest["prompts"] = [code + n - n_chat, chat + n_chat]
            rows = _written(pipe, prompts, hd.new_tokens, lambda: adv(1))
            entry = write_part(folder, len(manifest["parts"]), rows, pipe.target.vocab_size)
            manifest["parts"].append(entry)
            atomic_write_json(folder / MANIFEST, manifest)
            added += n
    finally:
        del sampler
        gc.collect()
    return manifest


def _pipeline(cfg, batch: int, sampling: bool = False):
    from omegaconf import OmegaConf, open_dict

    from specflow.pipeline import Pipeline
    from specflow.training import user_turns

    run_cfg = cfg.copy()
    with open_dict(run_cfg):
        run_cfg.proposer = OmegaConf.create({"name": "none"})
        run_cfg.policy = OmegaConf.create({"name": "static", "k": 0})
        run_cfg.max_batch_size = batch
    return Pipeline(user_turns.sampling_config(run_cfg) if sampling else run_cfg)


def _prompts_of(folder: pathlib.Path, manifest: dict):
    if not manifest["parts"]:
        return [], []
    seqs, _ = read(folder)
    return seqs.tokens, seqs.prompt_lens


def _code_prompts(tokenizer, manifest: dict, hd: HeadDataConfig, count: int,
                  seen: set) -> list[tuple[str, int]]:
    """`count` stdlib prompts from where the folder stopped, cut to prompt_tokens, none seen
    before -> (prompt, kind 0); moves manifest['next_code_prompt'] past those taken."""
    from specflow.experiments.stdlib_corpus import StdlibWorkload, StdlibWorkloadConfig

    if count == 0:
        return []
    at = manifest["next_code_prompt"]
    pool = StdlibWorkload(StdlibWorkloadConfig(limit=at + 8 * count + 64)).prompts()
    out = []
    while len(out) < count and at < len(pool):
        ids = tokenizer.encode(pool[at])[:hd.prompt_tokens]
        at += 1
        text = tokenizer.decode(ids)
        key = tuple(tokenizer.encode(text))
        if text.strip() and key not in seen:
            seen.add(key)
            out.append((text, 0))
    if len(out) < count:
        raise ConfigError(f"the stdlib workload has no more distinct prompts ({at} used); "
                          f"raise head_data.chat_share to add chat sequences instead")
    manifest["next_code_prompt"] = at
    return out


def _chat_prompts(sampler, tokenizer, manifest: dict, hd: HeadDataConfig, count: int,
                  seen: set) -> list[tuple[str, int]]:
    """`count` user turns the target writes in the sampling pipeline (draws continuing the
    folder's), through its chat template, none seen before -> (prompt, kind 1)."""
    from specflow.experiments.workloads import apply_chat_template
    from specflow.training import user_turns

    out: list[tuple[str, int]] = []
    while len(out) < count:
        turns, manifest["next_chat_draw"] = user_turns.draw_user_turns(
            sampler, count - len(out), hd.seed, lambda n=1: None, manifest["next_chat_draw"])
        texts = iter(apply_chat_template(turns, tokenizer, "on"))
        out += [(text, 1) for text in _unseen(texts, seen, count - len(out), tokenizer)]
        if not turns:
            break
    return out


def _user_prompts(path: str, tokenizer):
    """The turns of a prompt file through the target's chat template, in file order (an
    iterator: a run takes what it needs, part by part)."""
    from specflow.experiments.workloads import apply_chat_template, read_prompt_file

    return iter(apply_chat_template(read_prompt_file(path, "prompt"), tokenizer, "on"))


def _unseen(texts, seen: set, count: int, tokenizer) -> list[str]:
    """Up to `count` of `texts` (an iterator, advanced) whose tokens are not in `seen` (added)."""
    out = []
    for text in texts:
        key = tuple(tokenizer.encode(text))
        if key not in seen:
            seen.add(key)
            out.append(text)
            if len(out) == count:
                break
    return out


def _written(pipe, prompts: list[tuple[str, int]], new_tokens: int,
             advance) -> list[tuple[list[int], int, int]]:
    """The target's greedy continuation of each prompt -> (prompt + continuation ids, prompt
    length, kind), in prompt order, sequences of 3 tokens or fewer left out."""
    from specflow.training import data

    ids, lens, _ = data.continuations(pipe, [p for p, _ in prompts], new_tokens, advance)
    # the prompts are distinct (`seen`), so a kept row's prompt ids name its kind (continuations
    # leaves out rows of 3 tokens or fewer)
    kind_of = {tuple(pipe.tokenizer.encode(p)): kind for p, kind in prompts}
    return [(seq, n, kind_of[tuple(seq[:n])]) for seq, n in zip(ids, lens)]


# --- the states, recomputed ---------------------------------------------------------------------

@torch.inference_mode()
def prefilled_states(target, seqs: IdSequences, layer_ids: list[int], batch: int,
                     advance) -> list[torch.Tensor]:
    """Each sequence's states [T_i - 1, (k+1)E] (float16, host): the inputs of `layer_ids` and
    the final normed state at every position but the last (the positions decoding fed), from
    one prefill of the whole sequence, `batch` sequences per round on the target's slots 0..
    batch-1 (released after each round)."""
    layers = (*layer_ids, target.num_layers)
    out: list[torch.Tensor] = []
    for at in range(0, len(seqs), batch):
        chunk = [t[:-1].tolist() for t in seqs.tokens[at:at + batch]]
        slots = list(range(len(chunk)))
        try:
            states = target.prefill_many(slots, chunk, hidden_layers=layers)
        finally:
            for s in slots:
                target.reset(s)
        mine: dict[int, torch.Tensor] = {}
        for st in states:
            hidden = st.select(layers).half()                                   # [B, T, (k+1)E]
            for b, (slot, n) in enumerate(zip(st.slots, st.lens)):
                mine[slot] = hidden[b, :n].cpu()
        out += [mine[s] for s in slots]
        advance(len(chunk))
    return out
