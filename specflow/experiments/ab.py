"""`specflow ab experiment=NAME`: one Hydra multirun job per (repetition, arm).

The sweep is `ab.rep=0..R-1 ab.arm=<arms>` with the arm varying fastest, so within every repetition
each arm runs once, in turn: machine drift hits every arm alike. Every job composes the experiment
plus its arm's overrides, decodes the same prompts in the same order (seed + 1000 x rep, the same
for every arm), and writes into ab/<name>/<arm>/rep<r>/: the arm's composed config, one JSON line
per finished request (flushed as it finishes) and metrics.json, written last and atomically: a job
whose metrics.json exists is finished and is skipped when the command is run again, and an
interrupted job generates only the requests its requests.jsonl lacks (specflow/app/folder_run.py
and specflow/resume.py). Both record the fingerprint of the arm's config, so a rerun with other
overrides is refused instead of skipping (or mixing in) results of another configuration; a job
folder is held by one process at a time (specflow.io.folder_lock).
"""
from __future__ import annotations

import json
import os
import pathlib
import re

from omegaconf import DictConfig

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
    reps = ab.repetitions
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ConfigError(f"ab.repetitions={reps!r} must be a whole number >= 1")
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


def run_job(cfg: DictConfig, task_overrides: list[str], out: str | os.PathLike, *,
            on_start=None, progress: bool = False):
    """One (repetition, arm) job into its folder: the arm's config composed from the command's
    overrides, refused when the folder holds results of other overrides, skipped when finished.
    Returns the app layer's FolderRun; raises SpecflowError and never prints."""
    from specflow.app.folder_run import run_into
    from specflow.config import compose

    arm_cfg = compose(job_overrides(task_overrides, cfg))
    return run_into(
        arm_cfg, out, owner="specflow ab", setting="hydra.sweep.dir",
        rerun="rerun the same command", progress=progress, replace_finished=False,
        before_run=lambda fingerprint: check_rerun(pathlib.Path(out), fingerprint),
        on_start=on_start, write_config=True, warm_up=True,
        metrics_extra={"experiment": str(cfg.ab.name), "arm": str(cfg.ab.arm),
                       "rep": int(cfg.ab.rep), "arms": [str(a) for a in cfg.ab.arms],
                       "baseline": str(cfg.ab.baseline)})
