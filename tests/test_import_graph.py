"""The package's modules import each other without a cycle, and the layers keep their rules.

Every ``import`` and ``from ... import`` is read with ``ast``, including those inside
functions: an import hidden in a function body is still a dependency, and hiding one is
not how a cycle is broken.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
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


def _import_lines(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, name) of every import the file writes, package-relative ones made absolute.

    ``from pkg import name`` yields both ``pkg`` and ``pkg.name`` (name may be a submodule).
    """
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    lines: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            lines.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            lines.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            lines.append((node.lineno, base))
    return lines


def _direct_imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package modules the file names in an import, each with its first line."""
    found: dict[str, int] = {}
    for line, name in sorted(_import_lines(module, path, modules)):
        target = _resolve(name, modules) if name.startswith(PACKAGE) else None
        if target and target != module:
            found.setdefault(target, line)
    return found


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    resolved = _direct_imports(module, path, modules)
    # Importing pkg.sub runs pkg/__init__ first: the parent packages are imported too.
    targets = {t for target in resolved for t in _with_parents(target)}
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


# The layering, as data. A part is a package or a top-level module of lazytrain_accel,
# named without the prefix ("planning" is lazytrain_accel.planning and all under it).
# Each rule is checked against the imports each file writes, function bodies included.


@dataclass(frozen=True, kw_only=True)
class Rule:
    part: str
    never: tuple[str, ...]  # parts that no module of `part` imports
    why: str  # what the layering keeps, and where the code belongs instead
    only: tuple[str, ...] = ()  # modules of a `never` part that are allowed after all


RULES = (
    Rule(part="planning",
         never=("engine", "frontends", "distributed", "checkpoints", "run", "optim",
                "layer_probe", "cli"),
         why="the planner decides from profiles alone and runs without torch; move what "
             "it needs into planning/ or profiling/, or pass it in as data"),
    Rule(part="engine",
         never=("frontends", "run", "distributed", "checkpoints", "optim", "layer_probe",
                "cli"),
         why="the engine runs a plan on a model and knows no front end, run state, "
             "distribution or optimizer class; take what it needs as an argument or a "
             "Protocol"),
    Rule(part="distributed", never=("frontends", "run", "checkpoints", "cli"),
         why="the distributed layer sits under the front ends, the run state and the "
             "checkpoints; hand it what it needs from above"),
    Rule(part="checkpoints", never=("frontends", "run", "cli"),
         why="checkpoints are written for the front ends, never by reaching into them"),
    Rule(part="profiling",
         never=("config", "planning", "engine", "frontends", "distributed", "checkpoints",
                "run", "layer_probe", "cli"),
         why="profiles are measured facts under the config and the planner; callers pass "
             "the config's values in (a probe that needs the engine lives above it, as "
             "layer_probe.py does)"),
    Rule(part="config",
         never=("profiling", "planning", "engine", "frontends", "distributed",
                "checkpoints", "run", "optim", "cli"),
         only=("profiling.hardware",),
         why="config reads the environment and validates; it checks hardware names "
             "against profiling/hardware.py (stdlib only) and nothing else of the package"),
)


def _part_of(module: str) -> str:
    return module.removeprefix(PACKAGE + ".") if module != PACKAGE else ""


def _within(module: str, part: str) -> bool:
    name = _part_of(module)
    return name == part or name.startswith(part + ".")


def layer_violations(edges: dict[str, dict[str, int]], modules: dict[str, Path],
                     rules: tuple[Rule, ...] = RULES) -> list[str]:
    """One line per import that breaks a rule: file:line, the import, the rule and why.

    `edges` maps each module to the package modules it imports, each with its line."""
    found = []
    for module, targets in sorted(edges.items()):
        for rule in rules:
            if not _within(module, rule.part):
                continue
            for target, line in sorted(targets.items()):
                if any(_within(target, part) for part in rule.never) and not any(
                        _within(target, allowed) for allowed in rule.only):
                    parts = modules[module].parts
                    where = "/".join(parts[len(parts) - 1 - parts[::-1].index(PACKAGE):])
                    found.append(f"{where}:{line} imports {target}: {rule.part} never "
                                 f"imports {', '.join(rule.never)}; {rule.why}")
    return found


def direct_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {module: _direct_imports(module, path, modules) for module, path in modules.items()}


def _imports_torch_at_top(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        if any(name == "torch" or name.startswith("torch.") for name in names):
            return True
    return False


def _external_imports(path: Path) -> set[str]:
    """Top-level names of the non-package modules a file imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - {PACKAGE}


def test_layers_keep_their_rules() -> None:
    modules = _modules()
    violations = layer_violations(direct_graph(modules), modules)
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_a_planted_import_breaks_its_rule(tmp_path: Path) -> None:
    """An import the rules forbid, written into a module the graph's own reader parses."""
    planted = tmp_path / PACKAGE / "planning" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f():\n    from ..engine.core import runtime\n")
    modules = {**_modules(), "lazytrain_accel.planning.planted": planted}
    edges = {"lazytrain_accel.planning.planted":
             _direct_imports("lazytrain_accel.planning.planted", planted, modules)}
    violations = layer_violations(edges, modules)
    assert violations and all(v.startswith("lazytrain_accel/planning/planted.py:2 imports "
                                           "lazytrain_accel.engine") for v in violations)
    assert "planning never imports engine" in violations[0]
    # config may import profiling/hardware.py, and no other module of profiling
    assert layer_violations({"lazytrain_accel.config":
                             {"lazytrain_accel.profiling.hardware": 3}}, modules) == []
    assert len(layer_violations({"lazytrain_accel.config":
                                 {"lazytrain_accel.profiling.measure": 3}}, modules)) == 1


def test_the_planner_imports_no_torch_module() -> None:
    """No planning module imports torch, nor a package module that imports it at load."""
    modules = _modules()
    torch_modules = {m for m, path in modules.items() if _imports_torch_at_top(path)}
    assert "lazytrain_accel.profiling.measure" in torch_modules  # the check sees torch
    for module, targets in direct_graph(modules).items():
        if _within(module, "planning"):
            assert "torch" not in _external_imports(modules[module]), module
            assert not set(targets) & torch_modules, (
                f"{module} imports {sorted(set(targets) & torch_modules)}, which import torch "
                "at load: the planner runs without torch; import the torch-free part")


def test_the_plan_ir_is_standard_library_only() -> None:
    path = _modules()["lazytrain_accel.planning.plan"]
    foreign = {name for name in _external_imports(path) if name not in sys.stdlib_module_names}
    assert not foreign, f"planning/plan.py imports {sorted(foreign)}: the Plan IR is stdlib only"
    assert not _direct_imports("lazytrain_accel.planning.plan", path, _modules()), (
        "planning/plan.py imports the package: the Plan IR depends on the standard library only")
