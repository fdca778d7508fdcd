"""docs/plugins.md's hook reference is generated from hookspecs.py and must be current."""
from __future__ import annotations

import pytest

from specflow import hookdoc, hookspecs


def test_the_hook_reference_in_docs_is_current():
    text = hookdoc.DOC.read_text(encoding="utf-8")
    assert hookdoc.render(text) == text, "run `python -m specflow.hookdoc --write`"


def test_every_hook_is_in_the_reference():
    ref = hookdoc.reference()
    names = [n for n in dir(hookspecs) if n.startswith("specflow_")]
    assert len(names) == len(hookdoc.hook_functions()) >= 17
    for name in names:
        assert f"### `{name}`" in ref


def test_a_hook_without_a_docstring_fails(monkeypatch):
    def specflow_undocumented(batch):
        pass

    monkeypatch.setattr(hookspecs, "specflow_undocumented", specflow_undocumented, raising=False)
    with pytest.raises(ValueError, match="specflow_undocumented has no docstring"):
        hookdoc.reference()
