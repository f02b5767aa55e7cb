"""benchmarks/ is a suite run as modules (``python -m benchmarks.<name>``): none edits
``sys.path``, none reaches into a private name of the package, every module imports."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from .conftest import ROOT

MODULES = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")


def _private_uses(tree: ast.Module) -> list[str]:
    """Private names of ``edgepath`` a module imports or reads off an imported edgepath module."""
    found, edgepath_names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgepath"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"from {node.module} import {alias.name}")
                edgepath_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            edgepath_names.update((a.asname or a.name).split(".")[0] for a in node.names
                                  if a.name.startswith("edgepath"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in edgepath_names
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def _edits_sys_path(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
               and node.value.id == "sys" for node in ast.walk(tree))


@pytest.mark.parametrize("module", MODULES, ids=lambda p: p.stem)
def test_a_benchmark_uses_public_names_and_leaves_sys_path_alone(module):
    tree = ast.parse(module.read_text())
    assert not _edits_sys_path(tree), f"{module.name}: run it as `python -m benchmarks.{module.stem}`"
    assert _private_uses(tree) == []


def test_the_checks_see_what_they_refuse():
    assert _edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\n"))
    assert _private_uses(ast.parse("from edgepath.stages import benchmark\nbenchmark._PeakRss()\n")) == \
        ["benchmark._PeakRss"]
    assert _private_uses(ast.parse("from edgepath.stages.export import _versions\n")) == \
        ["from edgepath.stages.export import _versions"]


def test_every_benchmark_imports_as_a_module_of_the_suite():
    names = [f"benchmarks.{p.stem}" for p in MODULES]
    code = f"import importlib\nfor name in {names!r}:\n    importlib.import_module(name)\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
