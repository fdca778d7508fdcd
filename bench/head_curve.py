"""`make head-curve`: a draft head's held-out acceptance against the data it was trained on.

Every head is scored on the same held-out sequences: every 20th sequence of a head-data folder
(`specflow head-data`; train-head never trains on them when it learns from the folder), with
their states recomputed by one float32 prefill. Greedy: at every generated position, how many
consecutive drafts of k = 4 equal the target's own next tokens (the figure train-head prints,
loop.heldout_acceptance), τ = 1 + that mean. Each head's training positions come from its
config.json (`specflow.train_positions`). Writes bench/results/head_curve.{json,md} and a PNG
(τ against training positions, log scale) for the head's card in docs/heads.md.

    python bench/head_curve.py --folder head_data/smollm2 --head shipped=specflow/weights/smollm2/eagle \
        --head 1.2M=build/smollm2-head
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specflow import Pipeline  # noqa: E402
from specflow.console import console  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402


def heldout_sequences(pipe, folder: str, layer_ids: list[int], batch: int):
    """The folder's held-out sequences with float32 states at `layer_ids`. -> data.Sequences"""
    from specflow.training import data, head_data

    ids, _ = head_data.read(folder)
    keep = [i for i, h in enumerate(ids.heldout()) if h and len(ids.tokens[i]) > 3]
    held = head_data.IdSequences([ids.tokens[i] for i in keep], [ids.prompt_lens[i] for i in keep],
                                 [ids.kinds[i] for i in keep])
    states = head_data.prefilled_states(pipe.target, held, layer_ids, batch, lambda n: None)
    seqs = data.recorded_sequences([t[:-1].tolist() for t in held.tokens], held.prompt_lens,
                                   states, len(layer_ids))
    return seqs, held.kinds


def total_steps(made: dict) -> int | None:
    """A head's optimiser steps, with those of the heads it went on from (train_head.init: the
    card records each one's recipe in turn)."""
    own = (made.get("recipe") or {}).get("steps")
    before = total_steps(made["init"]) if made.get("init") else 0
    return None if own is None or before is None else own + before


HELD: dict = {}         # (folder, layer ids) -> held-out sequences: heads reading the same layers share them


def score(pipe, head_path: str, folder: str, k: int, batch: int) -> dict:
    from specflow.backends.heads.eagle import load_head
    from specflow.training import data, loop

    target = pipe.target
    head = load_head(head_path, target, torch.device("cpu"), torch.float32)
    key = (folder, tuple(head.shape.layer_ids))
    if key not in HELD:
        HELD[key] = heldout_sequences(pipe, folder, list(key[1]), batch)
    seqs, kinds = HELD[key]
    lm = target.output_head().detach().float()[head.draft_ids]                     # [Vd, E]
    out = {}
    for name, pick in (("all", None), ("code", 0), ("chat", 1)):
        rows = [i for i, kind in enumerate(kinds) if pick is None or kind == pick]
        if not rows:
            continue
        part = data.Sequences([seqs.tokens[i] for i in rows], [seqs.states[i] for i in rows],
                          [seqs.finals[i] for i in rows], [seqs.prompt_lens[i] for i in rows])
        fig = loop.heldout_acceptance(head, loop.Windows(part, lm, 256, k), k)
        out[name] = {"tau": round(fig["tau"], 3), "positions": fig["positions"],
                     "acceptance_by_step": [round(a, 3) for a in fig["acceptance_by_step"]]}
    config = json.loads((pathlib.Path(head_path) / "config.json").read_text())
    out["train_positions"] = (config.get("specflow") or {}).get("train_positions")
    out["steps"] = total_steps(config.get("specflow") or {})
    # the precision of the run that finished it (train_head.precision; float32 before it existed)
    out["precision"] = (config.get("specflow") or {}).get("precision", "float32")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--folder", default="head_data/smollm2")
    ap.add_argument("--head", action="append", required=True, help="label=path")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "head_curve"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "heads-smollm2-curve.png"))
    args = ap.parse_args()
    pipe = Pipeline.from_config([f"model={args.model}", "dtype=float32", "proposer=none",
                                 "show_progress=false", f"threads={args.threads}",
                                 f"max_batch_size={args.batch}"])
    rows = {}
    for spec in args.head:
        label, path = spec.split("=", 1)
        console.print(f"[dim]scoring {label} ({path})[/]")
        rows[label] = {"path": path, **score(pipe, path, args.folder, args.k, args.batch)}
    atomic_write_json(pathlib.Path(args.out + ".json"), {"folder": args.folder, "k": args.k,
                                                         "heads": rows})
    lines = ["| head | training positions | held-out τ at k = 4 | code | chat | "
             "acceptance by step |", "|---|---:|---:|---:|---:|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['train_positions']:,} | {r['all']['tau']:.2f} | "
                     f"{r.get('code', {}).get('tau', float('nan')):.2f} | "
                     f"{r.get('chat', {}).get('tau', float('nan')):.2f} | "
                     f"{r['all']['acceptance_by_step']} |")
    held = next(iter(rows.values()))["all"]["positions"]
    atomic_write_text(pathlib.Path(args.out + ".md"),
                      f"Held-out: every 20th sequence of `{args.folder}` ({held} generated "
                      f"positions), greedy, k = {args.k}; `python bench/head_curve.py`.\n\n"
                      + "\n".join(lines) + "\n")
    console.print("\n".join(lines))
    plot(rows, args.png)


def plot(rows: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    by_steps: dict = {}                  # one line per number of training steps and precision
    for label, r in rows.items():
        key = (r.get("steps") or 0, r.get("precision", "float32"))
        by_steps.setdefault(key, []).append((r["train_positions"], r["all"]["tau"], label))
    for i, ((steps, precision), pts) in enumerate(sorted(by_steps.items())):
        pts.sort()
        name = f"{steps} steps" if steps else "steps not recorded"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if precision == "float32" else "s--",
                color=f"C{i}", label=name if precision == "float32" else f"{name}, {precision}")
        for n, (x, y, label) in enumerate(pts):
            ax.annotate(label, (x, y), textcoords="offset points", fontsize=7,
                        xytext=(-10, 8 if n % 2 else -13))
    ax.set_xscale("log")
    ax.margins(x=0.3, y=0.15)
    ax.set_xlabel("training positions (target-written tokens)")
    ax.set_ylabel("held-out greedy τ at k = 4")
    ax.axhline(3.0, color="gray", ls=":", lw=1)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("SmolLM2 EAGLE-3 head: acceptance against data and steps")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
