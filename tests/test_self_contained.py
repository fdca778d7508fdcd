"""The repository stands on its own: no file points at design notes it does not hold."""
from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"DESIGN\.md|PITFALLS|seeds/\d|\.\./shared")


def test_no_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:        # an sdist without git: read the tree
        files = [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    else:
        files = [ROOT / f for f in tracked.stdout.splitlines()]
    hits = []
    for path in files:
        if path.suffix not in (".py", ".md", ".yaml", ".toml", ".txt", ".sh") or not path.exists():
            continue
        if path.name == pathlib.Path(__file__).name:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines()):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)


def test_the_design_page_has_every_pitfall_the_code_cites():
    design = (ROOT / "docs/design.md").read_text(encoding="utf-8")
    numbered = set(int(n) for n in re.findall(r"^(\d+)\. ", design.split("## 5.")[1], flags=re.M))
    assert numbered == set(range(1, 34))
