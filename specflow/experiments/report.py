"""`specflow report <sweep-folder>`: what an A/B experiment says, with its uncertainty.

Per arm: tokens/s and speedup over the baseline arm with a bootstrap 95% interval (requests are
resampled with their pairing kept: the same prompt and repetition in both arms), τ, α (and vLLM's
acceptance rate), acceptance per position, per-token latency p50/p95, the formula's predicted
speedup from the arm's own α and c, and correctness: a greedy arm must match the baseline token for
token (the exact-match rate and the first differing position are reported); a sampling arm gets a
two-sample chi-square test of its first tokens against the baseline's. Writes report.md,
report.json and PNG plots into the folder.

Every planned job (<arm>/rep<r>/, from multirun.yaml) must have finished: a sweep with a job
lacking metrics.json is refused with the list of those jobs (an arm is never dropped silently),
and a damaged metrics.json or requests.jsonl is refused with its name, one line each.

`--baseline old/report.json --max-acceptance-drop 0.05` exits 1 when any arm's α fell by more than
that: a draft that drifted after a target update still gives correct output, and only acceptance
shows it (article A, docs/design.md §6).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
from collections import Counter

import numpy as np

from specflow.errors import InputError
from specflow.io import json_type, read_json
from specflow.metrics import predicted_speedup

COUNTERS = ("num_target_passes", "num_drafts", "num_draft_tokens", "num_examined_draft_tokens",
            "num_accepted_tokens", "num_committed_tokens")


# metrics.json of a finished job: the fields the report reads and their JSON types
METRICS_FIELDS = {"experiment": str, "arm": str, "rep": int, "baseline": str, "greedy": bool,
                  "aggregate": dict, "requests": list}
AGGREGATE_FIELDS = {**{c: (int, float) for c in COUNTERS}, "accepted_per_position": list,
                    "examined_per_position": list, "tokens_per_step_histogram": dict,
                    "seconds": dict}
JOB_DIR = re.compile(r"^rep(\d+)$")
SHOWN = 8          # unfinished jobs named in the message before "and N more"


def _is(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, kind) and not isinstance(value, bool)


def _damaged(where: str, job: pathlib.Path, what: str) -> InputError:
    return InputError(f"{where}: {what}; the job {str(job)!r} is damaged: delete that folder and "
                      f"rerun the same specflow ab command, which redoes only that job")


def _read_text(path: pathlib.Path, job: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise _damaged(str(path), job, f"not UTF-8 (bad byte at offset {exc.start})") from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}; check the file's "
                         f"permissions") from None


def read_metrics(path: pathlib.Path) -> dict:
    """A finished job's metrics.json, checked field by field: one line naming the file if not."""
    job = path.parent
    try:
        m = json.loads(_read_text(path, job))
    except json.JSONDecodeError as exc:
        raise _damaged(str(path), job, f"not valid JSON ({exc.msg}: line {exc.lineno} column "
                                       f"{exc.colno}; a truncated file?)") from None
    if not isinstance(m, dict):
        raise _damaged(str(path), job, f"a JSON {json_type(m)}, not the object specflow ab "
                                       f"writes")
    checks = ((METRICS_FIELDS, m, ""), (AGGREGATE_FIELDS, m.get("aggregate"), "aggregate."))
    for fields, node, prefix in checks:      # the aggregate's only once it is known an object
        missing = [k for k in fields if k not in node]
        if missing:
            names = [repr(prefix + k) for k in missing]
            raise _damaged(str(path), job, f"no field {names[0]}"
                                           + (f" (nor {', '.join(names[1:])})" if names[1:] else ""))
        wrong = next((k for k, kind in fields.items() if not _is(node[k], kind)), None)
        if wrong is not None:
            raise _damaged(str(path), job, f"field {prefix + wrong!r} is a JSON "
                                           f"{json_type(node[wrong])}")
    arms = m.get("arms", [])
    if not isinstance(arms, list):
        raise _damaged(str(path), job, f"field 'arms' is a JSON {json_type(arms)}")
    return m


def read_requests(path: pathlib.Path, expected: int) -> list[dict]:
    """A finished job's requests.jsonl: every line a request record, as many as metrics.json
    counts (a finished job has no torn line; an unfinished one is not read)."""
    job = path.parent
    if not path.is_file():
        raise _damaged(str(path), job, "missing, though the job's metrics.json exists")
    rows: dict[int, dict] = {}
    for n, line in enumerate(_read_text(path, job).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _damaged(f"{path}:{n}", job, f"not valid JSON ({exc.msg}; a torn "
                                               f"line?)") from None
        stats = row.get("stats") if isinstance(row, dict) else None
        if not (isinstance(row, dict) and _is(row.get("index"), int)
                and isinstance(row.get("token_ids"), list) and isinstance(stats, dict)
                and isinstance(stats.get("seconds"), dict)):
            raise _damaged(f"{path}:{n}", job, "not a request record (index, token_ids, "
                                               "stats.seconds)")
        rows[row["index"]] = row
    if len(rows) != expected:
        raise _damaged(str(path), job, f"holds {len(rows)} requests but metrics.json counts "
                                       f"{expected}")
    return [rows[i] for i in sorted(rows)]


def _planned_jobs(folder: pathlib.Path) -> set[tuple[str, int]] | None:
    """(arm, rep) for every job the sweep's multirun.yaml asks for; None when it cannot tell."""
    import yaml

    try:
        ab = yaml.safe_load((folder / "multirun.yaml").read_text(encoding="utf-8"))["ab"]
        arms = [str(a) for a in ab["arms"]]
        return {(a, r) for a in arms for r in range(int(ab["repetitions"]))}
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def load_sweep(folder: pathlib.Path) -> tuple[dict, list[str]]:
    """{arm: {rep: {"metrics", "requests"}}} from a sweep whose every job finished.

    Jobs are <arm>/rep<r>/ folders; one that is planned (multirun.yaml, or another job's arm
    list) or started but has no metrics.json refuses the report with the list of those jobs: an
    arm is never dropped silently. A damaged file refuses it with its name. The second value is
    the unfinished jobs (always empty: kept for report.json).
    """
    if not folder.is_dir():
        raise InputError(f"{str(folder)!r} is not a folder; give the sweep folder that "
                         f"`specflow ab` printed (ab/<experiment>)")
    arms: dict = {}
    started: set[tuple[str, int]] = set()
    first = None
    for job in sorted(d for d in folder.glob("*/rep*") if d.is_dir() and JOB_DIR.match(d.name)):
        key = (job.parent.name, int(JOB_DIR.match(job.name).group(1)))
        started.add(key)
        metrics = job / "metrics.json"
        if not metrics.exists():
            continue
        m = read_metrics(metrics)
        if (m["arm"], m["rep"]) != key:
            raise _damaged(str(metrics), job, f"it records arm {m['arm']!r}, repetition "
                                              f"{m['rep']}, but sits in {key[0]}/rep{key[1]}")
        if first is None:
            first = metrics, m
        elif (m["experiment"], m["baseline"]) != (first[1]["experiment"], first[1]["baseline"]):
            raise InputError(f"{metrics} is from experiment {m['experiment']!r} (baseline "
                             f"{m['baseline']!r}) but {first[0]} from "
                             f"{first[1]['experiment']!r} (baseline {first[1]['baseline']!r}); "
                             f"report one sweep folder at a time")
        requests = read_requests(job / "requests.jsonl", len(m["requests"]))
        arms.setdefault(m["arm"], {})[m["rep"]] = {"metrics": m, "requests": requests}
    planned = _planned_jobs(folder)
    if planned is None:                  # no multirun.yaml: every listed arm at every rep seen
        listed = {str(a) for reps in arms.values() for job in reps.values()
                  for a in job["metrics"].get("arms", [])}
        planned = {(a, r) for a in listed for r in {rep for _, rep in started}}
    finished = {(arm, rep) for arm, reps in arms.items() for rep in reps}
    unfinished = sorted((planned | started) - finished, key=lambda k: (k[1], k[0]))
    if unfinished:
        names = [f"{arm}/rep{rep}" for arm, rep in unfinished]
        more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
        raise InputError(f"sweep {str(folder)!r} is not finished: no metrics.json in "
                         f"{', '.join(names[:SHOWN])}{more} ({len(unfinished)} of "
                         f"{len(planned | started | finished)} jobs); rerun the same specflow "
                         f"ab command (hydra.sweep.dir={folder} if you set it) to finish them, "
                         f"then report")
    if not arms:
        sweeps = sorted(d.name for d in folder.iterdir() if (d / "multirun.yaml").is_file())
        hint = (f"; it holds the sweeps {', '.join(sweeps)}: report one of them "
                f"(specflow report {folder / sweeps[0]})" if sweeps else
                "; give the sweep folder that specflow ab printed, or run specflow ab first")
        raise InputError(f"no finished A/B jobs under {str(folder)!r} (no "
                         f"<arm>/rep<r>/metrics.json){hint}")
    return arms, []


def _units(reps: dict) -> dict:
    """(rep, request index) -> request record."""
    return {(rep, r["index"]): r for rep, job in reps.items() for r in job["requests"]}


def _seconds(r: dict) -> float:
    return sum(r["stats"]["seconds"].values())


def bootstrap_ratio(tok_a, sec_a, tok_b, sec_b, n: int, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of (sum tok_a / sum sec_a) / (sum tok_b / sum sec_b), paired."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(tok_a), size=(n, len(tok_a)))
    ta, sa, tb, sb = (np.asarray(x, dtype=float)[idx].sum(1) for x in (tok_a, sec_a, tok_b, sec_b))
    ratios = (ta / sa) / (tb / sb)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))



def _measured_c(aggregates) -> float | None:
    """c over several jobs, the way metrics.json computes it (simulated time on synthetic arms,
    wall seconds otherwise): one definition, specflow.metrics.Counters.measured_c."""
    from specflow.metrics import Counters

    total = Counters()
    for aggregate in aggregates:
        job = Counters.from_dict(aggregate)
        total.add_counts(job)
        total.add_seconds(job.seconds)
        for source, value in job.sim_time.items():
            total.sim_time[source] = total.sim_time.get(source, 0.0) + value
    return total.measured_c()

def _aggregate(reps: dict) -> dict:
    agg = {c: 0 for c in COUNTERS}
    acc_pos, exam_pos, hist, secs = Counter(), Counter(), Counter(), Counter()
    for job in reps.values():
        a = job["metrics"]["aggregate"]
        for c in COUNTERS:
            agg[c] += a[c]
        agg["num_tree_drafts"] = agg.get("num_tree_drafts", 0) + a.get("num_tree_drafts", 0)
        # tau's numerator (older metrics.json files predate it: their committed tokens)
        agg["num_drawn_tokens"] = agg.get("num_drawn_tokens", 0) + a.get("num_drawn_tokens", a["num_committed_tokens"])
        for i, v in enumerate(a["accepted_per_position"]):
            acc_pos[i] += v
        for i, v in enumerate(a["examined_per_position"]):
            exam_pos[i] += v
        for n, v in a["tokens_per_step_histogram"].items():
            hist[int(n)] += v
        for stage, v in a["seconds"].items():
            secs[stage] += v
    exam = agg["num_examined_draft_tokens"]
    alpha = agg["num_accepted_tokens"] / exam if exam else 0.0
    mean_k = agg["num_draft_tokens"] / agg["num_drafts"] if agg["num_drafts"] else 0.0
    c = _measured_c(job["metrics"]["aggregate"] for job in reps.values())
    return {
        **agg, "alpha": alpha,
        "acceptance_rate": (agg["num_accepted_tokens"] / agg["num_draft_tokens"]
                            if agg["num_draft_tokens"] else 0.0),
        "tau": agg["num_drawn_tokens"] / max(agg["num_target_passes"], 1),
        "mean_k": mean_k, "c": c,
        "acceptance_per_position": [acc_pos[i] / exam_pos[i] for i in sorted(exam_pos)
                                    if exam_pos[i]],
        "tokens_per_step_histogram": {str(n): hist[n] for n in sorted(hist)},
        "predicted_speedup": (predicted_speedup(alpha, mean_k, c, agg["num_drafts"]
                                                / max(agg["num_target_passes"], 1))
                              if c is not None and not agg.get("num_tree_drafts") else None),
    }


def _first_token_test(units_a: dict, units_b: dict) -> dict:
    from specflow.experiments.chi_square import independence

    a = Counter(r["token_ids"][0] for r in units_a.values() if r["token_ids"])
    b = Counter(r["token_ids"][0] for r in units_b.values() if r["token_ids"])
    keys = sorted(set(a) | set(b))
    table = np.array([[a[k] for k in keys], [b[k] for k in keys]])
    if table.shape[1] < 2:
        return {"test": "first-token chi-square", "p_value": 1.0, "n": int(table.sum())}
    p = independence(table + 0.5).pvalue     # +0.5: sparse cells stay defined
    return {"test": "first-token chi-square", "p_value": p, "n": int(table[0].sum())}


def summarize(arms: dict, n_boot: int = 2000) -> dict:
    any_job = next(iter(next(iter(arms.values())).values()))["metrics"]
    baseline = any_job["baseline"]
    if baseline not in arms:
        raise InputError(f"the baseline arm {baseline!r} has no finished job; finish the sweep "
                         f"(rerun specflow ab) before reporting")
    base_units = _units(arms[baseline])
    out = {"experiment": any_job["experiment"], "baseline": baseline, "arms": {}}
    order = [a for a in any_job.get("arms", []) if a in arms] + sorted(
        a for a in arms if a not in any_job.get("arms", []))
    for name in order:
        reps = arms[name]
        units = _units(reps)
        common = sorted(set(units) & set(base_units))
        tok = [len(units[u]["token_ids"]) for u in common]
        sec = [_seconds(units[u]) for u in common]
        btok = [len(base_units[u]["token_ids"]) for u in common]
        bsec = [_seconds(base_units[u]) for u in common]
        tps = sum(tok) / sum(sec) if sum(sec) else 0.0
        speedup = tps / (sum(btok) / sum(bsec)) if sum(bsec) and sum(btok) else float("nan")
        lo, hi = bootstrap_ratio(tok, sec, btok, bsec, n_boot) if common else (math.nan, math.nan)
        per_token = sorted(s / t for s, t in zip(sec, tok) if t)
        greedy = all(job["metrics"]["greedy"] for job in reps.values())
        row = {"repetitions": len(reps), "requests": len(units), "tokens": sum(tok),
               "tokens_per_second": tps, "speedup": speedup, "speedup_ci95": [lo, hi],
               "latency_p50": float(np.percentile(per_token, 50)) if per_token else None,
               "latency_p95": float(np.percentile(per_token, 95)) if per_token else None,
               "greedy": greedy, **_aggregate(reps),
               # run over run: a proposer that learns across runs (a suffix cache) shows it here
               "per_repetition": {str(rep): {key: job["metrics"]["aggregate"].get(key)
                                             for key in ("alpha", "acceptance_rate",
                                                         "mean_acceptance_length",
                                                         "tokens_per_second")}
                                  for rep, job in sorted(reps.items())}}
        if name != baseline and greedy:
            diffs = []
            for u in common:
                a, b = units[u]["token_ids"], base_units[u]["token_ids"]
                if a != b:
                    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    diffs.append({"rep": u[0], "request": u[1], "position": pos})
            row["exact_match"] = 1 - len(diffs) / len(common) if common else None
            row["first_difference"] = min(diffs, key=lambda d: d["position"]) if diffs else None
        elif name != baseline:
            row["distribution"] = _first_token_test({u: units[u] for u in common},
                                                    {u: base_units[u] for u in common})
        out["arms"][name] = row
    return out


def drift(summary: dict, old: dict, max_drop: float) -> list[str]:
    found = []
    for name, row in summary["arms"].items():
        before = old.get("arms", {}).get(name)
        if before is None or not row["num_draft_tokens"] or not before.get("num_draft_tokens"):
            continue
        drop = before["alpha"] - row["alpha"]
        if drop > max_drop:
            found.append(f"arm {name}: α fell from {before['alpha']:.3f} to {row['alpha']:.3f} "
                         f"(drop {drop:.3f} > {max_drop}); output stays correct, the draft drifted")
    return found


def _f(x, d=2):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{d}f}"


def correctness(row: dict, baseline: bool) -> str:
    if baseline:
        return "baseline"
    if "exact_match" in row:
        first = row.get("first_difference")
        where = "" if first is None else (f"; first difference: request {first['request']}, "
                                          f"rep {first['rep']}, token {first['position']}")
        return f"exact match {100 * row['exact_match']:.0f}%{where}"
    d = row.get("distribution", {})
    return f"first tokens vs baseline: chi-square p = {_f(d.get('p_value'), 3)} (n = {d.get('n')})"


def markdown(summary: dict) -> str:
    base = summary["baseline"]
    lines = [f"# A/B report: {summary['experiment']}", "",
             f"Baseline arm: `{base}`. Speedup = the arm's tokens/s over the baseline's on the same "
             f"requests, 95% bootstrap interval over requests. α = accepted / examined drafts, "
             f"acceptance rate = accepted / proposed, τ = committed tokens / target pass, "
             f"predicted = (1-α^(k+1)) / ((1-α)(k·c+1)) (chains only; for a token tree α and "
             f"acc/pos are per tree level).", "",
             "| arm | tokens/s | speedup [95% CI] | τ | α | acceptance rate | acceptance per position "
             "| latency p50 / p95 (ms/token) | predicted | correctness |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for name, r in summary["arms"].items():
        lo, hi = r["speedup_ci95"]
        per_pos = " ".join(_f(a) for a in r["acceptance_per_position"]) or "-"
        lat = ("-" if r["latency_p50"] is None else
               f"{1000 * r['latency_p50']:.2f} / {1000 * r['latency_p95']:.2f}")
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f} "
                     f"[{_f(lo)}, {_f(hi)}] | {r['tau']:.2f} | {_f(r['alpha'], 3)} | "
                     f"{_f(r['acceptance_rate'], 3)} | {per_pos} | {lat} | "
                     f"{_f(r['predicted_speedup'])} | {correctness(r, name == base)} |")
    reps = sorted({r for row in summary["arms"].values() for r in row["per_repetition"]}, key=int)
    if len(reps) > 1:
        lines += ["", "Per repetition (α / τ / tokens/s): does acceptance change run over run?", "",
                  "| arm | " + " | ".join(f"rep {r}" for r in reps) + " |",
                  "|---|" + "---|" * len(reps)]
        for name, row in summary["arms"].items():
            lines.append(f"| {name} | " + " | ".join(_rep_cell(row["per_repetition"].get(r))
                                                     for r in reps) + " |")
    lines += ["", "Plots: speedup.png, acceptance_per_position.png, tokens_per_round.png, "
              "tau_vs_k.png."]
    return "\n".join(lines) + "\n"


def _rep_cell(m: dict | None) -> str:
    if m is None:
        return "-"
    return (f"{_f(m['alpha'], 3)} / {_f(m['mean_acceptance_length'])} / "
            f"{_f(m['tokens_per_second'], 1)}")


def repetition_table(summary: dict):
    """The per-repetition table (None with a single repetition)."""
    from rich.table import Table

    reps = sorted({r for row in summary["arms"].values() for r in row["per_repetition"]}, key=int)
    if len(reps) < 2:
        return None
    t = Table(title="per repetition: α / τ / tokens/s")
    t.add_column("arm")
    for r in reps:
        t.add_column(f"rep {r}")
    for name, row in summary["arms"].items():
        t.add_row(name, *[_rep_cell(row["per_repetition"].get(r)) for r in reps])
    return t


def table(summary: dict):
    from rich.table import Table

    base = summary["baseline"]
    t = Table(title=f"A/B {summary['experiment']} (baseline {base}; speedup with 95% bootstrap CI)")
    for col in ("arm", "tokens/s", "speedup", "95% CI", "τ", "α", "acc/pos", "p50/p95 ms/tok",
                "predicted", "correctness"):
        t.add_column(col)
    for name, r in summary["arms"].items():
        lo, hi = r["speedup_ci95"]
        lat = ("-" if r["latency_p50"] is None else
               f"{1000 * r['latency_p50']:.1f}/{1000 * r['latency_p95']:.1f}")
        t.add_row(name, f"{r['tokens_per_second']:.1f}", f"{r['speedup']:.2f}",
                  f"[{_f(lo)}, {_f(hi)}]", f"{r['tau']:.2f}", _f(r["alpha"], 3),
                  " ".join(_f(a) for a in r["acceptance_per_position"]) or "-", lat,
                  _f(r["predicted_speedup"]), correctness(r, name == base))
    return t


def read_baseline(path: str) -> dict:
    """An earlier report.json for the drift check: an object with an `arms` object whose rows
    carry a numeric `alpha`."""
    old = read_json(path, f"--baseline {path!r}", "give the report.json of an earlier sweep")
    rows = old.get("arms") if isinstance(old, dict) else None
    if not isinstance(rows, dict) or not all(
            isinstance(r, dict) and _is(r.get("alpha"), (int, float)) for r in rows.values()):
        raise InputError(f"--baseline {path!r} is not a report.json that specflow report wrote "
                         f"(an 'arms' object with an 'alpha' per arm); give the report.json of "
                         f"an earlier sweep")
    return old


def write_report(folder: str | os.PathLike, baseline: str | None = None, n_boot: int = 2000,
                 max_acceptance_drop: float = 0.05) -> tuple[dict, list[str]]:
    """Summarize the sweep in `folder`, write report.json, report.md and the plots there, and
    check acceptance drift against an earlier report.json. Returns (summary, drift findings);
    raises SpecflowError (a damaged or unfinished sweep, an unreadable baseline, a folder that
    cannot be written) and never prints."""
    from specflow.experiments import plots
    from specflow.io import atomic_write_json, atomic_write_text

    folder = pathlib.Path(folder)
    old = read_baseline(baseline) if baseline else None
    arms, unfinished = load_sweep(folder)
    summary = summarize(arms, n_boot)
    summary["unfinished"] = unfinished
    try:
        atomic_write_json(folder / "report.json", summary)
        atomic_write_text(folder / "report.md", markdown(summary))
        plots.plot_ab(summary, folder)
    except OSError as exc:
        raise InputError(f"cannot write the report into {str(folder)!r}: {exc.strerror}; make "
                         f"the folder writable") from None
    return summary, ([] if old is None else drift(summary, old, max_acceptance_drop))
