"""The wheel must carry every package and conf/: pyproject lists packages by hand, so check it."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "specflow").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    found |= {"specflow.conf"}
    assert found == listed


def test_conf_is_importable_as_the_package_hydra_reads():
    import specflow.conf
    root = pathlib.Path(specflow.conf.__file__).parent
    assert (root / "config.yaml").exists() and (root / "proposer" / "ngram.yaml").exists()
