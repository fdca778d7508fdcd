"""Matplotlib figures (PNG) for the simulator; every axis labelled, every figure titled."""
from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_k_sweep(rows: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Figure 1 of seeds/001, corrected: acceptance two ways, and tau against both formulas."""
    ks = [r["k"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(ks, [r["alpha"] for r in rows], "o-", label="α = accepted / examined")
    ax1.plot(ks, [r["acceptance_rate"] for r in rows], "s--", label="accepted / proposed")
    ax1.set_xlabel("draft length k"); ax1.set_ylabel("acceptance"); ax1.set_ylim(0, 1.05)
    ax1.set_title(f"Acceptance vs k (draft noise {rows[0]['noise']})"); ax1.legend()
    ax1.set_xscale("log", base=2); ax1.set_xticks(ks, [str(k) for k in ks])
    ax2.errorbar(ks, [r["tau"] for r in rows], yerr=[3 * r["tau_se"] for r in rows], fmt="D",
                 color="green", label="measured (±3 SE)")
    ax2.plot(ks, [r["formula_alpha"] for r in rows], "-", color="tab:blue", label="formula with α")
    ax2.plot(ks, [r["formula_acceptance_rate"] for r in rows], "--", color="orange",
             label="formula with accepted / proposed")
    ax2.set_xlabel("draft length k"); ax2.set_ylabel("tokens per target pass (τ)")
    ax2.set_xscale("log", base=2); ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.set_title("τ: measured vs (1 - a^(k+1)) / (1 - a)"); ax2.legend()
    return _save(fig, path)


def plot_histograms(hists: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Figure 2 of seeds/001: tokens committed per round at three noise levels."""
    fig, axes = plt.subplots(1, len(hists), figsize=(4 * len(hists), 3.6), sharey=True)
    for ax, h in zip(axes, hists):
        k = h["k"]
        counts = [h["tokens_per_step_histogram"].get(n, 0) for n in range(1, k + 2)]
        total = sum(counts) or 1
        ax.bar(range(1, k + 2), [c / total for c in counts], color="tab:blue")
        ax.set_title(f"noise {h['noise']}  (α = {h['alpha']:.2f})")
        ax.set_xlabel(f"tokens committed per round (k = {k})")
        ax.set_xticks(range(1, k + 2))
    axes[0].set_ylabel("fraction of rounds")
    return _save(fig, path)


def plot_best_k(best: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Speedup vs k per acceptance, measured in simulated time against speedup(a, k, c)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, row in enumerate(best):
        color = f"C{i}"
        ks = [a["k"] for a in row["arms"]]
        ax.plot(ks, [a["formula_speedup"] for a in row["arms"]], "-", color=color,
                label=f"α={row['alpha']} formula")
        ax.errorbar(ks, [a["speedup"] for a in row["arms"]],
                    yerr=[3 * a["speedup_se"] for a in row["arms"]], fmt="o", color=color, ms=4)
        ax.plot([row["formula_best_k"]], [row["formula_best_speedup"]], "*", color=color, ms=14)
    ax.set_xlabel("draft length k"); ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Speedup vs k at c = {best[0]['c']} (dots: measured ±3 SE, ★: best k)")
    ax.legend(fontsize=8, ncol=2)
    return _save(fig, path)


def plot_policy_mix(report: dict[str, list[dict]], path: pathlib.Path) -> pathlib.Path:
    """Throughput of every policy arm relative to the best static k, one panel per cost regime."""
    fig, axes = plt.subplots(1, len(report), figsize=(6 * len(report), 4), sharey=True)
    axes = [axes] if len(report) == 1 else axes
    for ax, (regime, rows) in zip(axes, report.items()):
        names = [r["arm"] for r in rows]
        values = [r["vs_best_static"] for r in rows]
        colors = ["tab:gray" if n.startswith("static") else "tab:blue" for n in names]
        ax.barh(names, values, color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xlim(min(values) * 0.97, max(values) * 1.02)
        ax.set_xlabel("throughput / best static k (simulated time)")
        ax.set_title(regime)
    fig.suptitle("Policies on an interleaved code/chat mix")
    return _save(fig, path)


def plot_calibration(rows: list[dict], crossover: float | None, path: pathlib.Path) -> pathlib.Path:
    """Throughput and per-token latency against batch size, speculation on and off."""
    bs = [r["batch"] for r in rows]
    unit = rows[0]["none"]["unit"] if rows else "s"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, label, style, color in (("none", "speculation off", "o-", "tab:blue"),
                                     ("spec", "speculation on", "s-", "tab:orange")):
        ax1.plot(bs, [r[arm]["throughput"] for r in rows], style, color=color, label=label)
        ax2.plot(bs, [r[arm]["latency_p50"] for r in rows], style, color=color, label=f"{label}, p50")
        ax2.plot(bs, [r[arm]["latency_p95"] for r in rows], style.replace("-", ":"), color=color,
                 label=f"{label}, p95", alpha=0.6)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("running sequences (batch size)")
        if crossover is not None:
            ax.axvline(crossover, color="red", ls="--", lw=1, label=f"crossover {crossover:.1f}")
        ax.legend(fontsize=8)
    ax1.set_ylabel(f"decode throughput (tokens/{unit})")
    ax1.set_title("Throughput")
    ax2.set_ylabel(f"time per token per request ({unit})")
    ax2.set_title("Per-token latency")
    return _save(fig, path)
