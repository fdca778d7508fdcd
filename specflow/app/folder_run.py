"""Running a config into a folder: the one writer of requests.jsonl and metrics.json.

The folder is owned by this process for the whole run (a lock; a second process is refused), a
finished run there is replaced or kept as asked, an interrupted one is resumed (only the missing
requests are generated, with the same per-request seeds), and metrics.json is written last and
atomically: it marks a finished run. `specflow run` and every `specflow ab` job call `run_into`.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig

from specflow.io import write_or_explain


@dataclass
class FolderRun:
    """What a run into a folder produced."""

    folder: pathlib.Path
    rows: list[dict] = field(default_factory=list)   # every request's record, in prompt order
    stats: dict[str, Any] = field(default_factory=dict)   # the aggregate (metrics.json)
    resumed: int = 0                  # requests that came from an interrupted earlier run
    greedy: bool = True
    skipped: bool = False             # a finished run was found and kept (nothing ran)
    config: str | None = None         # the config fingerprint the records carry
    chat: bool = False                # the prompts were wrapped in the chat template


def run_into(cfg: DictConfig, folder: str | os.PathLike, *, owner: str, setting: str,
             rerun: str, progress: bool, replace_finished: bool,
             metrics_extra: dict[str, Any] | None = None,
             before_run: Callable[[str], None] | None = None,
             on_start: Callable[[int], None] | None = None,
             write_config: bool = False, warm_up: bool = False) -> FolderRun:
    """Generate the config's prompts into `folder` (requests.jsonl, then metrics.json).

    owner / setting: who holds the folder and the option that moves it (for the refusal line);
    rerun: how to resume, for messages (`rerun the same command ...`); replace_finished: a
    finished run in the folder is replaced (run) or kept and reported as skipped (ab);
    before_run(fingerprint): a check inside the lock before anything is generated, given the
    config's fingerprint (ab: the folder holds results of the same overrides);
    on_start(n): called with the number of prompts once the pipeline is built;
    warm_up: before the first timed request, the engine decodes a few tokens of a prompt of its
    own, untimed (specflow/app/warmup.py; `specflow ab` arms), unless nothing is left to run.
    """
    from omegaconf import OmegaConf

    from specflow.app.prompts import read_prompts
    from specflow.experiments.workloads import apply_chat_template, chat_mode
    from specflow.io import atomic_write_json, atomic_write_text, folder_lock
    from specflow.build import preflight
    from specflow.pipeline import Pipeline
    from specflow.resume import config_fingerprint, run_resumable

    out = pathlib.Path(folder)
    # this process owns the folder until metrics.json is written: a second run into it is
    # refused instead of interleaving its records with this one's
    with folder_lock(out, owner, setting):
        config = config_fingerprint(cfg)
        if before_run is not None:
            before_run(config)
        finished = (out / "metrics.json").exists()
        if finished and not replace_finished:
            return FolderRun(out, skipped=True, config=config)
        if cfg.get("engine", "specflow") == "vllm":     # an installed vLLM decodes the config
            from specflow.vllm.engine import run_on_vllm

            if finished:
                _clear(out)
            rows, stats, resumed, config = run_on_vllm(
                cfg, out, prompts=len(read_prompts(cfg)), rerun=rerun, on_start=on_start,
                write_config=write_config, metrics_extra=metrics_extra, warm_up=warm_up)
            return FolderRun(out, rows, stats, resumed, True, False, config)
        raw = read_prompts(cfg)
        preflight(cfg, raw)           # tokenizers and prompt lengths, before the weights load
        pipe = Pipeline(cfg)
        prompts = apply_chat_template(raw, pipe.tokenizer, chat_mode(cfg))
        chat = prompts != raw
        if finished:                        # a finished run here: this one replaces it
            _clear(out)
        if write_config:
            write_or_explain(out / "arm_config.yaml", atomic_write_text, OmegaConf.to_yaml(pipe.cfg), rerun)
        if on_start is not None:
            on_start(len(prompts))
        warm = None
        if warm_up:
            from specflow.app.warmup import warm_up_pipeline

            warm = warm_up_pipeline(pipe, chat_mode(cfg))
        rows, stats, resumed = run_resumable(pipe, prompts, out, progress=progress, rerun=rerun,
                                             warm_up=warm)
        write_or_explain(out / "metrics.json", atomic_write_json, {
            **(metrics_extra or {}), "config": config, "greedy": pipe.greedy, "chat_template": chat,
            "threads": pipe.threads,
            "packed": pipe.packed, "draft_packed": pipe.draft_packed, "kernels": pipe.kernels,
            "backends": pipe.backends,
            "aggregate": stats,
            "resumed_requests": resumed, "requests": [r["stats"] for r in rows]}, rerun, len(rows))
    return FolderRun(out, rows, stats, resumed, pipe.greedy, False, config, chat)


def _clear(out: pathlib.Path) -> None:
    for name in ("requests.jsonl", "metrics.json"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(out / name)
