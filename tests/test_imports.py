"""The module graph has a direction: no import cycle among specflow's modules (lazy imports
inside functions included, TYPE_CHECKING ones not), and nothing below the CLI imports it."""
from __future__ import annotations

import ast
import pathlib
import tomllib

import specflow

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specflow"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: pathlib.Path) -> list[str]:
    """Imported names, skipping `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING"
            for n in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{a.name}" for a in node.names] or [node.module]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:       # the module an imported name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for name in _imports(path):
            if name.startswith("specflow.conf"):      # the config package: yaml, no code
                continue
            target = owner(name) if name.startswith("specflow") else None
            if target and target != m:
                graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_nothing_below_the_cli_imports_it():
    graph = _graph()
    assert [m for m, targets in graph.items() if "specflow.cli" in targets] == []


def test_the_version_is_one_number():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert meta["project"]["version"] == specflow.__version__


def test_the_engine_and_the_server_worker_use_only_public_names():
    """The engine drives a Pipeline through its public round (make_requests, step,
    record_logprobs, finish_row), and the server's worker drives the Engine the same way: no
    `pipe._x` or `engine._x` (a refactor of either side then cannot break the other silently)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "specflow"
    for path, owner in (("engine.py", "pipe"), ("serving/worker.py", "engine")):
        tree = ast.parse((root / path).read_text())
        private = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                base = node.value
                name = base.id if isinstance(base, ast.Name) else \
                    base.attr if isinstance(base, ast.Attribute) else None
                if name == owner:
                    private.append(f"{path}:{node.lineno} {owner}.{node.attr}")
        assert private == []
