"""specflow: declarative, pipeline-driven speculative decoding (see DESIGN.md).

    from specflow import Pipeline
    pipe = Pipeline.from_config(overrides=["proposer=ngram", "policy=adaptive"])
    results = pipe.generate(["def fib(n):"], max_new_tokens=64, stop=["\\n\\n"])
"""
from __future__ import annotations

__version__ = "0.2.0"

from specflow.errors import ConfigError, InputError, PluginError, SpecflowError
from specflow.pipeline import GenerationResult, Pipeline
from specflow.plugins import hookimpl
from specflow.stages.proposers.ngram import ngram_draft
from specflow.stages.verify import verify

__all__ = ["Pipeline", "GenerationResult", "hookimpl", "verify", "ngram_draft", "SpecflowError",
           "ConfigError", "InputError", "PluginError", "__version__"]
