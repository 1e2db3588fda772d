"""The package's modules import each other without a cycle.

Every ``import`` and ``from ... import`` is read with ``ast``, including those inside
functions: an import hidden in a function body is still a dependency, and hiding one is
not how a cycle is broken.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lazytrain_accel

PACKAGE = "lazytrain_accel"
PACKAGE_DIR = Path(lazytrain_accel.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` refers to: itself, else its nearest parent package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import name` imports pkg.name when name is a submodule.
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    resolved = {_resolve(name, modules) for name in names if name.startswith(PACKAGE)}
    # Importing pkg.sub runs pkg/__init__ first: the parent packages are imported too.
    targets = {t for target in resolved if target for t in _with_parents(target)}
    return targets - {module}


def _with_parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:n]) for n in range(1, len(parts) + 1)}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imported(module, path, modules) for module, path in modules.items()}


def _is_ancestor_package(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a closed path of module names, or None.

    A package's ``__init__`` re-exporting its own submodules is not a cycle: importing
    ``pkg.sub`` always runs ``pkg/__init__`` first, so the edge ``pkg.sub -> pkg`` is
    implied, never an ordering constraint of its own; such edges are left out.
    """
    edges = {
        module: {t for t in targets if not _is_ancestor_package(t, module)}
        for module, targets in graph.items()
    }
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "lazytrain_accel.planning.plan" in graph
    assert "lazytrain_accel.planning.plan" in graph["lazytrain_accel.planning.solve"]


def test_find_cycle_reports_the_loop() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
