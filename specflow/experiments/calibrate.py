"""`specflow calibrate`: where speculation stops paying on this model pair and this machine.

A load sweep over batch sizes with speculation on (the configured proposer and policy) and off
(proposer=none), interleaved per batch size: decode throughput (prefill is the same in both arms
and is left out) and per-token latency p50 / p95 per request. The crossover is the batch size where
speculation's throughput falls to plain decoding's (interpolated on a log scale between the two
measured sizes around it). The result is a `schedule` policy that keeps k up to (1 - margin) x the
crossover and switches speculation off above, written as `policy/calibrated.yaml`.
"""
from __future__ import annotations

import math
import os
import pathlib
import statistics
import time
from typing import Callable

import yaml
from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError
from specflow.pipeline import Pipeline

from specflow.config import CONFIG_PATH_ENV


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
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    plain.proposer = {"name": "none", "k": 0}
    plain.policy = {"name": "static", "k": 0}
    return plain


def _measure(pipe: Pipeline, prompts: list[str], batch: int, new_tokens: int) -> dict:
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
    per_token.sort()
    return {"tokens": tokens, "time": decode, "unit": unit, "throughput": tokens / decode,
            "latency_p50": statistics.median(per_token),
            "latency_p95": per_token[min(len(per_token) - 1, math.ceil(0.95 * len(per_token)) - 1)],
            "alpha": s["alpha"]}


def crossover(rows: list[dict]) -> float | None:
    """First batch size where speculation's throughput <= plain's, log-interpolated; None if never."""
    prev = None
    for r in rows:
        gain = r["spec"]["throughput"] / r["none"]["throughput"]
        if gain <= 1.0:
            if prev is None:
                return float(r["batch"])
            b0, g0 = prev
            x0, x1 = math.log2(b0), math.log2(r["batch"])
            t = (g0 - 1.0) / (g0 - gain) if g0 != gain else 1.0
            return 2 ** (x0 + t * (x1 - x0))
        prev = (r["batch"], gain)
    return None


def schedule_for(cross: float | None, k: int, margin: float) -> list[dict]:
    if cross is None:
        return [{"up_to": None, "k": k}]
    on_up_to = math.floor((1 - margin) * cross)
    if on_up_to < 1:
        return [{"up_to": None, "k": 0}]
    return [{"up_to": on_up_to, "k": k}, {"up_to": None, "k": 0}]


def run_calibration(cfg: DictConfig, prompts: list[str], batch_sizes: list[int], new_tokens: int,
                    progress: Callable[[], None] = lambda: None) -> list[dict]:
    if cfg.proposer.name == "none":
        raise ConfigError("specflow calibrate compares speculation with plain decoding: pick a "
                          "proposer (proposer=draft or proposer=ngram)")
    top = max(batch_sizes)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.max_batch_size = top
    spec = Pipeline(cfg)
    plain = Pipeline(_plain_cfg(cfg))
    pool = (prompts * (top // len(prompts) + 1))[:top]
    rows = []
    for b in sorted(batch_sizes):
        try:
            row = {"batch": b, "none": _measure(plain, pool[:b], b, new_tokens),
                   "spec": _measure(spec, pool[:b], b, new_tokens)}
        except RuntimeError as exc:          # out of memory: the sweep ends here
            if "out of memory" not in str(exc).lower():
                raise
            break
        rows.append(row)
        progress()
    return rows


def write_calibrated(path: pathlib.Path, rows: list[dict], k: int, margin: float,
                     source: str) -> dict:
    cross = crossover(rows)
    ranges = schedule_for(cross, k, margin)
    doc = {"name": "schedule", "ranges": ranges}
    header = (f"# Written by `specflow calibrate` ({source}).\n"
              f"# Crossover: {'none in the sweep' if cross is None else f'{cross:.1f} running sequences'};"
              f" speculation (k = {k}) up to (1 - {margin}) x crossover, off above.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    from specflow.io import atomic_write_text
    atomic_write_text(path, header + yaml.safe_dump(doc, sort_keys=False))
    return {"crossover": cross, "ranges": ranges, "path": str(path)}
