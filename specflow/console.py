"""What specflow prints: rich tables of results, metrics and simulator studies."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

# logs and pipes get wide tables rather than 80-column ones with truncated headers
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _f(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def print_results(results) -> None:
    for r in results:
        console.rule(f"[bold]request {r.index}[/]  finish_reason={r.finish_reason}  "
                     f"tokens={len(r.token_ids)}")
        console.print(r.prompt, style="dim", end="", markup=False, highlight=False)
        console.print(r.text, markup=False, highlight=False)


def metrics_table(stats: dict, title: str = "metrics (formulas: specflow/metrics.py)") -> Table:
    t = Table(title=title, show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("committed tokens", stats["num_committed_tokens"]),
        ("target passes (rounds)", stats["num_target_passes"]),
        ("rounds with drafts", stats["num_drafts"]),
        ("draft tokens proposed / examined / accepted",
         f"{stats['num_draft_tokens']} / {stats['num_examined_draft_tokens']} / "
         f"{stats['num_accepted_tokens']}"),
        ("acceptance_rate = accepted / proposed", _f(stats["acceptance_rate"])),
        ("α = accepted / examined", _f(stats["alpha"])),
        ("τ = drawn / target passes (committed + the ending EOS / stop tokens)", _f(stats["mean_acceptance_length"])),
        ("acceptance per position", " ".join(_f(a, 2) for a in stats["acceptance_per_position"])
         or "-"),
        ("c (measured draft cost per token / target pass)", _f(stats["c"])),
        ("predicted speedup (1-α^(k+1))/((1-α)(kc+1))", _f(stats["predicted_speedup"])),
        ("tokens / s (wall)", _f(stats["tokens_per_second"], 1)),
        ("wall seconds: " + " / ".join(stats["seconds"]),
         " / ".join(_f(v, 3) for v in stats["seconds"].values())),
    ]
    if stats.get("sim_time"):
        rows.append(("simulated time (target / draft)",
                     f"{_f(stats['sim_time'].get('target', 0.0), 1)} / "
                     f"{_f(stats['sim_time'].get('draft', 0.0), 1)}"))
    for name, value in rows:
        t.add_row(name, str(value))
    return t


def sim_k_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("k", "noise", "accepted/proposed", "α (accepted/examined)", "τ measured", "± SE",
                "formula(α)", "formula(accepted/proposed)", "z", "within error"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["k"]), _f(r["noise"], 2), _f(r["acceptance_rate"]), _f(r["alpha"]),
                  _f(r["tau"]), _f(r["tau_se"]), _f(r["formula_alpha"]),
                  _f(r["formula_acceptance_rate"]), _f(r["z"], 2),
                  "yes" if abs(r["z"]) < 3 else "[red]NO[/]")
    return t


def sim_best_k_table(rows: list[dict]) -> Table:
    t = Table(title=f"best k per α at c = {rows[0]['c']} (speedup in simulated time)")
    for col in ("α", "noise", "best k (formula)", "speedup (formula)", "measured at that k",
                "z", "best k (measured)", "speedup (measured best)", "within error"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(_f(r["alpha"], 2), _f(r["noise"]), str(r["formula_best_k"]),
                  _f(r["formula_best_speedup"], 2), _f(r["measured_at_formula_best"], 2),
                  _f(r["z"], 2), str(r["measured_best_k"]), _f(r["measured_best_speedup"], 2),
                  "yes" if abs(r["z"]) < 3 else "[red]NO[/]")
    return t


def sim_policy_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    classes = [k[2:] for k in rows[0] if k.startswith("k_")]
    for col in ("arm", "tokens / time unit", "vs best static", "vs oracle", "α",
                *[f"mean k ({c})" for c in classes]):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["arm"], _f(r["throughput"], 2), _f(r["vs_best_static"]), _f(r["vs_oracle"]),
                  _f(r["alpha"], 2), *[_f(r[f"k_{c}"], 2) for c in classes])
    return t


def calibrate_table(rows: list[dict], result: dict, verdicts: list[str]) -> Table:
    """The sweep: per batch size each arm's throughput (median, min - max over repetitions), the
    speedup on / off (median [interval over repetitions]) and whether it clearly pays
    (`verdicts`: each row's pays / loses / unclear, experiments.calibrate.classify)."""
    cross = result["crossover"]
    unit = rows[0]["none"]["unit"] if rows else "s"
    if result.get("refused"):
        title = ("load sweep: crossover undetermined (noise exceeds the effect where it is "
                 "decided); schedule NOT WRITTEN")
    else:
        title = (f"load sweep: crossover at {'-' if cross is None else f'{cross:.1f}'} running "
                 f"sequences; schedule {result['ranges']}")
    t = Table(title=title)
    for col in ("batch", "requests x reps", f"tokens/{unit} off (min-max)",
                f"tokens/{unit} on (min-max)", "on / off [interval]", "verdict",
                f"latency p50 off / on ({unit}/token)", "latency p95 off / on", "α"):
        t.add_column(col, justify="right")
    def spread(a: dict) -> str:
        if "throughput_min" not in a:
            return _f(a["throughput"], 1)
        return f"{a['throughput']:.1f} ({a['throughput_min']:.1f}-{a['throughput_max']:.1f})"

    verdict = {"pays": "pays", "loses": "loses", "unclear": "[yellow]unclear[/]"}
    for r, said in zip(rows, verdicts):
        off, on = r["none"], r["spec"]
        sp = r.get("speedup") or {"median": on["throughput"] / off["throughput"]}
        interval = f" [{sp['lo']:.2f}-{sp['hi']:.2f}]" if "lo" in sp else ""
        t.add_row(str(r["batch"]), f"{r.get('requests', r['batch'])} x {r.get('repetitions', 1)}",
                  spread(off), spread(on), f"{sp['median']:.2f}{interval}", verdict[said],
                  f"{off['latency_p50']:.4f} / {on['latency_p50']:.4f}",
                  f"{off['latency_p95']:.4f} / {on['latency_p95']:.4f}", _f(on["alpha"], 2))
    return t
