"""The `trace` observer: times every stage hook with pluggy ``wrapper=True`` implementations.

A wrapper sees each call of its hook around all of that hook's implementations, so the time of a
stage is measured where the pipeline calls it, whatever plugin implements it. The trace has three
kinds of tracks (Perfetto / chrome://tracing):

    rounds   one span per round (args: batch size, drafts, accepted, committed)
    stages   one span per hook call; shaping calls are labelled [draft] or [target], and the
             draft's shaping nests inside `propose`
    slot N   one span per request that held batch slot N (admission to finish)

At the end of every ``generate`` call it writes ``trace.json`` and a per-stage table (inclusive
times: a nested call counts in its parent too) to ``trace_table.md`` and the console.
"""
from __future__ import annotations

import os
import pathlib
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from specflow import ConfigError, atomic_write_json, atomic_write_text, hookimpl

ROUNDS_TID, STAGES_TID, SLOT_TID0 = 1, 2, 100


@dataclass
class TraceConfig:
    name: str = "trace"
    path: str = "trace.json"     # relative: in the run's output folder (Hydra's), else the cwd
    table: bool = True           # print the per-stage table at the end of each run
    max_events: int = 500_000    # spans kept in trace.json; later ones only count in the table
    sync_cuda: bool = False      # torch.cuda.synchronize() around each span (true GPU times)

    def __post_init__(self) -> None:
        if not self.path.endswith(".json"):
            raise ConfigError(f"observer.trace.path={self.path!r} must end in .json "
                              f"(Chrome trace format), e.g. trace.json")
        if self.max_events < 0:
            raise ConfigError(f"observer.trace.max_events={self.max_events} must be >= 0")


def output_dir() -> pathlib.Path:
    """Hydra's run folder inside a `specflow` command, the working directory elsewhere."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return pathlib.Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        return pathlib.Path.cwd()


class Tracer:
    def __init__(self, cfg: TraceConfig, ctx=None):
        self.cfg = cfg
        self.sync = cfg.sync_cuda and _cuda_available()
        self.pid = os.getpid()
        self._reset()

    def _reset(self) -> None:
        self.t0 = time.perf_counter_ns()
        self.events: list[dict] = []
        self.dropped = 0
        self.totals: dict[str, list[int]] = {}       # span name -> [calls, total ns]
        self.round_start: int | None = None
        self.slot_start: dict[int, tuple[int, int]] = {}   # slot -> (start ns, request id)
        self.wall_ns = 0

    # --- recording -----------------------------------------------------------------------

    def _now(self) -> int:
        if self.sync:
            import torch
            torch.cuda.synchronize()
        return time.perf_counter_ns()

    def _emit(self, name: str, tid: int, start: int, end: int, **args) -> None:
        if len(self.events) >= self.cfg.max_events:
            self.dropped += 1
            return
        self.events.append({"name": name, "ph": "X", "pid": self.pid, "tid": tid,
                            "ts": (start - self.t0) / 1000, "dur": (end - start) / 1000,
                            **({"args": args} if args else {})})

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            calls_ns = self.totals.setdefault(name, [0, 0])
            calls_ns[0] += 1
            calls_ns[1] += end - start
            self._emit(name, STAGES_TID, start, end)

    # --- stage hooks: wrappers around every implementation -------------------------------

    @hookimpl(wrapper=True)
    def specflow_draft_length(self):
        self.round_start = self._now()
        with self.span("policy"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_node_price(self):
        with self.span("node_price"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_propose(self):
        with self.span("propose"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_score(self):
        with self.span("target"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_process_logits(self, shaping):
        with self.span(f"process_logits [{shaping.source}]"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_mask_logits(self, shaping):
        with self.span(f"mask_logits [{shaping.source}]"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_verify(self):
        with self.span("verify"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_trim(self):
        with self.span("trim"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_sync_cache(self):
        with self.span("sync_cache"):
            return (yield)

    @hookimpl(wrapper=True)
    def specflow_observe(self):
        with self.span("observe"):
            return (yield)

    # --- lifecycle -------------------------------------------------------------------------

    @hookimpl(wrapper=True)
    def specflow_request_start(self, slot, request):
        self.slot_start[slot] = (self._now(), request.request_id)
        with self.span("prefill"):      # stages reset per-slot state; the target prefills
            return (yield)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        start, rid = self.slot_start.pop(slot, (self._now(), request.request_id))
        self._emit(f"request {rid}", SLOT_TID0 + slot, start, self._now(),
                   finish_reason=finish_reason, prompt_tokens=len(request.prompt_ids))

    @hookimpl
    def specflow_round_end(self, result, pipeline):
        if self.round_start is None:
            return
        self._emit(f"round {result.round_index}", ROUNDS_TID, self.round_start, self._now(),
                   batch_size=result.batch_size, drafts=sum(result.num_drafts),
                   accepted=sum(result.num_accepted),
                   committed=sum(len(c) for c in result.committed))
        self.round_start = None

    @hookimpl
    def specflow_run_start(self, pipeline, requests):
        self._reset()

    @hookimpl
    def specflow_run_end(self, pipeline, results, stats):
        self.wall_ns = time.perf_counter_ns() - self.t0
        path = pathlib.Path(self.cfg.path)
        path = path if path.is_absolute() else output_dir() / path
        atomic_write_json(path, self.chrome_trace())
        table = path.with_name(path.stem + "_table.md")
        atomic_write_text(table, self.markdown_table())
        if self.cfg.table and os.environ.get("SPECFLOW_QUIET") != "1":
            from rich.console import Console
            Console(stderr=True).print(self.rich_table())
            Console(stderr=True).print(f"[dim]trace: {path} (open in https://ui.perfetto.dev), "
                                       f"table: {table}[/]")
        self.written = path

    # --- outputs ---------------------------------------------------------------------------

    def chrome_trace(self) -> dict:
        names = {ROUNDS_TID: "rounds", STAGES_TID: "stages"}
        names.update({SLOT_TID0 + s: f"slot {s}" for s in {e["tid"] - SLOT_TID0 for e in self.events
                                                           if e["tid"] >= SLOT_TID0}})
        meta = [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                 "args": {"name": name}} for tid, name in sorted(names.items())]
        meta += [{"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": tid,
                  "args": {"sort_index": tid}} for tid in sorted(names)]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                "otherData": {"producer": "specflow-trace", "dropped_events": self.dropped,
                              "wall_ms": self.wall_ns / 1e6}}

    def rows(self) -> list[tuple[str, int, float, float, float]]:
        """(stage, calls, total ms, mean µs, share of the run's wall time %), slowest first."""
        wall = max(self.wall_ns, 1)
        out = [(name, calls, ns / 1e6, ns / calls / 1e3, 100 * ns / wall)
               for name, (calls, ns) in self.totals.items()]
        return sorted(out, key=lambda r: -r[2])

    def markdown_table(self) -> str:
        lines = [f"# specflow-trace: per-stage time (wall {self.wall_ns / 1e6:.1f} ms)", "",
                 "Inclusive times: draft shaping runs inside propose.", "",
                 "| stage | calls | total ms | mean µs | % of wall |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {c} | {t:.2f} | {m:.1f} | {p:.1f} |" for n, c, t, m, p in self.rows()]
        return "\n".join(lines) + "\n"

    def rich_table(self):
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"per-stage time (wall {self.wall_ns / 1e6:.1f} ms; inclusive)")
        for col in ("stage", "calls", "total ms", "mean µs", "% of wall"):
            table.add_column(col, justify="left" if col == "stage" else "right")
        for n, c, t, m, p in self.rows():
            table.add_row(escape(n), str(c), f"{t:.2f}", f"{m:.1f}", f"{p:.1f}")
        return table


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:   # pragma: no cover
        return False
