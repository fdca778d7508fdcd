"""specflow-suffix: `proposer=suffix`, suffix decoding (ArcticInference) as a specflow plugin.

Installed, it is found through the ``specflow`` entry point group (``specflow_suffix.plugin``):

    pip install plugins/specflow-suffix
    specflow run proposer=suffix prompt="def add(a, b):"
"""
from __future__ import annotations

__version__ = "0.1.0"

from specflow_suffix.proposer import SuffixProposer, SuffixProposerConfig
from specflow_suffix.tree import SuffixTree

__all__ = ["SuffixProposer", "SuffixProposerConfig", "SuffixTree", "__version__"]
