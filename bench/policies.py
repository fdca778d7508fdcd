"""`make bench-policies`: the policies on the demo pair, on a code/chat traffic mix, wall clock.

Held-out code prompts (high acceptance) and MT-Bench questions (chat, low acceptance for a code
model) are interleaved and run with continuous batching (max_batch_size 8). Every arm decodes the
same requests twice, in alternating order across arms, and reports the median throughput.
Writes bench/results/policies.{json,md}.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specflow import Pipeline  # noqa: E402
from specflow.console import console  # noqa: E402
from specflow.experiments.workloads import read_prompt_file  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402
from specflow.backends.hf.backend import DEMO_DIR  # noqa: E402
from specflow.backends.choice_cache import retime_unless_told  # noqa: E402

ARMS = {
    "static k=0": ["proposer=none"],
    "static k=2": ["policy=static", "policy.k=2"],
    "static k=4": ["policy=static", "policy.k=4"],
    "static k=6": ["policy=static", "policy.k=6"],
    "adaptive": ["policy=adaptive", "policy.k_max=8"],
    "heuristic": ["policy=heuristic", "policy.k_max=8"],
    "goodput": ["policy=goodput"],
}


def main() -> None:
    retime_unless_told()     # choices kept from a busy machine would distort the arms
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    code = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"))
    chat = read_prompt_file(str(ROOT / "specflow/data/mt_bench_subset.jsonl"))
    prompts = [(code if i % 2 == 0 else chat)[i // 2 % 20] for i in range(args.requests)]
    kinds = ["code" if i % 2 == 0 else "chat" for i in range(args.requests)]
    pipes = {name: Pipeline.from_config([*o, f"max_batch_size={args.batch}"])
             for name, o in ARMS.items()}
    for pipe in pipes.values():                                   # warm-up
        pipe.generate(prompts[:2], max_new_tokens=8)
    speeds: dict[str, list[float]] = {n: [] for n in ARMS}
    detail: dict[str, dict] = {}
    for rep in range(2):
        for name in (list(ARMS) if rep == 0 else list(reversed(ARMS))):
            pipe = pipes[name]
            t = time.perf_counter()
            results = pipe.generate(prompts, max_new_tokens=args.new_tokens)
            secs = time.perf_counter() - t
            speeds[name].append(sum(len(r.token_ids) for r in results) / secs)
            k = {kind: [r.stats["num_draft_tokens"] / max(r.stats["num_rounds"], 1)
                        for r, kk in zip(results, kinds) if kk == kind] for kind in ("code", "chat")}
            detail[name] = {"alpha": pipe.last_stats["alpha"],
                            **{f"k_{kind}": statistics.mean(v) for kind, v in k.items()}}
            console.print(f"[dim]{name}: {speeds[name][-1]:.0f} tokens/s[/]")
    best_static = max(statistics.median(speeds[n]) for n in ARMS if n.startswith("static"))
    rows = [{"arm": n, "tokens_per_s": statistics.median(speeds[n]),
             "vs_best_static": statistics.median(speeds[n]) / best_static, **detail[n]}
            for n in ARMS]
    lines = [f"Demo pair, CPU, {args.threads} threads; {args.requests} requests (code and MT-Bench "
             f"chat interleaved), {args.new_tokens} new tokens, greedy, max_batch_size "
             f"{args.batch}; median of 2 runs per arm, alternating order.", "",
             "| arm | tokens/s | vs best static | α | mean k code | mean k chat |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:.1f} | {r['vs_best_static']:.3f} | "
                     f"{r['alpha']:.2f} | {r['k_code']:.2f} | {r['k_chat']:.2f} |")
    md = "\n".join(lines) + "\n"
    out = ROOT / "bench/results"
    atomic_write_json(out / "policies.json", {"args": vars(args), "rows": rows})
    atomic_write_text(out / "policies.md", md)
    console.print(md, markup=False, highlight=False)


if __name__ == "__main__":
    main()
