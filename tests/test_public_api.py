"""The plugin API is `from specflow import ...`: every exported name imports, and the example
plugin packages and the author's guide use nothing deeper."""
from __future__ import annotations

import pathlib
import re

import specflow

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEEP_IMPORT = re.compile(r"^\s*(from specflow\.\w|import specflow\.)", re.M)


def test_every_exported_name_exists():
    for name in specflow.__all__:
        assert getattr(specflow, name) is not None, name


def test_the_example_plugins_import_only_the_public_api():
    sources = [p for pkg in ("specflow-suffix/specflow_suffix", "specflow-trace/specflow_trace")
               for p in (ROOT / "plugins" / pkg).rglob("*.py")]
    assert len(sources) >= 4
    for path in sources:
        hits = DEEP_IMPORT.findall(path.read_text(encoding="utf-8"))
        assert not hits, f"{path.relative_to(ROOT)} imports specflow internals: {hits}"


def test_the_guide_imports_only_the_public_api():
    guide = (ROOT / "docs/plugins.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert blocks
    for block in blocks:
        assert not DEEP_IMPORT.findall(block), block
