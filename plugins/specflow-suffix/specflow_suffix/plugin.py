"""The entry point specflow loads (``[project.entry-points.specflow] suffix = ...``)."""
from __future__ import annotations

from specflow import hookimpl

from specflow_suffix.proposer import SuffixProposer, SuffixProposerConfig

CONFIG_SEARCHPATH = "pkg://specflow_suffix.conf"


@hookimpl
def specflow_register(registry):
    registry.add("proposer", "suffix", SuffixProposer, SuffixProposerConfig)


@hookimpl
def specflow_config_searchpath():
    # conf/proposer/suffix.yaml and conf/experiment/suffix_repeat.yaml join specflow's groups
    return CONFIG_SEARCHPATH
