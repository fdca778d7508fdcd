"""Token trees on the embedded demo pair: static and goodput-sized chains and trees.

    python bench/trees.py [--prompts 12] [--new-tokens 128] [--threads 2] [--batch 1]
                          [--proposer draft|eagle]

Greedy, held-out code prompts, `--batch` of them generated together (max_batch_size), arms
interleaved batch by batch (machine drift hits every arm alike). Per arm: tokens/s, ratio to the
static chain, tau (tokens per round), nodes scored per round, milliseconds per round by stage,
and whether the output equals plain decoding's. Writes bench/results/trees.{json,md}
(trees_eagle for the head, _b<batch> for a batch above 1).
"""
from __future__ import annotations

import argparse
import pathlib
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

TREE = ["proposer.topk=4", "proposer.num_draft_tokens=16"]
BASELINE = "chain k=4"


def arms(proposer: str) -> dict[str, list[str]]:
    p = f"proposer={proposer}"
    return {
        "none": ["proposer=none"],
        "chain k=4": [p, "proposer.k=4"],
        "chain goodput": [p, "proposer.k=8", "policy=goodput"],
        "tree 4x16 k=4": [p, "proposer.k=4", *TREE],
        "tree goodput": [p, "proposer.k=8", *TREE, "policy=goodput"],
    }


def main() -> None:
    retime_unless_told()     # choices kept from a busy machine would distort the arms
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--proposer", default="draft", choices=["draft", "eagle"],
                    help="the demo draft model, or the demo EAGLE-3 head")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"), "prompt")[: args.prompts]
    base = ["model=demo", "draft=demo", f"threads={args.threads}", f"max_batch_size={args.batch}"]
    ARMS = arms(args.proposer)
    pipes = {name: Pipeline.from_config([*base, *arm]) for name, arm in ARMS.items()}
    for pipe in pipes.values():                                    # warm-up
        pipe.generate([prompts[0][:200]], max_new_tokens=32)
    runs = {name: {"tokens": 0, "seconds": 0.0, "stats": [], "outputs": []} for name in ARMS}
    with console.status("") as status:
        for i in range(0, len(prompts), args.batch):
            chunk = prompts[i:i + args.batch]
            for name, pipe in pipes.items():
                status.update(f"prompts {i + 1}-{i + len(chunk)}/{len(prompts)}: {name}")
                start = time.perf_counter()
                results = pipe.generate(chunk, max_new_tokens=args.new_tokens)
                run = runs[name]
                run["seconds"] += time.perf_counter() - start
                for result in results:
                    run["tokens"] += len(result.token_ids)
                    run["stats"].append(result.stats)
                    run["outputs"].append(result.token_ids)
    rows = []
    for name, run in runs.items():
        rounds = sum(s["num_rounds"] for s in run["stats"])
        stages: dict[str, float] = {}
        for s in run["stats"]:
            for stage, v in s["seconds"].items():
                stages[stage] = stages.get(stage, 0.0) + v
        rows.append({
            "arm": name, "overrides": ARMS[name],
            "tokens_per_second": run["tokens"] / run["seconds"],
            "tau": sum(s["num_drawn_tokens"] for s in run["stats"]) / rounds,
            "nodes_per_round": sum(s["num_draft_tokens"] for s in run["stats"]) / rounds,
            "ms_per_round": {k: 1000 * v / rounds for k, v in stages.items()},
            "identical_outputs": sum(a == b for a, b in zip(run["outputs"],
                                                            runs["none"]["outputs"])),
        })
    ref = next(r["tokens_per_second"] for r in rows if r["arm"] == BASELINE)
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                    if k != "out" and v != ap.get_default(k))
    lines = [f"# Token trees at batch {args.batch} (`python bench/trees.py{flags}`)", "",
             f"Demo pair (proposer={args.proposer}), {len(prompts)} held-out prompts x "
             f"{args.new_tokens} tokens, greedy, "
             f"{args.threads} threads, arms interleaved per prompt.", "",
             "| arm | tokens/s | vs chain k=4 | tau | nodes/round | draft ms | target ms | "
             "verify ms | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r["ms_per_round"]
        lines.append(f"| {r['arm']} | {r['tokens_per_second']:.1f} | "
                     f"{r['tokens_per_second'] / ref:.2f}x | {r['tau']:.2f} | "
                     f"{r['nodes_per_round']:.2f} | {ms.get('propose', 0):.2f} | "
                     f"{ms.get('target', 0):.2f} | {ms.get('verify', 0):.2f} | "
                     f"{r['identical_outputs']}/{len(prompts)} |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "trees" + ("" if args.proposer == "draft" else f"_{args.proposer}") \
        + ("" if args.batch == 1 else f"_b{args.batch}")
    atomic_write_json(out / f"{stem}.json", {"rows": rows, "prompts": len(prompts),
                                             "new_tokens": args.new_tokens,
                                             "threads": args.threads, "batch": args.batch,
                                             "proposer": args.proposer})
    atomic_write_text(out / f"{stem}.md", "\n".join(lines) + "\n")
    console.print("\n".join(lines))


if __name__ == "__main__":
    main()
