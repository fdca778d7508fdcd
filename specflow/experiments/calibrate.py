"""`specflow calibrate`: where speculation stops paying on this model pair and this machine.

A load sweep over batch sizes with speculation on (the configured proposer and policy) and off
(proposer=none): decode throughput (prefill is the same in both arms and is left out) and
per-token latency p50 / p95 per request. The crossover is the batch size where speculation's
throughput falls to plain decoding's (interpolated on a log scale between the two measured sizes
around it). The result is a `schedule` policy that keeps k up to (1 - margin) x the crossover and
switches speculation off above, written as `policy/calibrated.yaml`.

Measuring it so that the answer is not noise:
- warm-up: before the timed runs of each batch size, each arm runs `warmup` untimed batches (lazy
  init, KV cache growth, first-call costs at that shape stay out of the numbers; all new_tokens
  at the first size, WARMUP_TOKENS at the others);
- requests: each timed run generates max(batch, min_requests) requests, so small batch sizes are
  measured over several full batches rather than one request;
- repetitions: each (batch size, arm) is timed `repetitions` times, the arms interleaved within a
  repetition (on/off, then off/on, ...) so that drift of the machine hits both alike;
- the speedup (on / off throughput) is paired per repetition; a point's speedup is the median over
  repetitions with a distribution-free interval for it (order statistics; min - max up to 5
  repetitions). A point *pays* when its interval lies above 1, *loses* when it lies at or below
  1, else it is *unclear*. `check_determined` refuses (NoisyCalibration) to write a schedule when
  the crossover depends on an unclear point that is not bracketed by a paying and a losing
  neighbour (or whose interval is not within 1 +- tolerance, i.e. break-even either way).

The synthetic backend measures in its simulated clock, which is deterministic: no noise there.
"""
from __future__ import annotations

import math
import os
import pathlib
import statistics
import time
from typing import Callable

import yaml
from omegaconf import DictConfig

from specflow.errors import ConfigError
from specflow.pipeline import Pipeline

from specflow.config import CONFIG_PATH_ENV, resolved_copy

# the interval around a point's median speedup covers the true median with at least this
# probability (distribution-free; with 3 repetitions it is min - max, 75 %)
INTERVAL_COVERAGE = 0.75
# new tokens of a warm-up batch after the first batch size (the first one runs new_tokens)
WARMUP_TOKENS = 16


class NoisyCalibration(ConfigError):
    """The measurements' noise exceeds the effect where the crossover is decided: no schedule
    is written. The remedy is configuration (more calibrate.repetitions / min_requests) or a
    quieter machine."""


def check_settings(cal) -> None:
    """The calibrate section's values: whole numbers where counts are meant, finite fractions."""
    import math

    def whole(key, lo):
        value = cal.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ConfigError(f"calibrate.{key}={value!r} must be a whole number >= {lo}")

    for key, lo in (("new_tokens", 1), ("repetitions", 1), ("min_requests", 1), ("warmup", 0)):
        whole(key, lo)
    sizes = list(cal.get("batch_sizes") or [])
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ConfigError(f"calibrate.batch_sizes={sizes!r} must be a list of whole numbers >= 1")
    for key, lo, hi in (("margin", 0.0, 1.0), ("tolerance", 0.0, 1.0)):
        value = cal.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or not lo <= value < hi:
            raise ConfigError(f"calibrate.{key}={value!r} must be a number in [{lo}, {hi})")


def calibrated_path(output: str | None) -> pathlib.Path:
    """Where policy/calibrated.yaml goes: an explicit path, $SPECFLOW_CONFIG_PATH, or the package's
    own conf folder (both are on the config search path, so `policy=calibrated` finds it)."""
    if output:
        return pathlib.Path(output)
    if os.environ.get(CONFIG_PATH_ENV):
        return pathlib.Path(os.environ[CONFIG_PATH_ENV]) / "policy" / "calibrated.yaml"
    import specflow.conf
    return pathlib.Path(specflow.conf.__file__).parent / "policy" / "calibrated.yaml"


def _plain_cfg(cfg: DictConfig) -> DictConfig:
    plain = resolved_copy(cfg)
    plain.proposer = {"name": "none", "k": 0}
    plain.policy = {"name": "static", "k": 0}
    return plain


def _measure(pipe: Pipeline, prompts: list[str], batch: int, new_tokens: int) -> dict:
    """One timed generate: decode throughput and each request's decode time per token."""
    clock0 = pipe.clock.time
    t0 = time.perf_counter()
    results = pipe.generate(prompts, max_new_tokens=new_tokens, max_batch_size=batch)
    wall = time.perf_counter() - t0
    s = pipe.last_stats
    simulated = pipe.clock.time - clock0
    if simulated > 0:          # the synthetic backend: its clock is the only meaningful time
        decode, unit = simulated, "simulated"
        per_token = [(r.stats["sim_time"].get("target", 0) + r.stats["sim_time"].get("draft", 0))
                     / max(len(r.token_ids), 1) for r in results]
    else:
        decode, unit = wall - s["seconds"]["prefill"], "s"
        per_token = [(sum(r.stats["seconds"].values()) - r.stats["seconds"]["prefill"])
                     / max(len(r.token_ids), 1) for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    return {"tokens": tokens, "time": decode, "wall": wall, "unit": unit,
            "throughput": tokens / decode, "per_token": per_token, "alpha": s["alpha"]}


def _percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def median_interval(values: list[float], coverage: float = INTERVAL_COVERAGE) -> tuple[float, float]:
    """The narrowest pair of order statistics (x_(j), x_(n+1-j)) that covers the median of the
    distribution the values came from with probability >= coverage, whatever the distribution
    (binomial(n, 1/2) tails). min - max for n <= 5 at 75 %; it narrows as n grows, so more
    repetitions buy a tighter interval. With n < 3 nothing reaches 75 %: min - max."""
    v = sorted(values)
    n = len(v)
    lo, hi = v[0], v[-1]
    tail = 0.0
    for j in range(1, n // 2 + 1):
        tail += math.comb(n, j - 1) / 2 ** n      # P(Binomial(n, 1/2) <= j - 1)
        if 1 - 2 * tail < coverage:
            break
        lo, hi = v[j - 1], v[n - j]
    return lo, hi


def _arm_summary(runs: list[dict]) -> dict:
    """One arm at one batch size over its timed repetitions."""
    thr = [r["throughput"] for r in runs]
    per_token = [x for r in runs for x in r["per_token"]]      # every request of every repetition
    alphas = [r["alpha"] for r in runs if r["alpha"] is not None]
    return {"throughput": statistics.median(thr), "throughput_min": min(thr),
            "throughput_max": max(thr), "throughput_reps": thr,
            "tokens": sum(r["tokens"] for r in runs), "time": sum(r["time"] for r in runs),
            "unit": runs[0]["unit"],
            "latency_p50": statistics.median(per_token), "latency_p95": _percentile(per_token, 0.95),
            "alpha": statistics.median(alphas) if alphas else None}


def summarize_point(batch: int, requests: int, none_runs: list[dict], spec_runs: list[dict],
                    warmup: int = 0) -> dict:
    """A row of the sweep: each arm over its repetitions, and the speedup paired per repetition
    (the two arms of one repetition ran back to back, so they saw the same machine)."""
    ratios = [s["throughput"] / n["throughput"] for n, s in zip(none_runs, spec_runs, strict=True)]
    lo, hi = median_interval(ratios)
    return {"batch": batch, "requests": requests, "repetitions": len(ratios), "warmup": warmup,
            "none": _arm_summary(none_runs), "spec": _arm_summary(spec_runs),
            "speedup": {"median": statistics.median(ratios), "min": min(ratios),
                        "max": max(ratios), "lo": lo, "hi": hi,
                        "coverage": INTERVAL_COVERAGE, "reps": ratios}}


def gain(row: dict) -> float:
    """A row's speedup (on / off): the median over repetitions, or the throughput ratio of a
    row that has only one number per arm."""
    if "speedup" in row:
        return row["speedup"]["median"]
    return row["spec"]["throughput"] / row["none"]["throughput"]


def gain_interval(row: dict) -> tuple[float, float]:
    if "speedup" in row:
        return row["speedup"]["lo"], row["speedup"]["hi"]
    g = gain(row)
    return g, g


def classify(row: dict) -> str:
    """'pays' (interval above 1), 'loses' (interval at or below 1) or 'unclear' (straddles 1)."""
    lo, hi = gain_interval(row)
    if lo > 1.0:
        return "pays"
    if hi <= 1.0:
        return "loses"
    return "unclear"


def crossover(rows: list[dict]) -> float | None:
    """First batch size where speculation's throughput <= plain's, log-interpolated; None if never.
    Uses each row's median speedup over repetitions (see `gain`)."""
    prev = None
    for r in rows:
        g = gain(r)
        if g <= 1.0:
            if prev is None:
                return float(r["batch"])
            b0, g0 = prev
            x0, x1 = math.log2(b0), math.log2(r["batch"])
            t = (g0 - 1.0) / (g0 - g) if g0 != g else 1.0
            return 2 ** (x0 + t * (x1 - x0))
        prev = (r["batch"], g)
    return None


def _short(row: dict) -> str:
    lo, hi = gain_interval(row)
    return f"{gain(row):.2f}x, interval {lo:.2f}-{hi:.2f}"


def _describe(row: dict) -> str:
    lo, hi = gain_interval(row)
    g = gain(row)
    n = row.get("repetitions", 1)
    return (f"batch {row['batch']}: {g:.2f}x, interval {lo:.2f}-{hi:.2f} over {n} repetitions "
            f"(noise +-{(hi - lo) / 2:.2f} vs effect {g - 1:+.2f})")


def undetermined(rows: list[dict], tolerance: float = 0.05) -> str | None:
    """Why the crossover cannot be told from these rows, or None when it can.

    With f the first point that clearly loses (or the end of the sweep) and p the last point
    before f that clearly pays: an unclear point before p means the crossover could lie before a
    size where speculation clearly pays (a noisy batch 1 switching speculation off everywhere);
    between p and f one unclear point is fine when a paying and a losing point bracket it (the
    crossover is between them; that is the sweep's resolution), and any unclear point whose
    interval stays within 1 +- tolerance is break-even either way. A point that clearly pays
    after one that clearly loses means the sweep does not cross once."""
    if not rows:
        return "no batch size was measured (out of memory at the smallest one?)"
    rows = sorted(rows, key=lambda r: r["batch"])
    cls = [classify(r) for r in rows]
    n = len(rows)
    first_loss = next((i for i, c in enumerate(cls) if c == "loses"), n)
    later_pay = [i for i in range(first_loss + 1, n) if cls[i] == "pays"]
    if later_pay:
        return (f"speculation clearly loses at batch {rows[first_loss]['batch']} "
                f"({_short(rows[first_loss])}) but clearly pays at batch "
                f"{rows[later_pay[0]]['batch']} ({_short(rows[later_pay[0]])}), so the sweep "
                f"does not cross 1 once")
    last_pay = max((i for i in range(first_loss) if cls[i] == "pays"), default=-1)

    def break_even(i: int) -> bool:
        lo, hi = gain_interval(rows[i])
        return lo >= 1.0 - tolerance and hi <= 1.0 + tolerance

    # before the last clearly paying size: an unclear point blocks unless it is break-even and
    # its median is above 1 (crossover() passes it by; below, it would stop there)
    before = [i for i in range(last_pay) if cls[i] == "unclear"
              and (not break_even(i) or gain(rows[i]) <= 1.0)]
    if before:
        i = before[0]
        j = next(j for j in range(i + 1, last_pay + 1) if cls[j] == "pays")
        return (f"noise exceeds the effect at {_describe(rows[i])}, but speculation clearly pays "
                f"at batch {rows[j]['batch']} ({_short(rows[j])})")
    band = [i for i in range(last_pay + 1, first_loss) if cls[i] == "unclear"]
    bracketed = len(band) == 1 and last_pay >= 0 and first_loss < n
    loose = [i for i in band if not break_even(i)]
    if band and not bracketed and loose:
        where = "; ".join(_describe(rows[i]) for i in loose)
        if len(band) > 1:
            side = (f"{len(band)} unclear sizes in a row between "
                    f"{'the start' if last_pay < 0 else 'batch ' + str(rows[last_pay]['batch'])} "
                    f"and {'the end' if first_loss == n else 'batch ' + str(rows[first_loss]['batch'])}")
        elif last_pay < 0 and first_loss < n:
            side = "no smaller size that clearly pays"
        elif first_loss == n and last_pay >= 0:
            side = ("no larger size that clearly loses (add one to calibrate.batch_sizes, e.g. "
                    f"{2 * rows[-1]['batch']})")
        else:
            side = "no size that clearly pays or loses"
        return f"noise exceeds the effect at {where}, with {side}"
    return None


def check_determined(rows: list[dict], tolerance: float = 0.05, what: str = "the schedule") -> None:
    """Raise NoisyCalibration (one line: the noise vs the effect, and what to do) when the
    crossover is undetermined by these rows."""
    why = undetermined(rows, tolerance)
    if why is not None:
        raise NoisyCalibration(
            f"calibrate: crossover undetermined, {why}; not writing {what}. Rerun with more "
            f"calibrate.repetitions and/or calibrate.min_requests, on a quieter machine (nothing "
            f"else using the cores)")


def schedule_for(cross: float | None, k: int, margin: float) -> list[dict]:
    if cross is None:
        return [{"up_to": None, "k": k}]
    on_up_to = math.floor((1 - margin) * cross)
    if on_up_to < 1:
        return [{"up_to": None, "k": 0}]
    return [{"up_to": on_up_to, "k": k}, {"up_to": None, "k": 0}]


def run_calibration(cfg: DictConfig, prompts: list[str], batch_sizes: list[int], new_tokens: int,
                    progress: Callable[[], None] = lambda: None, *, repetitions: int = 3,
                    min_requests: int = 4, warmup: int = 1) -> list[dict]:
    """The sweep: for each batch size, `warmup` untimed batches per arm, then `repetitions` timed
    runs of max(batch, min_requests) requests per arm, the arms alternating which goes first.
    `progress` is called once per batch size."""
    if cfg.proposer.name == "none":
        raise ConfigError("specflow calibrate compares speculation with plain decoding: pick a "
                          "proposer (proposer=draft or proposer=ngram)")
    if repetitions < 1 or min_requests < 1 or warmup < 0:
        raise ConfigError("calibrate.repetitions and calibrate.min_requests must be >= 1 and "
                          "calibrate.warmup >= 0")
    top = max(batch_sizes)
    cfg = resolved_copy(cfg)
    cfg.max_batch_size = top
    arms = {"none": Pipeline(_plain_cfg(cfg)), "spec": Pipeline(cfg)}
    count = max(top, min_requests)
    pool = (prompts * (count // len(prompts) + 1))[:count]
    rows = []
    for b in sorted(batch_sizes):
        n = max(b, min_requests)
        runs: dict[str, list[dict]] = {"none": [], "spec": []}
        t0 = time.perf_counter()
        # untimed, one full batch per arm: at the first size all new_tokens (lazy init, the KV
        # cache grown to its length), after that a short one (the new batch shape's first calls)
        warm_tokens = new_tokens if not rows else min(new_tokens, WARMUP_TOKENS)
        try:
            for _ in range(warmup):
                for pipe in arms.values():
                    pipe.generate(pool[:b], max_new_tokens=warm_tokens, max_batch_size=b)
            for rep in range(repetitions):
                order = ("none", "spec") if rep % 2 == 0 else ("spec", "none")
                for arm in order:
                    runs[arm].append(_measure(arms[arm], pool[:n], b, new_tokens))
        except RuntimeError as exc:          # out of memory: the sweep ends here
            if "out of memory" not in str(exc).lower():
                raise
            break
        if repetitions < 2 and runs["none"][0]["unit"] != "simulated":
            raise ConfigError("calibrate.repetitions=1 cannot tell noise from the effect on a "
                              "real clock; use calibrate.repetitions >= 3 (1 is for the synthetic "
                              "backend's simulated clock)")
        rows.append({**summarize_point(b, n, runs["none"], runs["spec"], warmup),
                     "wall_seconds": time.perf_counter() - t0})   # the point's cost, warm-up included
        progress()
    return rows


def write_calibrated(path: pathlib.Path, rows: list[dict], k: int, margin: float,
                     source: str, tolerance: float = 0.05) -> dict:
    """Write the schedule, unless the rows' noise leaves the crossover undetermined
    (NoisyCalibration, and nothing is written)."""
    check_determined(rows, tolerance, str(path))
    cross = crossover(rows)
    ranges = schedule_for(cross, k, margin)
    doc = {"name": "schedule", "ranges": ranges}
    reps = sorted({r.get("repetitions", 1) for r in rows})
    where = "none in the sweep" if cross is None else f"{cross:.1f} running sequences"
    header = (f"# Written by `specflow calibrate` ({source}).\n"
              f"# Crossover: {where};"
              f" speculation (k = {k}) up to (1 - {margin}) x crossover, off above.\n"
              f"# Speedup on/off per batch size, median [interval] over {'/'.join(map(str, reps))}"
              f" repetitions: " + ", ".join(
                  f"{r['batch']}: {gain(r):.2f} [{gain_interval(r)[0]:.2f}-{gain_interval(r)[1]:.2f}]"
                  for r in rows) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    from specflow.io import atomic_write_text
    atomic_write_text(path, header + yaml.safe_dump(doc, sort_keys=False))
    return {"crossover": cross, "ranges": ranges, "path": str(path)}
