"""`specflow ab experiment=NAME`: one Hydra multirun job per (repetition, arm).

The sweep is `ab.rep=0..R-1 ab.arm=<arms>` with the arm varying fastest, so within every repetition
each arm runs once, in turn: machine drift hits every arm alike. Every job composes the experiment
plus its arm's overrides, decodes the same prompts in the same order (seed + 1000 x rep, the same
for every arm), and writes into ab/<name>/<arm>/rep<r>/: the arm's composed config, one JSON line
per finished request (flushed as it finishes) and metrics.json, written last and atomically: a
job whose metrics.json exists is finished and is skipped when the command is run again, and an
interrupted job generates only the requests its requests.jsonl lacks (specflow/resume.py).
"""
from __future__ import annotations

import os
import pathlib
import re

from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError

QUIET_ENV = "SPECFLOW_QUIET"
ARM_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_experiment(cfg: DictConfig) -> DictConfig:
    ab = cfg.get("ab")
    if ab is None or not ab.get("name"):
        raise ConfigError("specflow ab needs an experiment that names its arms: "
                          "specflow ab experiment=<name> (see conf/experiment/)")
    arms = dict(ab.arms or {})
    if len(arms) < 2:
        raise ConfigError(f"experiment {ab.name!r} has {len(arms)} arm(s); an A/B needs at least 2")
    bad = [a for a in arms if not ARM_NAME.match(str(a))]
    if bad:
        raise ConfigError(f"arm names {bad} must be letters, digits, '_', '-' or '.'")
    if ab.baseline not in arms:
        raise ConfigError(f"ab.baseline={ab.baseline!r} is not one of the arms "
                          f"({', '.join(arms)})")
    if int(ab.repetitions) < 1:
        raise ConfigError(f"ab.repetitions={ab.repetitions} must be >= 1")
    return ab


def sweep_overrides(ab: DictConfig) -> list[str]:
    reps = ",".join(str(r) for r in range(int(ab.repetitions)))
    return [f"ab.rep={reps}", f"ab.arm={','.join(str(a) for a in ab.arms)}",
            "hydra.sweep.subdir=${ab.arm}/rep${ab.rep}"]


def job_overrides(task_overrides: list[str], cfg: DictConfig) -> list[str]:
    """This job's config: the command's overrides without the sweep keys, then the arm's."""
    keep = [o for o in task_overrides if not o.startswith(("ab.arm=", "ab.rep=", "hydra."))]
    arm = list(cfg.ab.arms[cfg.ab.arm])
    return [*keep, *arm, f"seed={int(cfg.seed) + 1000 * int(cfg.ab.rep)}"]


def run_job(cfg: DictConfig) -> None:
    """One (repetition, arm) job inside the Hydra multirun; a user error ends the sweep with one
    line and exit status 2 (not Hydra's multirun traceback)."""
    from specflow.cli import fail
    from specflow.errors import SpecflowError

    try:
        _run_job(cfg)
    except SpecflowError as exc:
        raise SystemExit(fail(f"{cfg.ab.name}, arm {cfg.ab.arm}, repetition {cfg.ab.rep}: {exc}"))


def _run_job(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from specflow.cli import chat_mode, interrupt_message, read_prompts
    from specflow.config import compose
    from specflow.console import console
    from specflow.experiments.workloads import apply_chat_template
    from specflow.io import atomic_write_json, atomic_write_text
    from specflow.pipeline import Pipeline
    from specflow.resume import run_resumable

    hc = HydraConfig.get()
    out = pathlib.Path(hc.runtime.output_dir)
    label = f"{cfg.ab.name}: arm {cfg.ab.arm}, repetition {cfg.ab.rep}"
    quiet = os.environ.get(QUIET_ENV) == "1"
    if (out / "metrics.json").exists():
        if not quiet:
            console.print(f"[dim]{label}: finished earlier, skipped[/]")
        return
    arm_cfg = compose(job_overrides(list(hc.overrides.task), cfg))
    pipe = Pipeline(arm_cfg)
    prompts = apply_chat_template(read_prompts(arm_cfg), pipe.tokenizer, chat_mode(arm_cfg))
    atomic_write_text(out / "arm_config.yaml", OmegaConf.to_yaml(pipe.cfg))
    if not quiet:
        console.print(f"{label}: {len(prompts)} prompts")
    with interrupt_message(str(out), "rerun the same command"):
        rows, stats, resumed = run_resumable(pipe, prompts, out,
                                             progress=not quiet and console.is_terminal)
    atomic_write_json(out / "metrics.json", {
        "experiment": str(cfg.ab.name), "arm": str(cfg.ab.arm), "rep": int(cfg.ab.rep),
        "arms": [str(a) for a in cfg.ab.arms], "baseline": str(cfg.ab.baseline),
        "greedy": pipe.greedy, "aggregate": stats, "resumed_requests": resumed,
        "requests": [r["stats"] for r in rows]})
    if not quiet:
        s = stats
        console.print(f"[dim]{label}: {s['num_committed_tokens']} tokens, "
                      f"{s['tokens_per_second']:.1f} tokens/s, α {s['alpha']:.3f}[/]")
