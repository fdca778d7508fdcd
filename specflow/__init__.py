"""specflow: declarative, pipeline-driven speculative decoding (docs/design.md).

    from specflow import Pipeline
    pipe = Pipeline.from_config(overrides=["proposer=ngram", "policy=adaptive"])
    results = pipe.generate(["def fib(n):"], max_new_tokens=64, stop=["\\n\\n"])
    for piece in pipe.stream("def fib(n):"): print(piece, end="")   # text as rounds commit it

Plugin authors import everything they need from here, never from specflow's internal modules:

    from specflow import hookimpl, PAD, Proposal, ConfigError
"""
from __future__ import annotations

from specflow.engine import Engine, RequestOutput
from specflow.errors import ConfigError, InputError, PluginError, SpecflowError
from specflow.hookspecs import HOOK_API_VERSION
from specflow.io import atomic_write_json, atomic_write_text
from specflow.pipeline import GenerationResult, Pipeline, Request
from specflow.plugins import Registry, hookimpl
from specflow.plugins import reset as reset_plugins
from specflow.stages.empty_rows import EmptyDistributionError
from specflow.stages.proposers.ngram import ngram_draft
from specflow.stages.stop import TrimResult
from specflow.stages.verify import verify
from specflow.stages.verify_tree import verify_tree
from specflow.state import (PAD, DecodeBatch, HiddenStates, Proposal, RoundResult, ShapingBatch,
                            VerifyOutput)
from specflow.version import __version__

__all__ = [
    # running
    "Pipeline", "GenerationResult", "Request", "Engine", "RequestOutput", "verify", "verify_tree",
    "ngram_draft",
    # writing plugins: the marker, the round's dataclasses, the registry, helpers
    "hookimpl", "HOOK_API_VERSION", "PAD", "DecodeBatch", "Proposal", "ShapingBatch",
    "VerifyOutput", "HiddenStates", "TrimResult", "RoundResult", "Registry", "reset_plugins",
    "atomic_write_json", "atomic_write_text",
    # errors (the CLI prints one line and exits 2 for any SpecflowError)
    "SpecflowError", "ConfigError", "InputError", "PluginError", "EmptyDistributionError",
    "__version__",
]
