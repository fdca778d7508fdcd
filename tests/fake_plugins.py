"""Fake third-party plugin packages: real distributions (dist-info + entry point) on a folder."""
from __future__ import annotations

import pathlib
import textwrap


def install_fake_plugin(root: pathlib.Path, module: str, source: str, extra_conf: bool = True,
                        version: str = "0.3.1", option: tuple[str, str] = ("proposer", "echo"),
                        ) -> pathlib.Path:
    """Write `module` with `source` and its dist-info under root; put root on sys.path to use it.

    With extra_conf the package also ships conf/<group>/<name>.yaml (option) and the source is
    expected to return "pkg://{module}.conf" from specflow_config_searchpath.
    """
    dist = root / f"{module}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\n"
                                   f"Version: {version}\n")
    (dist / "entry_points.txt").write_text(f"[specflow]\n{module} = {module}\n")
    pkg = root / module
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(source.replace("{module}", module)))
    if extra_conf:
        group, name = option
        (pkg / "conf" / group).mkdir(parents=True)
        (pkg / "conf" / "__init__.py").write_text("")
        (pkg / "conf" / group / f"{name}.yaml").write_text(f"name: {name}\nk: 2\n")
    return root


def leak_draft_cache(monkeypatch) -> None:
    """Fault injection: the draft proposer's cache never rolls back, so it keeps conditioning on
    rejected drafts. Output stays exact; only acceptance drops (pitfall 21). Applies to pipelines
    built after the call."""
    from specflow import hookimpl
    from specflow.stages.proposers.draft import DraftModelProposer

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        return None

    monkeypatch.setattr(DraftModelProposer, "specflow_sync_cache", specflow_sync_cache)


# the same fault as an installed plugin, for subprocess tests: proposer=leaky_draft
LEAKY_DRAFT_PLUGIN = '''
from specflow import hookimpl
from specflow.stages.proposers.draft import DraftModelProposer, DraftProposerConfig


class LeakyDraft(DraftModelProposer):
    @hookimpl
    def specflow_sync_cache(self, batch, result):
        return None


@hookimpl
def specflow_register(registry):
    registry.add("proposer", "leaky_draft", LeakyDraft, DraftProposerConfig)


@hookimpl
def specflow_config_searchpath():
    return "pkg://{module}.conf"
'''
