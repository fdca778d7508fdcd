"""specflow inside vLLM: its history proposers and policies as vLLM's `custom_class` drafter.

    speculative_config={"method": "custom_class", "model": "specflow.vllm.SpecflowProposer",
                        "num_speculative_tokens": k}

with `SPECFLOW_VLLM_OVERRIDES="proposer=ngram policy=adaptive"` in the environment (docs/vllm.md).
Importing this package does not import vLLM.
"""
from specflow.vllm.proposer import SpecflowProposer
from specflow.vllm.stages import OVERRIDES_ENV

__all__ = ["SpecflowProposer", "OVERRIDES_ENV"]
