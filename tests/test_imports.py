"""The package's import graph, read statically with ``ast`` (nothing is imported).

Every ``import`` and ``from ... import`` of every module of ``edgepath`` counts,
at module level and inside functions alike, relative or absolute: a cycle that
only closes when some function runs is still a cycle (it bites the first time
that function runs during another module's import). Imports under
``if TYPE_CHECKING:`` never run and are left out; so are imports by name
(``importlib.import_module``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "edgepath"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# The pipeline's stages: each is a command of its own and may import the decision
# modules, never the other way round.
STAGES = ("model", "probe", "select", "quantize", "engine_check", "patch_verify", "control", "export",
          "benchmark", "bundle", "release", "pull")


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's
    ``__init__.py`` is the package itself)."""
    modules = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = [PACKAGE, *f.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = f
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except those under
    ``if TYPE_CHECKING:``."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package's module that importing ``name`` loads (``name`` itself, or the
    nearest enclosing module for ``package.module.attribute``), or None if outside."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
             modules: dict[str, Path]) -> set[str]:
    """The package's modules one import statement of ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        # ``from a import b``: b is a submodule of a, or a name defined in a
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                 for alias in node.names]
    targets = set()
    for name in names:
        resolved = _resolve(name, modules)
        if resolved is None:
            continue
        # importing a.b.c runs a/__init__ and a/b/__init__ first; the importer's own
        # enclosing packages are already being imported, so they add no edge
        parts = resolved.split(".")
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target in modules and not module.startswith(target + ".") and target != module:
                targets.add(target)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[module] = set().union(*(_targets(module, is_package, n, modules) for n in _import_nodes(tree)))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_reader_sees_every_kind_of_import():
    graph = import_graph()
    # module level, relative: ``from . import records``
    assert "edgepath.records" in graph["edgepath.patch_verify"]
    # inside a function, relative with a submodule: ``from .engines.vllm_cpu import ...`` in engine_check.check
    assert "edgepath.engines.vllm_cpu" in graph["edgepath.engine_check"]
    assert "edgepath.engines" in graph["edgepath.engine_check"]
    # two levels up: ``from ..errors import EdgepathError`` in gptq/__init__
    assert "edgepath.errors" in graph["edgepath.gptq"]
    # a package's own submodule from its __init__: ``from . import compile_cache, head_gate``
    assert {"edgepath.vllm_plugin.compile_cache", "edgepath.vllm_plugin.head_gate"} <= graph["edgepath.vllm_plugin"]


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in edgepath: " + " -> ".join(cycle)


def test_the_manifest_imports_no_stage():
    stages = {f"{PACKAGE}.{s}" for s in STAGES}
    imported = sorted(import_graph()[f"{PACKAGE}.manifest"] & stages)
    assert imported == [], f"edgepath/manifest.py imports the stage module(s) {imported}"
