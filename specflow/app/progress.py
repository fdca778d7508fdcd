"""Progress of a long command's phases (train-head's data and training, a server's load): a rich
bar on a terminal, and plain lines elsewhere, so a run under nohup, in CI or behind a pipe shows
that it is alive: one line when a phase starts, one every `every` seconds while it runs, one when
it ends. Notes (what a resumed run picked up) are lines in both."""
from __future__ import annotations

import sys
import time
from typing import Callable


def stderr_line(text: str) -> None:
    """One progress line on stderr, flushed (a log file under nohup gets it at once)."""
    print(text, file=sys.stderr, flush=True)


class PlainPhases:
    """Phases as plain lines, written by `write` (stderr by default)."""

    def __init__(self, write: Callable[[str], None], every: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.write, self.every, self.clock = write, every, clock

    def __call__(self, description: str, total: int):
        """Start a phase of `total` steps -> advance(n=1, loss=None, acc=None)."""
        start = last = self.clock()
        done = 0
        self.write(f"specflow: {description}: 0/{total}")

        def advance(n: int = 1, loss: float | None = None, acc: float | None = None) -> None:
            nonlocal done, last
            done += n
            now = self.clock()
            if done < total and now - last < self.every:
                return
            last = now
            info = "" if loss is None else f", loss {loss:.3f}, step-1 acc {acc:.2f}"
            pct = f" ({100 * done / total:.0f}%)" if total else ""
            self.write(f"specflow: {description}: {done}/{total}{pct}, "
                       f"{now - start:.0f} s{info}")
        return advance

    def note(self, text: str) -> None:
        self.write(f"specflow: {text}")


class BarPhases:
    """Phases as rich progress bars (a terminal); notes print above them."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, description: str, total: int):
        task = self.bar.add_task(description, total=total, info="")

        def advance(n: int = 1, loss: float | None = None, acc: float | None = None) -> None:
            info = "" if loss is None else f"loss {loss:.3f}  step-1 acc {acc:.2f}"
            self.bar.update(task, advance=n, info=info)
        return advance

    def note(self, text: str) -> None:
        self.bar.console.print(f"[dim]specflow: {text}[/]", highlight=False)


def silent(description: str, total: int):
    """No progress at all (--quiet, tests)."""
    return lambda n=1, **info: None


class Heartbeat:
    """While a step with no steps of its own runs (a model's load and its choices at start), a
    line every `every` seconds from a background thread: `with Heartbeat(write, "loading"):`."""

    def __init__(self, write: Callable[[str], None], what: str, every: float = 30.0):
        import threading

        self.write, self.what, self.every = write, what, every
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        start = time.monotonic()
        while not self.stop.wait(self.every):
            self.write(f"specflow: still {self.what} ({time.monotonic() - start:.0f} s)")

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
