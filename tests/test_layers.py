"""The layer contract, over the import graph of dagfold, services and projections.

Layers point one way: plumbing (``dagfold``: log, codec, state, processor, config...) <- services
and projections <- the top layers (``dagfold.cli`` and the SDK ``dagfold.client``; nothing below
imports them).
And no module imports another that (directly or not) imports it back. Every import counts,
including those inside functions (they run, only later); imports under ``if TYPE_CHECKING:``
do not (they never run).
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dagfold", "services", "projections")


def module_name(path: Path) -> str:
    """The import name: ``services/`` and ``projections/`` are mapped into the ``dagfold`` namespace."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("services", "projections"):
        parts.insert(0, "dagfold")
    return ".".join(parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:  # ``from pkg import submodule`` imports the submodule
                    deps.add(f"{target}.{a.name}" if f"{target}.{a.name}" in files else target)
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


# The top layers: the CLI (and ``python -m dagfold``) and the Python SDK for upstream teams.
TOP = ("dagfold.cli", "dagfold.client", "dagfold.__main__")


def layer(mod: str) -> str:
    if any(mod == t or mod.startswith(t + ".") for t in TOP):
        return "top"
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("services", "projections") else parts[0]


def test_layers_point_one_way() -> None:
    allowed = {"dagfold": {"dagfold"}, "services": {"dagfold", "services", "projections"},
               "projections": {"dagfold", "projections"}, "top": {"dagfold", "services", "projections", "top"}}
    wrong = sorted(f"{mod} imports {dep}" for mod, deps in import_graph().items() for dep in deps
                   if layer(dep) not in allowed[layer(mod)])
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    # A package's __init__ that re-exports its modules is not a cycle with them.
    edges = {m: {d for d in deps if not (d in graph and m.startswith(d + "."))} for m, deps in graph.items()}
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_the_graph_sees_imports_inside_functions() -> None:
    """The checks would pass vacuously if the graph missed function-level imports."""
    graph = import_graph()
    assert "dagfold.services.scheduler.runner" in graph["dagfold.cli.admin"]  # imported inside a command
    assert "dagfold.processor.processor" in graph["dagfold.processor"]
    assert layer("dagfold.services.scheduler.runner") == "services"
    assert layer("dagfold.projections.jobs") == "projections"


OLD_NAMES = re.compile(r"^\s*(?:from|import)\s+(?:services|projections)\b", re.M)


def test_nothing_imports_the_old_top_level_names() -> None:
    """``services`` and ``projections`` are installed as ``dagfold.services`` and ``dagfold.projections``.

    From a source checkout the old names would still import, as a second copy of each module (two
    registries of metrics, two handler tables), so every import must use the installed names.
    """
    folders = (*PACKAGES, "tests", "bench", "chaos", "examples")
    old = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for folder in folders
           for p in (ROOT / folder).rglob("*.py") for text in [p.read_text()] for m in OLD_NAMES.finditer(text)]
    assert old == []


def reachable(graph: dict[str, set[str]], mod: str) -> set[str]:
    """Every module ``mod`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [mod]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def _in(mod: str, *packages: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


SCHEDULER_WRITE_SIDE = ("dagfold.services.scheduler.fold", "dagfold.services.scheduler.handlers",
                        "dagfold.services.scheduler.runnable", "dagfold.services.scheduler.outcomes",
                        "dagfold.services.scheduler.context", "dagfold.services.scheduler.appliers")


def test_the_api_and_the_sdk_never_import_the_scheduler_s_fold() -> None:
    """They speak the job contract (``dagfold.jobspec``) and the lifecycle (``dagfold.lifecycle``), not the
    scheduler's write side: its fold, command handlers and appliers, directly or not."""
    graph = import_graph()
    wrong = sorted(f"{mod} reaches {dep}" for mod in graph if _in(mod, "dagfold.services.api", "dagfold.client")
                   for dep in reachable(graph, mod) if _in(dep, *SCHEDULER_WRITE_SIDE))
    assert wrong == []


def test_the_sdk_and_the_job_contract_import_no_service() -> None:
    """The SDK (``dagfold.client``) is what upstream teams install: it needs no service's code. The job
    contract and the lifecycle are plumbing that the services, the API and the SDK share."""
    graph = import_graph()
    wrong = sorted(f"{mod} reaches {dep}" for mod in graph
                   if _in(mod, "dagfold.client", "dagfold.jobspec", "dagfold.lifecycle")
                   for dep in reachable(graph, mod) if layer(dep) == "services")
    assert wrong == []
    assert "dagfold.jobspec.validation" in reachable(graph, "dagfold.client")  # the graph sees the SDK's imports
