"""`make bench` (first part): what one forward pass costs, against what reading the weights costs.

Speculative decoding pays because scoring k+1 positions costs about as much as scoring one: a
decoding pass is bound by reading the weights (and the KV cache), not by arithmetic. For the target
and the draft this times one forward through specflow's backend (the forward `model.forward`
picks, default `auto`) at 1..9 query positions x contexts 64/256/512/1000 x batch 1 and 8, and
prints each figure beside its bandwidth bound:

    bound = (weight bytes + batch x KV bytes read at that context) / measured read bandwidth

where the read bandwidth is the fastest of a few streaming reads of a buffer far larger than the
last-level cache (a sum, and a two-row product with a weight-sized matrix), measured before and
after the passes in the same run with the same threads (the fastest seen: a physical limit).
Also: resident memory (weights, what the lean forward prepared beyond them, the KV cache) and a
plot (pass cost against positions, one line per context).

    python bench/passcost.py                      # demo pair, fp32, 2 threads, CPU
    python bench/passcost.py --dtype bfloat16
    python bench/passcost.py --target DIR --draft DIR --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import re
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specflow.console import console  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402
from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig  # noqa: E402
from specflow.backends.lean.native_choice import choose_native  # noqa: E402
from specflow.backends.lean.packing import packable  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, dtype: torch.dtype, mbytes: int) -> tuple[float, str]:
    """Bytes per second of the fastest streaming read of an `mbytes` MB buffer, and which read."""
    elems = mbytes * (1 << 20) // 4
    buf = torch.ones(elems, device=device)                                    # fp32
    rows = 4096
    mat = torch.ones(rows, elems // rows, device=device, dtype=dtype)
    x = torch.ones(2, mat.shape[1], device=device, dtype=dtype)
    reads = {"sum": (lambda: buf.sum(), buf.numel() * 4),
             f"{dtype} two-row product": (lambda: mat @ x.T, mat.numel() * mat.element_size())}
    best, name = 0.0, ""
    for label, (fn, nbytes) in reads.items():
        fn()
        sync(device)
        for _ in range(5):
            start = time.perf_counter()
            fn()
            sync(device)
            rate = nbytes / (time.perf_counter() - start)
            if rate > best:
                best, name = rate, label
    return best, name


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        ptr = p.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += p.untyped_storage().nbytes()
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def resident_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pass_costs(backend: HFBackend, positions, contexts, batches, repeats, device, progress, task):
    """Median seconds of one forward of T positions per row after `ctx` cached tokens."""
    out = {}
    vocab = min(backend.vocab_size, 8000)
    gen = torch.Generator().manual_seed(0)
    for B in batches:
        slots = torch.arange(B)
        for s in range(B):
            backend.reset(s)
        top = max(contexts)
        backend.forward(slots, torch.randint(1, vocab, (B, top), generator=gen),
                        torch.full((B,), top), logits=False)                  # fill the cache once
        for ctx in contexts:
            for T in positions:
                ids = torch.randint(1, vocab, (B, T), generator=gen)
                lens = torch.full((B,), T)
                times = []
                for r in range(repeats + 3):
                    backend.truncate(slots, [ctx] * B)
                    sync(device)
                    start = time.perf_counter()
                    backend.forward(slots, ids, lens)
                    sync(device)
                    if r >= 3:                                                # warm-up dropped
                        times.append(time.perf_counter() - start)
                out[(B, ctx, T)] = statistics.median(times)
                progress.advance(task)
    return out


def measure(models: dict[str, str], dtype_name: str, forward: str, device: torch.device,
            positions: list[int], contexts: list[int], batches: list[int], repeats: int,
            bandwidth_mb: int = 0) -> tuple[list[dict], list[dict], float, str]:
    """Pass costs of each model ({role: path}) with their bounds, and memory.

    -> (rows, memory, read bandwidth in bytes/s, which read). The bound is a physical limit, so
    the bandwidth is the fastest read seen, before or after the passes.
    """
    from rich.progress import Progress

    dtype = getattr(torch, dtype_name)
    mbytes = bandwidth_mb or (4096 if device.type == "cuda" else 512)
    best = read_bandwidth(device, dtype, mbytes)
    rows, memory = [], []
    with Progress(console=console, transient=True) as progress:
        for role, path in models.items():
            # a context just past the longest timed: the cache is allocated at full capacity
            backend = HFBackend(HFModelConfig(path=str(path), dtype=dtype_name, forward=forward,
                                              max_model_len=max(contexts) + max(positions) + 64),
                                device, slots=max(batches))
            # the native pass where a pipeline would take it (native=auto, timed at its ends)
            choose_native("auto", backend, max(positions), max(batches))
            weights = weight_bytes(backend.model)
            per_token = kv_bytes_per_token(backend.model.config, dtype)
            # the target a speculating pipeline runs may pack its weights (pack=auto): both layouts
            layouts = [False] + ([True] if role == "target" and packable(backend) else [])
            for packed in layouts:
                name = f"{role}, packed" if packed else role
                if packed:
                    backend.lean.pack()
                task = progress.add_task(f"{name} passes",
                                         total=len(batches) * len(contexts) * len(positions))
                costs = pass_costs(backend, positions, contexts, batches, repeats, device, progress,
                                   task)
                for (B, ctx, T), secs in costs.items():
                    one = costs.get((B, ctx, 1))
                    rows.append({"model": name, "batch": B, "context": ctx, "positions": T,
                                 "ms": secs * 1e3, "bytes": weights + B * (ctx + T) * per_token,
                                 "vs_one_position": secs / one if one else None})
                kv = sum(t.numel() * t.element_size()
                         for t in backend.cache.keys + backend.cache.values if t is not None)
                lean = backend.lean
                memory.append({"model": name, "weights_mb": weights / 1e6,
                               "extra_mb": (lean.extra_bytes() if lean else 0) / 1e6,
                               "kv_mb": kv / 1e6, "resident_mb": resident_bytes(device) / 1e6,
                               "forward": "lean" if lean else "transformers",
                               "kernels": lean.kernels.describe() if lean else "F.linear",
                               "native_pass": (lean.native_pass_rows() if lean else None) or "-"})
            del backend
    bandwidth, how = max(best, read_bandwidth(device, dtype, mbytes))
    for r in rows:
        r["bound_ms"] = r.pop("bytes") / bandwidth * 1e3
        r["vs_bound"] = r["ms"] / r["bound_ms"]
    return rows, memory, bandwidth, how


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (model, batch) in zip(axes[0], panels):
        sel = [r for r in rows if r["model"] == model and r["batch"] == batch]
        for ctx in sorted({r["context"] for r in sel}):
            line = sorted((r["positions"], r["ms"]) for r in sel if r["context"] == ctx)
            ax.plot([p for p, _ in line], [m for _, m in line], marker="o", label=f"context {ctx}")
        bound = min(r["bound_ms"] for r in sel)
        ax.axhline(bound, color="grey", ls="--", lw=1, label="weight-read bound")
        ax.set_title(f"{model}, batch {batch}")
        ax.set_xlabel("query positions per row")
        ax.set_ylabel("ms per pass")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(env: dict, rows: list[dict], memory: list[dict], only: list | None = None) -> str:
    """Markdown tables; `only` = [(model, batch), ...] keeps those tables (docs/benchmarks.md's)."""
    if only is not None:
        rows = [r for r in rows if (r["model"], r["batch"]) in only]
    lines = [f"{env['device']}, {env['threads']} threads, torch {env['torch']}, {env['dtype']}; "
             f"read bandwidth {env['bandwidth_gbs']:.1f} GB/s ({env['bandwidth_read']}); "
             f"median of {env['repeats']} passes. Cells: ms per pass (x its bandwidth bound).", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        for batch in sorted({r["batch"] for r in rows if r["model"] == model}):
            sel = [r for r in rows if r["model"] == model and r["batch"] == batch]
            positions = sorted({r["positions"] for r in sel})
            lines += [f"**{model}, batch {batch}**", "",
                      "| context | " + " | ".join(f"{p} pos" for p in positions)
                      + " | 5 pos / 1 pos |",
                      "|---:|" + "---:|" * (len(positions) + 1)]
            for ctx in sorted({r["context"] for r in sel}):
                cells = {r["positions"]: r for r in sel if r["context"] == ctx}
                ratio = cells[5]["ms"] / cells[1]["ms"] if 5 in cells and 1 in cells else None
                lines.append(f"| {ctx} | " + " | ".join(
                    f"{cells[p]['ms']:.2f} ({cells[p]['vs_bound']:.2f}x)" for p in positions)
                    + f" | {'-' if ratio is None else f'{ratio:.2f}x'} |")
            lines.append("")
    lines += ["| model | weights MB | prepared beyond the weights MB | KV cache MB (allocated) | "
              "process resident MB | forward | kernels | native pass |",
              "|---|---:|---:|---:|---:|---|---|---|"]
    for m in memory:
        lines.append(f"| {m['model']} | {m['weights_mb']:.1f} | {m['extra_mb']:.1f} | "
                     f"{m['kv_mb']:.1f} | {m['resident_mb']:.0f} | {m['forward']} | {m['kernels']} "
                     f"| {m.get('native_pass', '-')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "draft"), help="'' to skip")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--forward", default="auto", help="auto | lean | hf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", default="1,2,3,4,5,6,7,8,9")
    ap.add_argument("--contexts", default="64,256,512,1000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--bandwidth-mb", type=int, default=0, help="buffer for the read test "
                    "(default: 512 MB on CPU, 4096 MB on CUDA)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="", help="suffix of the result files")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    positions = [int(p) for p in args.positions.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    models = {"target": args.target, **({"draft": args.draft} if args.draft else {})}
    rows, memory, bandwidth, how = measure(models, args.dtype, args.forward, device, positions,
                                           contexts, batches, args.repeats, args.bandwidth_mb)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or platform.machine(), "threads": args.threads,
           "torch": torch.__version__, "dtype": args.dtype, "bandwidth_gbs": bandwidth / 1e9,
           "bandwidth_read": how, "repeats": args.repeats, "forward": args.forward}
    out = pathlib.Path(args.out)
    stem = f"passcost{('_' + args.name) if args.name else ''}"
    atomic_write_json(out / f"{stem}.json", {"env": env, "passes": rows, "memory": memory})
    plot(rows, out / f"{stem}.png", f"pass cost, {env['device']}, {args.dtype}, "
         f"{args.threads} threads (dashed: weight-read bound)")
    md = render(env, rows, memory)
    atomic_write_text(out / f"{stem}.md", md)
    console.print(md, markup=False, highlight=False)
    console.print(f"wrote {out / stem}.{{json,md,png}}")
    if not args.no_readme and not args.name:
        readme = ROOT / "docs" / "benchmarks.md"
        text = readme.read_text()
        short = render(env, rows, memory, only=[("target", 1), ("target, packed", 1)]) + (
            f"\nAll tables (draft, batch 8) and the plot: bench/results/{stem}.md, {stem}.png.\n")
        new = re.sub(r"(<!-- passcost:start -->\n).*?(<!-- passcost:end -->)",
                     lambda m: m.group(1) + short + m.group(2), text, flags=re.S)
        if new != text:
            atomic_write_text(readme, new)


if __name__ == "__main__":
    main()
