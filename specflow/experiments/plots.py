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
    """Figure 1 of article B, corrected: acceptance two ways, and tau against both formulas."""
    ks = [r["k"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(ks, [r["alpha"] for r in rows], "o-", label="α = accepted / examined")
    ax1.plot(ks, [r["acceptance_rate"] for r in rows], "s--", label="accepted / proposed")
    ax1.set_xlabel("draft length k")
    ax1.set_ylabel("acceptance")
    ax1.set_ylim(0, 1.05)
    ax1.set_title(f"Acceptance vs k (draft noise {rows[0]['noise']})")
    ax1.legend()
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(ks, [str(k) for k in ks])
    ax2.errorbar(ks, [r["tau"] for r in rows], yerr=[3 * r["tau_se"] for r in rows], fmt="D",
                 color="green", label="measured (±3 SE)")
    ax2.plot(ks, [r["formula_alpha"] for r in rows], "-", color="tab:blue", label="formula with α")
    ax2.plot(ks, [r["formula_acceptance_rate"] for r in rows], "--", color="orange",
             label="formula with accepted / proposed")
    ax2.set_xlabel("draft length k")
    ax2.set_ylabel("tokens per target pass (τ)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(ks, [str(k) for k in ks])
    ax2.set_title("τ: measured vs (1 - a^(k+1)) / (1 - a)")
    ax2.legend()
    return _save(fig, path)


def plot_histograms(hists: list[dict], path: pathlib.Path) -> pathlib.Path:
    """Figure 2 of article B: tokens committed per round at three noise levels."""
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
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over plain decoding")
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
        thr = [r[arm]["throughput"] for r in rows]
        if rows and all("throughput_min" in r[arm] for r in rows):   # min - max over repetitions
            err = [[t - r[arm]["throughput_min"] for t, r in zip(thr, rows, strict=True)],
                   [r[arm]["throughput_max"] - t for t, r in zip(thr, rows, strict=True)]]
            ax1.errorbar(bs, thr, yerr=err, fmt=style, color=color, capsize=3,
                         label=f"{label} (median, min-max over repetitions)")
        else:
            ax1.plot(bs, thr, style, color=color, label=label)
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


def plot_ab(summary: dict, folder: pathlib.Path) -> list[pathlib.Path]:
    """The A/B report's figures: speedup with intervals, acceptance per position,
    tokens per round (Figure 2 of article B) and τ against k (Figure 1)."""
    arms = summary["arms"]
    names = list(arms)
    written = []

    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(names)), 4))
    speed = [arms[n]["speedup"] for n in names]
    lo = [s - arms[n]["speedup_ci95"][0] for s, n in zip(speed, names)]
    hi = [arms[n]["speedup_ci95"][1] - s for s, n in zip(speed, names)]
    ax.bar(names, speed, yerr=[lo, hi], capsize=6, color=["tab:gray" if n == summary["baseline"]
                                                          else "tab:blue" for n in names])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylabel(f"speedup over {summary['baseline']} (tokens/s ratio)")
    ax.set_title(f"{summary['experiment']}: speedup, 95% bootstrap intervals")
    written.append(_save(fig, folder / "speedup.png"))

    drafting = [n for n in names if arms[n]["acceptance_per_position"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in drafting:
        acc = arms[n]["acceptance_per_position"]
        ax.plot(range(1, len(acc) + 1), acc, "o-", label=f"{n} (α {arms[n]['alpha']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance per position")
    if drafting:
        ax.legend()
    written.append(_save(fig, folder / "acceptance_per_position.png"))

    fig, axes = plt.subplots(1, max(len(drafting), 1), figsize=(4 * max(len(drafting), 1), 3.5),
                             sharey=True, squeeze=False)
    for ax, n in zip(axes[0], drafting):
        hist = {int(k): v for k, v in arms[n]["tokens_per_step_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.bar(xs, [hist[x] / total for x in xs])
        ax.set_title(f"{n}: τ = {arms[n]['tau']:.2f}")
        ax.set_xlabel("tokens committed per round")
    axes[0][0].set_ylabel("fraction of rounds")
    written.append(_save(fig, folder / "tokens_per_round.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [i / 10 for i in range(0, 101)]
    for i, n in enumerate(drafting):
        a, k = arms[n]["alpha"], arms[n]["mean_k"]
        curve = [(k_ + 1) if a >= 1 else (1 - a ** (k_ + 1)) / (1 - a) for k_ in ks]
        ax.plot(ks, curve, "-", color=f"C{i}", alpha=0.6, label=f"formula at α={a:.2f}")
        ax.plot([k], [arms[n]["tau"]], "D", color=f"C{i}", ms=9, label=f"{n} measured")
    ax.set_xlabel("mean draft length k")
    ax.set_ylabel("tokens per target pass τ")
    ax.set_title("τ against k: measured and (1 - α^(k+1)) / (1 - α)")
    if drafting:
        ax.legend(fontsize=8)
    written.append(_save(fig, folder / "tau_vs_k.png"))
    return written
