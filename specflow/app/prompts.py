"""Where a run's prompts come from: `prompt=...`, `prompt=-` (stdin), or the workload option."""
from __future__ import annotations

import sys

from specflow.errors import InputError


def read_prompts(cfg) -> list[str]:
    """The config's prompts, as text (a plugin's workload that raises is named with its package)."""
    from specflow.config import option
    from specflow.plugins import blame, get_registry

    prompt = cfg.get("prompt")
    if prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"stdin is not UTF-8 (bad byte at offset {exc.start}); "
                             f"re-encode the prompt as UTF-8") from None
        if not text.strip():
            raise InputError("prompt=- but stdin is empty; pipe a prompt in")
        return [text]
    if prompt is not None:
        return [str(prompt)]
    workload = option(cfg, "workload")
    component = get_registry().get("workload", workload.name)
    try:
        return component.factory(workload, None).prompts()
    except Exception as exc:      # a plugin's workload: name the plugin and its package
        blamed = blame(exc, f"reading workload={workload.name}",
                       getattr(component.factory, "__module__", None), component.plugin)
        if blamed is None:
            raise
        raise blamed from exc
