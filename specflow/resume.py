"""Resuming an interrupted run: what finished, what is left, and the metrics of all sessions.

`requests.jsonl` gets one line per finished request, flushed as it finishes, so Ctrl-C (or a
crash) keeps every finished request. A rerun into the same folder reads those lines, drops a line
torn by the interruption, checks that they were written for the same prompts, and generates only
the rest with the same per-request indices (and so the same seeds): greedy output is what an
uninterrupted run gives, and so is sampled output when a request's draft lengths do not depend on
the other requests. Records written with another config are refused. metrics.json, written last,
marks a finished run.

Each line also carries its session's stage seconds so far (`session`, `session_seconds`,
`session_sim_time`). The merged aggregate counts every finished request exactly and charges each
earlier session the time up to its last finished request: exact at batch size 1, an upper bound
when requests that were cut off shared rounds with finished ones.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import uuid
from typing import Any, Callable, Sequence

from specflow.errors import InputError
from specflow.io import atomic_write_text
from specflow.metrics import Counters


ADDED_SINCE = {"engine": "specflow", "model.graphs": False, "draft.graphs": False}


def config_fingerprint(cfg) -> str:
    """What a request's output depends on: the composed config without display-only keys."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in ("show_progress", "hydra"):
        plain.pop(key, None)
    # settings added later, at their defaults, leave the fingerprint as it was before they
    # existed: an earlier run's folder still resumes (and an earlier sweep's jobs are kept)
    for path, default in ADDED_SINCE.items():
        *parents, key = path.split(".")
        node = plain
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node and node[key] == default:
            del node[key]
    if "engine" not in plain:
        plain.pop("vllm", None)           # engine=vllm's settings, read by no specflow run
    return hashlib.sha1(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:16]


def finished_requests(path: str | os.PathLike, prompts: Sequence[str],
                      config: str | None = None) -> dict[int, dict]:
    """The finished requests already in `path` (by index); rewrites the file without a torn line.

    Records written with another config (`config` fingerprint) or for other prompts are refused:
    mixing them would make a result no single run produces.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return {}
    done: dict[int, dict] = {}
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for n, line in enumerate(lines):
        try:
            row = json.loads(line)
            index = int(row["index"])
        except (ValueError, KeyError, TypeError):
            if n == len(lines) - 1:      # the line being written when the run stopped
                break
            raise InputError(f"{path} line {n + 1} is not a request record; move the file away "
                             f"or choose another output folder") from None
        if index >= len(prompts) or row.get("prompt") != prompts[index]:
            raise InputError(f"{path} was written for other prompts (request {index} differs); "
                             f"use a new output folder (hydra.run.dir=...) for these prompts")
        if config is not None and row.get("config", config) != config:
            raise InputError(f"{path} was written with another config (request {index}); rerun "
                             f"with the same overrides to resume, or use a new output folder")
        done[index] = row
    if len(done) < len(lines) or (text and not text.endswith("\n")):   # torn: append cleanly
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in done.values()))
    return done


def session_tagger(pipe, config: str) -> Callable[[Any], dict]:
    """result -> its JSON line, tagged with the config fingerprint and this session's stage
    seconds so far."""
    session = uuid.uuid4().hex[:12]

    def tag(result) -> dict:
        total = pipe.recorder.total
        return {**result.to_json(), "config": config, "session": session,
                "session_seconds": dict(total.seconds), "session_sim_time": dict(total.sim_time)}

    return tag


def merged_stats(earlier: Sequence[dict], now: dict) -> dict:
    """The aggregate over earlier sessions' finished requests and this session's run."""
    total = Counters.from_dict(now)
    last_of_session: dict[str, dict] = {}
    for row in earlier:
        total.add_counts(Counters.from_dict(row.get("stats", {})))
        sid = row.get("session", "?")
        seconds = sum(row.get("session_seconds", {}).values())
        if sid not in last_of_session or seconds > sum(last_of_session[sid].get(
                "session_seconds", {}).values()):
            last_of_session[sid] = row
    for row in last_of_session.values():
        total.add_seconds(row.get("session_seconds", {}))
        for key, value in row.get("session_sim_time", {}).items():
            total.sim_time[key] = total.sim_time.get(key, 0.0) + value
    out = total.as_dict()
    out["sessions"] = len(last_of_session) + 1
    return out


def run_resumable(pipe, prompts: Sequence[str], out: str | os.PathLike, progress: bool,
                  rerun: str = "rerun into the same folder",
                  warm_up: Callable[[int], Any] | None = None) -> tuple[list[dict], dict, int]:
    """Generate what is not yet in out/requests.jsonl (appending as requests finish).

    warm_up(n): called with the number of requests left, untimed, just before they are generated
    (an A/B arm's warm-up, specflow/app/warmup.py); not called when none are left.
    Returns (every request's record in prompt order, the aggregate stats, how many were resumed).
    A write that fails (a full disk) raises an InputError naming the file: the records written
    before it are kept, and `rerun` (how to resume, for the message) generates the rest.
    """
    from specflow.io import JsonlWriter

    path = pathlib.Path(out) / "requests.jsonl"
    config = config_fingerprint(pipe.cfg)
    done = finished_requests(path, prompts, config)
    todo = [i for i in range(len(prompts)) if i not in done]
    tag = session_tagger(pipe, config)
    if not todo:
        stats = merged_stats(list(done.values()), Counters().as_dict())
        stats["sessions"] -= 1          # nothing ran in this one
        return [done[i] for i in range(len(prompts))], stats, len(done)
    written = 0

    def failed(exc: OSError) -> InputError:
        return InputError(f"cannot write {path} ({exc.strerror or exc}); the {len(done) + written} "
                          f"requests finished before that are kept there: free some space, then "
                          f"{rerun} to resume")

    def write(result) -> None:
        nonlocal written
        try:
            sink.write(tag(result))
        except OSError as exc:          # passes through generate() as a SpecflowError
            raise failed(exc) from None
        written += 1

    if warm_up is not None:
        warm_up(len(todo))
    try:
        with JsonlWriter(path, append=bool(done)) as sink:
            results = pipe.generate([prompts[i] for i in todo], indices=todo, progress=progress,
                                    on_result=write)
    except OSError as exc:              # opening or closing the file
        raise failed(exc) from None
    rows = dict(done)
    rows.update({r.index: r.to_json() for r in results})
    stats = (merged_stats(list(done.values()), pipe.last_stats) if done
             else {**pipe.last_stats, "sessions": 1})
    return [rows[i] for i in range(len(prompts))], stats, len(done)
