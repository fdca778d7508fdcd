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
    from specflow.training import data, head_data, loop

    target = pipe.target
    head = load_head(head_path, target, torch.device("cpu"), torch.float32)
    key = (folder, tuple(head.shape.layer_ids))
    if key not in HELD:
        HELD[key] = heldout_sequences(pipe, folder, list(key[1]), batch)
    seqs, kinds = HELD[key]
    lm = target.output_head().detach().float()[head.draft_ids]                     # [Vd, E]
    out = {}
    for name, pick in (("all", None), *((kind, i) for i, kind in enumerate(head_data.KINDS))):
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
    ap.add_argument("--head", action="append", default=[], help="label=path")
    ap.add_argument("--from", dest="scored", default=None,
                    help="a JSON this script wrote: write its table and plot again, scoring nothing")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "head_curve"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "heads-smollm2-curve.png"))
    args = ap.parse_args()
    if args.scored:
        saved = json.loads(pathlib.Path(args.scored).read_text())
        write(saved["heads"], saved["folder"], saved["k"], args.out, args.png)
        return
    if not args.head:
        ap.error("give --head label=path (or --from a scored JSON)")
    pipe = Pipeline.from_config([f"model={args.model}", "dtype=float32", "proposer=none",
                                 "show_progress=false", f"threads={args.threads}",
                                 f"max_batch_size={args.batch}"])
    rows = {}
    for spec in args.head:
        label, path = spec.split("=", 1)
        console.print(f"[dim]scoring {label} ({path})[/]")
        rows[label] = {"path": path, **score(pipe, path, args.folder, args.k, args.batch)}
    write(rows, args.folder, args.k, args.out, args.png)


def write(rows: dict, folder: str, k: int, out: str, png: str) -> None:
    """The scores as JSON, a markdown table and the plot."""
    atomic_write_json(pathlib.Path(out + ".json"), {"folder": folder, "k": k, "heads": rows})
    kinds = ["code", "chat"] + (["user"] if any("user" in r for r in rows.values()) else [])
    lines = ["| head | training positions | held-out τ at k = 4 | " + " | ".join(kinds)
             + " | acceptance by step |", "|---|---:|---:|" + "---:|" * len(kinds) + "---|"]
    for label, r in rows.items():
        taus = " | ".join(f"{r.get(kind, {}).get('tau', float('nan')):.2f}" for kind in kinds)
        lines.append(f"| {label} | {r['train_positions']:,} | {r['all']['tau']:.2f} | {taus} | "
                     f"{r['all']['acceptance_by_step']} |")
    held = next(iter(rows.values()))["all"]["positions"]
    atomic_write_text(pathlib.Path(out + ".md"),
                      f"Held-out: every 20th sequence of `{folder}` ({held} generated "
                      f"positions), greedy, k = {k}; `python bench/head_curve.py`.\n\n"
                      + "\n".join(lines) + "\n")
    console.print("\n".join(lines))
    plot(rows, png)


def plot(rows: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    heads = list(rows.items())             # in the order given: each round after the one before
    xs = [r["train_positions"] for _, r in heads]
    for kind, style, name in (("all", dict(fmt="o-", color="C0", lw=1.8, ms=6), "all held-out"),
                              ("code", dict(fmt="^--", color="C2", lw=1, ms=4), "code"),
                              ("chat", dict(fmt="v--", color="C3", lw=1, ms=4), "chat"),
                              ("user", dict(fmt="s--", color="C1", lw=1, ms=4),
                               "turns people wrote")):
        ys = [r.get(kind, {}).get("tau") for _, r in heads]
        if None not in ys:
            ax.plot(xs, ys, style.pop("fmt"), label=name, **style)
    seen: dict = {}
    names = []
    for n, (label, r) in enumerate(heads, 1):  # each overall point numbered, named in a key
        x, y = r["train_positions"], r["all"]["tau"]
        twice = seen.get(x, 0)                     # heads on the same data: numbers side by side
        seen[x] = twice + 1
        ax.annotate(str(n), (x, y), textcoords="offset points", fontsize=8, ha="center",
                    xytext=(10 + 9 * twice, -12))
        steps = f" ({r['steps']} steps in all)" if r.get("steps") else ""
        names.append(f"{n}: {label}{steps}")
    ax.text(0.01, 0.99, "\n".join(names), transform=ax.transAxes, fontsize=7, va="top")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:.2g}M"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_xticks(sorted(set(xs)))
    ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
    low, high = ax.get_ylim()
    ax.set_ylim(low, high + (high - low) * 0.12 * len(heads))       # room for the key
    ax.set_xlabel("training positions (target-written tokens)")
    ax.set_ylabel("held-out greedy τ at k = 4")
    ax.axhline(3.0, color="gray", ls=":", lw=1)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("SmolLM2 EAGLE-3 head: acceptance against data and steps")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main()
