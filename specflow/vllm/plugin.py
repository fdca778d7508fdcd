"""vLLM's general plugin for specflow: `SpecflowProposer`'s overrides checked in vLLM's front end.

vLLM builds a custom_class drafter only inside its worker, after the engine process has started
and the target's weights have loaded; a drafter that refuses its overrides there (`proposer=draft`,
a typo like `proposer=ngarm`) ends in screens of worker tracebacks minutes later. vLLM loads the
entry points of the group `vllm.general_plugins` in every process it starts, the front end first
(`EngineArgs.__post_init__`), so `register` wraps `EngineArgs.create_engine_config`: once the
front end has resolved its VllmConfig, before any engine process or weight exists, a
`speculative_config` naming specflow's drafter is checked exactly as the drafter will check it.
A refusal is one line: `LLM(...)` raises it as a `ConfigError`; `vllm serve` prints
`specflow: error: ...` and exits with status 2.

Not checked here (the drafter still refuses them in the worker, with the same line on stderr):
a `VLLM_PLUGINS` allowlist without `specflow`, and a subclass of SpecflowProposer in a module
outside specflow (importing a user's module in the front end could start CUDA before vLLM forks).
"""
from __future__ import annotations

import functools
import importlib
import sys

MARK = "_specflow_checks_drafter"


def register() -> None:
    """The entry point (`vllm.general_plugins`, name `specflow`): vLLM calls it once per process.
    It never raises: a vLLM without `EngineArgs.create_engine_config` is left as it is."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:                          # not a vLLM this wraps: left as it is
        return
    wrap(EngineArgs)


def wrap(engine_args: type) -> None:
    """Check the VllmConfig that `engine_args.create_engine_config` returns (once per class)."""
    original = getattr(engine_args, "create_engine_config", None)
    if original is None or getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        check_vllm_config(config)
        return config

    setattr(create_engine_config, MARK, True)
    engine_args.create_engine_config = create_engine_config


def drafter_class(path) -> type | None:
    """The SpecflowProposer (or subclass) a custom_class path names, if it lies in specflow;
    None for any other path (not imported here)."""
    from specflow.vllm.proposer import SpecflowProposer

    path = str(path or "")
    module, _, name = path.rpartition(".")
    if module != "specflow" and not module.startswith("specflow."):
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None                            # vLLM's own message names the path
    return found if isinstance(found, type) and issubclass(found, SpecflowProposer) else None


def check_vllm_config(config) -> None:
    """Build specflow's stages for a VllmConfig whose speculative_config names specflow's
    drafter, as the drafter will in the worker: ConfigError (one line) for what it refuses. In
    vLLM's command line (`vllm serve`): the line on stderr as `specflow: error: ...`, exit 2."""
    from specflow.errors import SpecflowError

    spec = getattr(config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "custom_class":
        return
    cls = drafter_class(getattr(spec, "model", None))
    if cls is None:
        return
    try:
        cls.stages_for(config)
    except SpecflowError as exc:
        if _in_vllm_cli():
            print(f"specflow: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(exc.exit_code) from None
        raise exc.with_traceback(None) from None


def _in_vllm_cli() -> bool:
    """Whether this process is vLLM's command line (`vllm serve ...`), not a Python program: the
    `vllm` command runs vllm.entrypoints.cli.main, which `import vllm` does not import."""
    return "vllm.entrypoints.cli.main" in sys.modules
