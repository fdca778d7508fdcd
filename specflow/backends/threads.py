"""How many CPU threads torch uses for a CPU run: `threads: auto | N` in the root config.

Private to the transformers backend: `HFBackend.tune` calls `choose_threads` for the target
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

from specflow.backends import choice_cache
from specflow.backends.turns import in_turns

ROUNDS = 3    # turns of each count, 3 passes each (backends/turns.py)


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
        counts = (DEFAULT_THREADS, 1)

        def timed(n: int) -> list[float]:
            torch.set_num_threads(n)
            return [backend.time_pass(reps=3)]

        best = in_turns([lambda n=n: timed(n) for n in counts], rounds=ROUNDS,
                        **choice_cache.of(backend, "threads", counts=counts, rounds=ROUNDS))
        chosen = min(zip(counts, best), key=lambda cb: cb[1])[0]
    torch.set_num_threads(chosen)
    lean = getattr(backend, "lean", None)
    if lean is not None:
        lean.repick()
    return chosen
