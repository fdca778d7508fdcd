"""How many CPU threads torch uses for a CPU run: `threads: auto | N` in the root config.

On a quiet machine more threads make a decoding pass faster. With another process busy on one
of the cores, OpenMP's spinning barriers make the same threads collapse, far below one thread's
speed (docs/decisions.md, "Measured on this project's machines"), and every small op of a draft
step pays it. `auto` therefore times the target's one-position pass with the threads
torch would use and with one thread, when the pipeline is built, and keeps the faster; the
choice is printed in metrics.json (`threads`) and Pipeline.threads. It is decided once: contention that starts
later is not followed (set `threads=1` on a machine shared with other work).
"""
from __future__ import annotations

import statistics
import time

import torch


def pass_seconds(backend, reps: int = 5, positions: int = 1, rows: int = 1) -> float:
    """Median seconds of a pass over `positions` positions in each of `rows` rows (slots
    0..rows-1, each after 32 cached tokens; the slots are reset)."""
    slots = torch.arange(rows)
    for s in range(rows):
        backend.reset(s)
    backend.forward(slots, torch.ones(rows, 32, dtype=torch.long), torch.full((rows,), 32),
                    logits=False)
    times = []
    for i in range(reps + 2):
        backend.truncate(slots, [32] * rows)
        start = time.perf_counter()
        backend.forward(slots, torch.ones(rows, positions, dtype=torch.long),
                        torch.full((rows,), positions))
        if i >= 2:
            times.append(time.perf_counter() - start)
    for s in range(rows):
        backend.reset(s)
    return statistics.median(times)


# torch's own choice for this process (all cores), before any pipeline set another
DEFAULT_THREADS = torch.get_num_threads()


def choose_threads(setting, backend) -> int:
    """Apply `threads` (an int, or "auto") for a CPU backend; return the threads in use.

    auto compares DEFAULT_THREADS with one, whatever an earlier pipeline set. Only backends with
    the lean forward on a CPU are timed (their passes are real and cheap); for others auto leaves
    torch's setting as it is.
    A changed count re-picks the lean forward's product forms, which were timed at the old one.
    """
    if setting != "auto":
        chosen = int(setting)
    elif DEFAULT_THREADS == 1 or backend.device.type != "cpu" \
            or getattr(backend, "lean", None) is None:
        return torch.get_num_threads()       # nothing to time: leave the setting alone
    else:
        timed = {}
        for n in (DEFAULT_THREADS, 1):
            torch.set_num_threads(n)
            timed[n] = pass_seconds(backend)
        chosen = min(timed, key=timed.get)
    torch.set_num_threads(chosen)
    lean = getattr(backend, "lean", None)
    if lean is not None:
        lean.repick()
    return chosen
