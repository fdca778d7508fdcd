"""Requests' grammars compiled for the server: one compile per spec at a time, and the
json_object grammar warmed in the background at start."""
from __future__ import annotations

import json
import logging
import threading

log = logging.getLogger("specflow.serve")


class GrammarCompiler:
    """Compiles requests' grammars (the grammar stage caches them), one compile per spec at a time:
    a request whose grammar is being compiled (by the warm-up, or by another request) waits for
    that compile instead of starting its own. `warm()` compiles response_format json_object's
    grammar in a background thread at start; `warming` names what is still compiling."""

    def __init__(self, grammars):
        self.grammars = grammars
        self.guard = threading.Lock()
        self.locks: dict[str, list] = {}          # spec -> [lock, holders and waiters]
        self.warming: set[str] = set()

    def compile(self, spec: dict) -> None:
        key = json.dumps(spec, sort_keys=True)
        with self.guard:
            entry = self.locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                self.grammars.compile(spec, 0)
        finally:
            with self.guard:
                entry[1] -= 1
                if entry[1] == 0:
                    self.locks.pop(key, None)

    def warm(self, specs: dict[str, dict]) -> threading.Thread:
        self.warming.update(specs)

        def run():
            for name, spec in specs.items():
                try:
                    self.compile(spec)
                except Exception as exc:     # noqa: BLE001 - requests compile it themselves
                    log.warning("precompiling the %s grammar failed: %s", name, exc)
                finally:
                    self.warming.discard(name)

        thread = threading.Thread(target=run, name="specflow-warm", daemon=True)
        thread.start()
        return thread
