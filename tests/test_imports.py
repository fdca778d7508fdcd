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
            if name == "specflow.conf" or name.startswith("specflow.conf."):   # yaml, no code
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


def test_the_config_layer_imports_no_backend_head_vllm_or_console_module():
    """Components check themselves (Component.check, preflight): validate() asks the registry,
    so specflow.config never reaches up into what it configures."""
    graph = _graph()
    config = [m for m in graph if m == "specflow.config" or m.startswith("specflow.config.")]
    up = ("specflow.backends", "specflow.vllm", "specflow.console", "specflow.stages",
          "specflow.serving", "specflow.pipeline", "specflow.engine")
    assert [(m, t) for m in config for t in sorted(graph[m]) if t.startswith(up)] == []


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


BACKEND_PRIVATE = ("specflow.backends.lean.packing", "specflow.backends.lean.kernels", "specflow.backends.threads")


def _all_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a module: top level, inside functions and under
    TYPE_CHECKING alike; `from x import y` gives x.y, relative imports resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], node.module or ""]
                            if node.level else [node.module or ""]).strip(".")
            names += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
    return names


def test_the_round_and_the_policies_leave_cpu_tuning_to_the_backend():
    """How a backend runs its passes (threads, packed weights, product forms) is its own
    business (Backend.tune / describe / time_pass): the pipeline, the engine and the policies
    import nothing from the modules that decide it."""
    paths = [PACKAGE / "pipeline.py", PACKAGE / "engine.py",
             *sorted((PACKAGE / "policies").rglob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{line} {name}" for path in paths
             for line, name in _all_imports(path)
             if any(name == m or name.startswith(m + ".") for m in BACKEND_PRIVATE)]
    assert found == []


def test_proposers_set_no_attribute_on_a_backend():
    """A proposer reads the target through the Backend contract and its hooks (hidden states
    arrive through specflow_target_states): it never plants attributes on a backend. Checked in
    the source (no `target.x = ...` / `ctx.target.x = ...` in any proposer) and at run time (the
    EAGLE proposer built on the demo target leaves the target's attributes as they were)."""
    import ast
    import pathlib

    from specflow import Pipeline
    from specflow.stages.proposers.eagle import EagleProposer, EagleProposerConfig

    root = pathlib.Path(__file__).resolve().parents[1] / "specflow" / "stages" / "proposers"
    planted = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, (ast.Name, ast.Attribute)):
                    base = t.value.id if isinstance(t.value, ast.Name) else t.value.attr
                    if base in ("target", "draft", "backend"):
                        planted.append(f"{path.name}:{node.lineno} {base}.{t.attr}")
    assert planted == []

    pipe = Pipeline.from_config(["proposer=none", "show_progress=false"])
    before = {k: id(v) for k, v in vars(pipe.target).items()}
    EagleProposer(EagleProposerConfig(), pipe.ctx)
    assert {k: id(v) for k, v in vars(pipe.target).items()} == before
