"""How many CPU threads torch uses for a CPU run: `threads: auto | N` in the root config.

Private to the transformers backend: `HFBackend.tune` runs `plan` for the target
when the pipeline is built, and `HFBackend.describe` reports the choice (metrics.json `threads`).

On a quiet machine more threads make a decoding pass faster. With another process busy on one
of the cores, OpenMP's spinning barriers make the same threads collapse, far below one thread's
speed (docs/decisions.md, "Measured on this project's machines"), and every small op of a draft
step pays it. `auto` therefore times the target's one-position pass (`Backend.time_pass`) with
the threads torch would use and with one thread, in turns (backends/turns.py), and keeps the
faster. It is decided once: contention that starts later is not followed (set `threads=1` on a
machine shared with other work), and the times are kept for later runs on the machine
(backends/choice_cache.py; `retime=true` times them again).
"""
from __future__ import annotations

import torch

from specflow.backends.choice import Choice, Decided, fastest, kept_for, time_pass

ROUNDS = 3    # turns of each count, 3 passes each (backends/turns.py)


# torch's own choice for this process (all cores), before any pipeline set another
DEFAULT_THREADS = torch.get_num_threads()


def plan(backend, setting, positions: int = 1, rows: int = 1) -> Choice | Decided:
    """`threads` (an int, or "auto") for a transformers backend (HFBackend: `lean` its lean
    forward or None): a Choice between DEFAULT_THREADS and one, whatever an earlier pipeline
    set, or the count applied where nothing is timed. Only backends with the lean forward on a
    CPU are timed (their passes are real and cheap); for others auto leaves torch's setting as
    it is. A changed count re-picks the lean forward's product forms, which were timed at the
    old one."""
    if setting == "auto" and (DEFAULT_THREADS == 1 or backend.device.type != "cpu"
                              or backend.lean is None):
        return Decided(torch.get_num_threads())          # nothing to time: leave it alone
    if setting != "auto":
        _apply(backend, int(setting))
        return Decided(int(setting))
    counts = (DEFAULT_THREADS, 1)

    def measure(n: int, clock) -> list[float]:
        torch.set_num_threads(n)
        return [time_pass(backend, 1, 1, 3, clock)]

    return Choice("threads", counts, measure, fastest, lambda n: _apply(backend, n),
                  key=kept_for(backend, "threads", counts=counts, rounds=ROUNDS), rounds=ROUNDS)


def _apply(backend, n: int) -> None:
    torch.set_num_threads(n)
    if backend.lean is not None:
        backend.lean.repick()

