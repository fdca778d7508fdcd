"""Train the embedded demo pair: a Llama-style target and a much smaller draft sharing one tokenizer.

Corpus: the Python standard library's own .py files (every machine has them offline), without test
packages. About 2% of the files (chosen by a stable hash of the path) are held out for benchmark
prompts and never trained on.

    python scripts/train_demo_pair.py --out specflow/weights/demo

Deterministic for a given seed, thread count and torch build. Writes, under --out:
    target/  draft/      config.json, model.safetensors (fp16), tokenizer files
    heldout.jsonl        held-out code prompts (path, text) for benchmarks and demos
    train_log.json       recipe, timings and losses (docs/models.md's model card quotes it)
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch
import torch.nn.functional as F

from specflow.experiments.stdlib_corpus import is_heldout, stdlib_files

EOS = "<|endoftext|>"

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS, unk_token=None, model_max_length=1024)


def make_model(layers: int, hidden: int, inter: int, heads: int, vocab: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        rope_theta=10000.0,
    )
    return LlamaForCausalLM(cfg)


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq] for s in starts.tolist()])  # [B, T]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model, data: torch.Tensor, seq: int, n: int = 16) -> float:
    model.eval()
    losses = []
    for i in range(n):
        s = i * (data.numel() - seq - 1) // n
        ids = data[s:s + seq][None]
        losses.append(model(ids, labels=ids).loss.item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def greedy_agreement(target, draft, data: torch.Tensor, seq: int, n: int = 16) -> float:
    """Teacher-forced argmax agreement of draft and target on held-out text (a proxy for greedy α)."""
    target.eval()
    draft.eval()
    agree = total = 0
    for i in range(n):
        s = i * (data.numel() - seq - 1) // n
        ids = data[s:s + seq][None]
        a = target(ids).logits.argmax(-1)
        b = draft(ids).logits.argmax(-1)
        agree += (a == b).sum().item()
        total += a.numel()
    draft.train()
    return agree / total


def train(model, data, heldout, *, steps, batch, seq, lr, seed, teacher=None, log, name):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0 = time.perf_counter()
    for step, ids in enumerate(batches(data, steps, batch, seq, seed)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(200, steps // 10))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
            loss = out.loss
            if teacher is not None:
                # distil towards the target's own next-token distribution: acceptance is
                # min(1, p/q) summed, so matching p (not only the data) is what raises α
                with torch.no_grad():
                    p_logits = teacher(ids).logits.float()
                kl = F.kl_div(F.log_softmax(out.logits.float(), -1), F.log_softmax(p_logits, -1),
                              log_target=True, reduction="batchmean") / ids.shape[1]
                loss = 0.3 * loss + 0.7 * kl
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - t0
            print(f"[{name}] step {step}/{steps} loss {loss.item():.3f} {elapsed:.0f}s", flush=True)
    elapsed = time.perf_counter() - t0
    log[name] = {"steps": steps, "batch": batch, "seq": seq, "lr": lr, "train_seconds": round(elapsed),
                 "tokens_seen": steps * batch * seq,
                 "heldout_loss": round(heldout_loss(model, heldout, seq), 3)}
    print(f"[{name}] done: {log[name]}", flush=True)


def save(model, tokenizer, path: pathlib.Path):
    path.mkdir(parents=True, exist_ok=True)
    model.eval()
    # shards under 16 MB keep every tracked file small; from_pretrained joins them
    model.to(torch.float16).save_pretrained(path, safe_serialization=True, max_shard_size="16MB")
    tokenizer.save_pretrained(path)
    model.to(torch.float32)


def write_prompts(held: list[tuple[str, str]], tokenizer, path: pathlib.Path, n: int = 40,
                  seed: int = 0) -> None:
    """Held-out code prompts of 100-200 tokens, each ending after a `def ...:` line (the model
    writes the body): the demo's `workload=code` and the benchmark's prompts."""
    import random

    rng = random.Random(seed)
    candidates = []
    for rel, text in held:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("def ") or not line.rstrip().endswith(":"):
                continue
            start_line = i
            while start_line > 0:
                chunk = "".join(lines[start_line - 1:i + 1])
                if len(tokenizer(chunk)["input_ids"]) > 200:
                    break
                start_line -= 1
            prompt = "".join(lines[start_line:i + 1])
            n_tok = len(tokenizer(prompt)["input_ids"])
            if 100 <= n_tok <= 200:
                candidates.append({"path": rel, "line": i + 1, "tokens": n_tok, "prompt": prompt})
    rng.shuffle(candidates)
    seen, chosen = set(), []
    for c in candidates:      # spread over files
        if c["path"] in seen and len(seen) < len({c["path"] for c in candidates}):
            continue
        seen.add(c["path"])
        chosen.append(c)
        if len(chosen) == n:
            break
    with open(path, "w") as fh:
        for c in chosen:
            fh.write(json.dumps(c) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="specflow/weights/demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--target-steps", type=int, default=1200)
    ap.add_argument("--draft-steps", type=int, default=1000)
    ap.add_argument("--prompts-only", action="store_true",
                    help="only (re)write prompts.jsonl from an existing --out folder")
    args = ap.parse_args()
    if args.prompts_only:
        from transformers import AutoTokenizer
        out = pathlib.Path(args.out)
        tok = AutoTokenizer.from_pretrained(out / "target")
        held = [(r["path"], r["text"]) for r in map(json.loads, open(out / "heldout.jsonl"))]
        write_prompts(held, tok, out / "prompts.jsonl")
        return
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    log: dict = {"seed": args.seed, "threads": args.threads, "torch": torch.__version__}

    files = stdlib_files()
    texts = {rel: p.read_text(encoding="utf-8", errors="replace") for rel, p in files}
    train_texts = [t for rel, t in texts.items() if not is_heldout(rel)]
    held = [(rel, t) for rel, t in texts.items() if is_heldout(rel)]
    log["corpus"] = {"files": len(files), "train_files": len(train_texts), "heldout_files": len(held),
                     "mb": round(sum(len(t.encode()) for t in texts.values()) / 1e6, 1)}

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, args.vocab)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    log["tokenizer_seconds"] = round(time.perf_counter() - t0, 1)

    def encode_all(docs: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for doc in docs:
            ids.extend(tokenizer(doc)["input_ids"])
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.long)

    data = encode_all(train_texts)
    heldout = encode_all([t for _, t in held])
    log["corpus"].update(train_tokens=data.numel(), heldout_tokens=heldout.numel())
    print(f"corpus {log['corpus']}", flush=True)

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "heldout.jsonl", "w") as fh:
        for rel, t in held:
            fh.write(json.dumps({"path": rel, "text": t}) + "\n")
    write_prompts(held, tokenizer, out / "prompts.jsonl")

    target = make_model(4, 512, 1408, 8, len(tokenizer), eos_id)
    train(target, data, heldout, steps=args.target_steps, batch=8, seq=512, lr=1.5e-3,
          seed=args.seed + 1, log=log, name="target")
    save(target, tokenizer, out / "target")
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    draft = make_model(2, 128, 384, 4, len(tokenizer), eos_id)
    train(draft, data, heldout, steps=args.draft_steps, batch=8, seq=512, lr=3e-3,
          seed=args.seed + 2, teacher=target, log=log, name="draft")
    log["greedy_agreement_teacher_forced"] = round(greedy_agreement(target, draft, heldout, 512), 3)
    save(draft, tokenizer, out / "draft")
    for name, m in (("target", target), ("draft", draft)):
        log[name]["params"] = sum(p.numel() for p in m.parameters())
        log[name]["config"] = {k: getattr(m.config, k) for k in
                               ("num_hidden_layers", "hidden_size", "intermediate_size",
                                "num_attention_heads", "vocab_size")}
    (out / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log, indent=2))


if __name__ == "__main__":
    main()
