"""Hydra search-path plugin: adds the config folders that specflow plugins declare.

Hydra imports every module under the `hydra_plugins` namespace at start-up; this one asks the
global specflow plugin manager for `specflow_config_searchpath()` results, so a plugin package's
`conf/proposer/suffix.yaml` becomes `proposer=suffix` with no change to specflow.
"""
from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class SpecflowSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from specflow.plugins import config_searchpath

        for entry in config_searchpath():
            search_path.append(provider="specflow-plugin", path=entry)
