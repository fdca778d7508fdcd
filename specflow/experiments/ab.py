"""`specflow ab experiment=NAME`: one Hydra multirun job per (repetition, arm).

The sweep is `ab.rep=0..R-1 ab.arm=<arms>` with the arm varying fastest, so within every repetition
each arm runs once, in turn: machine drift hits every arm alike. Every job composes the experiment
plus its arm's overrides, decodes the same prompts in the same order (seed + 1000 x rep, the same
for every arm), and writes into ab/<name>/<arm>/rep<r>/: the arm's composed config, one JSON line
per finished request (flushed as it finishes) and metrics.json, written last and atomically: a
job whose metrics.json exists is finished and is skipped when the command is run again, and an
interrupted job generates only the requests its requests.jsonl lacks (specflow/resume.py). Both
record the fingerprint of the arm's config, so a rerun with other overrides is refused instead
of skipping (or mixing in) results of another configuration; a job folder is held by one process
at a time (specflow.io.folder_lock).
"""
from __future__ import annotations

import json
import os
import pathlib
import re

from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError, InputError

QUIET_ENV = "SPECFLOW_QUIET"
ARM_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_experiment(cfg: DictConfig) -> DictConfig:
    ab = cfg.get("ab")
    if ab is None or not ab.get("name"):
        raise ConfigError("specflow ab needs an experiment that names its arms: "
                          "specflow ab experiment=<name> (see conf/experiment/)")
    if not _plain_name(ab.name):      # it names the folder ab/<name>: nothing outside ab/
        raise ConfigError(f"ab.name={ab.name!r} must be a plain folder name (letters, digits, '_', "
                          f"'-' or '.', not '.' or '..'); it names the folder ab/<name>: "
                          f"e.g. ab.name=my_experiment")
    arms = dict(ab.arms or {})
    if len(arms) < 2:
        raise ConfigError(f"experiment {ab.name!r} has {len(arms)} arm(s); an A/B needs at least 2")
    bad = [a for a in arms if not _plain_name(a)]
    if bad:
        raise ConfigError(f"arm names {bad} must be letters, digits, '_', '-' or '.' (not '.' or "
                          f"'..'); each names a folder of the sweep")
    if ab.baseline not in arms:
        raise ConfigError(f"ab.baseline={ab.baseline!r} is not one of the arms "
                          f"({', '.join(arms)})")
    if int(ab.repetitions) < 1:
        raise ConfigError(f"ab.repetitions={ab.repetitions} must be >= 1")
    return ab


def _plain_name(name) -> bool:
    return bool(ARM_NAME.match(str(name))) and str(name) not in (".", "..")


def sweep_overrides(ab: DictConfig) -> list[str]:
    reps = ",".join(str(r) for r in range(int(ab.repetitions)))
    return [f"ab.rep={reps}", f"ab.arm={','.join(str(a) for a in ab.arms)}",
            "hydra.sweep.subdir=${ab.arm}/rep${ab.rep}"]


def job_overrides(task_overrides: list[str], cfg: DictConfig, arm=None, rep=None) -> list[str]:
    """This job's config: the command's overrides without the sweep keys, then the arm's
    (arm and rep: those of cfg.ab unless given, for checking a job before the sweep runs)."""
    arm = cfg.ab.arm if arm is None else arm
    rep = cfg.ab.rep if rep is None else rep
    keep = [o for o in task_overrides if not o.startswith(("ab.arm=", "ab.rep=", "hydra."))]
    return [*keep, *list(cfg.ab.arms[arm]), f"seed={int(cfg.seed) + 1000 * int(rep)}"]


def recorded_config(job: pathlib.Path) -> str | None:
    """The config fingerprint a job folder's results were made with: its metrics.json's, else its
    first request record's (jobs finished before metrics.json recorded it); None if neither."""
    try:
        recorded = json.loads((job / "metrics.json").read_text(encoding="utf-8")).get("config")
        if recorded:
            return str(recorded)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        with open(job / "requests.jsonl", encoding="utf-8") as fh:
            row = json.loads(fh.readline())
        return str(row["config"]) if isinstance(row, dict) and row.get("config") else None
    except (OSError, ValueError):
        return None


def check_rerun(job: pathlib.Path, config: str) -> None:
    """Refuse to resume (or skip) a job folder whose results were made with another config."""
    recorded = recorded_config(job)
    if recorded is not None and recorded != config:
        raise InputError(f"{job} holds results of other overrides (config {recorded}, now "
                         f"{config}); rerun with the overrides it was run with to resume it, or "
                         f"choose a new hydra.sweep.dir=... (or ab.name=...)")


def check_sweep(cfg: DictConfig, task_overrides: list[str], sweep_dir: str) -> None:
    """Before the sweep runs: every job folder that already holds results must have been made
    with this command's config (check_rerun); nothing runs otherwise."""
    from specflow.config import compose
    from specflow.resume import config_fingerprint

    ab = cfg.ab
    for rep in range(int(ab.repetitions)):
        for arm in ab.arms:
            job = pathlib.Path(sweep_dir) / str(arm) / f"rep{rep}"
            if recorded_config(job) is None:
                continue
            arm_cfg = compose(job_overrides(task_overrides, cfg, arm, rep))
            try:
                check_rerun(job, config_fingerprint(arm_cfg))
            except InputError as exc:
                raise InputError(f"{ab.name}, arm {arm}, repetition {rep}: {exc}") from None


def run_job(cfg: DictConfig) -> None:
    """One (repetition, arm) job inside the Hydra multirun; a user error ends the sweep with one
    line and exit status 2 (not Hydra's multirun traceback)."""
    from specflow.cli import fail
    from specflow.errors import SpecflowError

    try:
        _run_job(cfg)
    except SpecflowError as exc:
        raise SystemExit(fail(f"{cfg.ab.name}, arm {cfg.ab.arm}, repetition {cfg.ab.rep}: {exc}")) from None


def _run_job(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from specflow.cli import chat_mode, interrupt_message, read_prompts
    from specflow.config import compose
    from specflow.console import console
    from specflow.experiments.workloads import apply_chat_template
    from specflow.io import atomic_write_json, atomic_write_text, folder_lock
    from specflow.pipeline import Pipeline
    from specflow.resume import config_fingerprint, run_resumable

    hc = HydraConfig.get()
    out = pathlib.Path(hc.runtime.output_dir)
    label = f"{cfg.ab.name}: arm {cfg.ab.arm}, repetition {cfg.ab.rep}"
    quiet = os.environ.get(QUIET_ENV) == "1"
    with folder_lock(out, "specflow ab", "hydra.sweep.dir"):
        arm_cfg = compose(job_overrides(list(hc.overrides.task), cfg))
        config = config_fingerprint(arm_cfg)
        check_rerun(out, config)
        if (out / "metrics.json").exists():
            if not quiet:
                console.print(f"[dim]{label}: finished earlier, skipped[/]")
            return
        pipe = Pipeline(arm_cfg)
        prompts = apply_chat_template(read_prompts(arm_cfg), pipe.tokenizer, chat_mode(arm_cfg))
        _write(out / "arm_config.yaml", atomic_write_text, OmegaConf.to_yaml(pipe.cfg))
        if not quiet:
            console.print(f"{label}: {len(prompts)} prompts")
        with interrupt_message(str(out), "rerun the same command"):
            rows, stats, resumed = run_resumable(pipe, prompts, out,
                                                 progress=not quiet and console.is_terminal,
                                                 rerun="rerun the same command")
        _write(out / "metrics.json", atomic_write_json, {
            "experiment": str(cfg.ab.name), "arm": str(cfg.ab.arm), "rep": int(cfg.ab.rep),
            "arms": [str(a) for a in cfg.ab.arms], "baseline": str(cfg.ab.baseline),
            "config": config, "greedy": pipe.greedy, "aggregate": stats,
            "resumed_requests": resumed, "requests": [r["stats"] for r in rows]})
    if not quiet:
        s = stats
        console.print(f"[dim]{label}: {s['num_committed_tokens']} tokens, "
                      f"{s['tokens_per_second']:.1f} tokens/s, α {s['alpha']:.3f}[/]")


def _write(path: pathlib.Path, writer, content) -> None:
    try:
        writer(path, content)
    except OSError as exc:              # a full disk: the finished requests stay where they are
        raise InputError(f"cannot write {path} ({exc.strerror or exc}); the requests finished so "
                         f"far are kept in {path.parent}/requests.jsonl: free some space, then "
                         f"rerun the same command to resume") from None
