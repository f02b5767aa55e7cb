"""dvc.yaml's ``deps`` lists cover every project module a stage runs.

DVC re-runs a stage only when one of its ``deps`` changes, so a module that a
stage imports but does not list would let ``dvc repro`` keep a stale output. For
each stage (a ``foreach`` stage through its ``do:`` template) the module set is
derived from its ``python stages/<x>.py`` command with ``ast``:

- every import, at module level or inside a function, absolute or relative;
  ``from . import x`` means the submodule ``x`` when ``x`` is a module; importing
  ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too;
- a module started in a subprocess, ``[sys.executable, "-m", "edgepath.x"]``;
- ``importlib.import_module("edgepath.x")``; a name computed at run time
  (``f"{__name__}.{patch}"``) counts as the caller's whole package;
- a plugin that a third-party engine loads by entry point (pyproject.toml's
  ``vllm.general_plugins``) whenever a derived module imports that engine;
- the data a module reads (``DATA_READ_BY``: ``records.py`` reads the schemas).

A ``deps`` entry that is a directory covers everything under it.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

import yaml

from .conftest import ROOT

PACKAGE = "edgepath"
DATA_READ_BY = {"edgepath/core/records.py": ("edgepath/schemas",),
                "edgepath/rules/measurements.py": ("edgepath/rules/measured",),
                "edgepath/formats/packaged.py": ("edgepath/formats/packaged_models.lock",)}
"""Module -> data files or directories it reads at run time (results depend on them)."""
_SCRIPT = re.compile(r"(?:^|\s)python3?\s+(\S+\.py)(?=\s|$)")


# -- derivation ------------------------------------------------------------------------

def module_path(root: Path, dotted: str) -> str | None:
    """``a.b`` -> ``"a/b.py"`` or ``"a/b/__init__.py"`` under ``root``, or None if not there."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(root).as_posix()
    return None


def _with_parents(root: Path, dotted: str) -> list[str]:
    """The files importing ``dotted`` runs: each enclosing package's ``__init__.py``, then its own."""
    parts = dotted.split(".")
    found = [module_path(root, ".".join(parts[:i])) for i in range(1, len(parts) + 1)]
    return [f for f in found if f is not None]


def _dotted(rel: str) -> tuple[str, str]:
    """(module name, its package) of the file ``rel``."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _direct(root: Path, rel: str, package: str, engines: dict[str, tuple[str, ...]]) -> set[str]:
    """Project files and directories ``rel`` makes run or read, one step deep."""
    tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=rel)
    _, here = _dotted(rel)
    names: set[str] = set()
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*up, node.module] if node.module else up)
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, ast.List | ast.Tuple):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            names.update(m for flag, m in zip(items, items[1:]) if flag == "-m" and isinstance(m, str))
        elif (isinstance(node, ast.Call) and node.args
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.add(arg.value)
            else:  # computed at run time: anything in the caller's package
                out.update(p.relative_to(root).as_posix() for p in (root / here.replace(".", "/")).rglob("*.py"))
    for name in names:
        top = name.split(".")[0]
        if top == package:
            out.update(_with_parents(root, name))
        for plugin in engines.get(top, ()):
            out.update(_with_parents(root, plugin))
    return out


def engine_plugins(root: Path) -> dict[str, tuple[str, ...]]:
    """Third-party engine -> project modules it loads by entry point (pyproject.toml's
    ``<engine>.general_plugins``-style groups, keyed by the group's first word)."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    groups = tomllib.loads(pyproject.read_text())["project"].get("entry-points", {})
    plugins: dict[str, tuple[str, ...]] = {}
    for group, entries in groups.items():
        engine = group.split(".")[0]
        plugins[engine] = plugins.get(engine, ()) + tuple(v.split(":")[0] for v in entries.values())
    return plugins


def required(root: Path, script: str, package: str = PACKAGE,
             data: dict[str, tuple[str, ...]] = DATA_READ_BY) -> dict[str, str]:
    """Every project file or directory the stage script ``script`` (relative to ``root``)
    runs or reads, transitively -> what brought it in (``script`` for the script itself)."""
    engines = engine_plugins(root)
    why: dict[str, str] = {script: script}
    todo = [script]
    while todo:
        rel = todo.pop()
        found = set(data.get(rel, ()))
        if rel.endswith(".py"):
            found |= _direct(root, rel, package, engines)
        for f in sorted(found):
            if f not in why:
                why[f] = rel
                todo.append(f)
    return why


def stages(dvc: dict) -> dict[str, tuple[list[str], list[str]]]:
    """Stage name -> (its ``python <script>.py`` scripts, its deps), ``foreach`` stages by their template."""
    out = {}
    for name, stage in dvc.get("stages", {}).items():
        body = stage.get("do", stage)
        cmds = body.get("cmd", [])
        text = " ".join(cmds) if isinstance(cmds, list) else str(cmds)
        deps = [d if isinstance(d, str) else next(iter(d)) for d in body.get("deps", [])]
        out[name] = (_SCRIPT.findall(text), deps)
    return out


def covered(item: str, deps: Iterable[str]) -> bool:
    return any(item == d or item.startswith(d + "/") for d in (d.rstrip("/") for d in deps))


def missing_deps(root: Path, package: str = PACKAGE,
                 data: dict[str, tuple[str, ...]] = DATA_READ_BY) -> dict[str, dict[str, str]]:
    """Stage -> {missing file or directory: what brought it in}, for every stage of ``root/dvc.yaml``."""
    dvc = yaml.safe_load((root / "dvc.yaml").read_text())
    report = {}
    for name, (scripts, deps) in stages(dvc).items():
        gaps = {}
        for script in scripts:
            for item, via in required(root, script, package, data).items():
                if not covered(item, deps):
                    gaps[item] = via
        if gaps:
            report[name] = gaps
    return report


def _describe(report: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"stage {stage}: deps miss {item} (run via {via})"
                     for stage, gaps in report.items() for item, via in sorted(gaps.items()))


# -- the project -----------------------------------------------------------------------

def test_every_stage_lists_the_modules_it_runs():
    report = missing_deps(ROOT)
    assert not report, "dvc.yaml's deps do not cover what the stages run:\n" + _describe(report)


def stale_deps(root: Path, package: str = PACKAGE) -> dict[str, list[str]]:
    """Stage -> the package's module files its deps list but its command never runs (each
    one re-runs the stage for nothing when edited)."""
    report = {}
    for name, (scripts, deps) in stages(yaml.safe_load((root / "dvc.yaml").read_text())).items():
        run = {item for script in scripts for item in required(root, script, package, DATA_READ_BY)}
        stale = sorted(d for d in deps if d.startswith(f"{package}/") and d.endswith(".py") and d not in run)
        if stale:
            report[name] = stale
    return report


def test_no_stage_lists_a_module_it_does_not_run():
    report = stale_deps(ROOT)
    assert not report, "dvc.yaml's deps name modules the stages do not run:\n" + "\n".join(
        f"stage {stage}: {', '.join(items)}" for stage, items in report.items())


def test_every_stage_runs_a_script_the_check_can_read():
    for name, (scripts, _) in stages(yaml.safe_load((ROOT / "dvc.yaml").read_text())).items():
        assert scripts, f"stage {name}: no `python <script>.py` in its cmd, so its deps cannot be checked"
        for script in scripts:
            assert (ROOT / script).is_file(), f"stage {name}: {script} does not exist"


# -- the derivation, on a synthetic project -----------------------------------------------

def _project(tmp_path: Path, dvc_yaml: str) -> Path:
    files = {
        "stages/run.py": "import sys\nfrom pkg.cli import main\n",
        "pkg/__init__.py": "",
        "pkg/cli.py": "from . import records\n\ndef main():\n    from .sub import worker\n",
        "pkg/records.py": "import json\n",
        "pkg/schemas/a.schema.json": "{}",
        "pkg/sub/__init__.py": "",
        "pkg/sub/worker.py": "from .. import helper\nfrom ..helper import thing\nimport pkg.deep.leaf\n",
        "pkg/helper.py": "thing = 1\n",
        "pkg/deep/__init__.py": "",
        "pkg/deep/leaf.py": "import os\n",
        "pkg/unused.py": "",
        "pkg/spawned.py": "",
        "pkg/plugins/__init__.py": "import importlib\ndef load(p):\n    return importlib.import_module(f'{__name__}.{p}')\n",
        "pkg/plugins/one.py": "",
        "pkg/engine.py": "import fakeengine\n",
        "stages/spawn.py": "import sys\ncmd = [sys.executable, '-m', 'pkg.spawned']\nimport pkg.engine\n",
        "pyproject.toml": "[project]\nname = 'pkg'\n[project.entry-points.'fakeengine.general_plugins']\n"
                          "pkg = 'pkg.plugins:load'\n",
        "dvc.yaml": dvc_yaml,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


_DATA = {"pkg/records.py": ("pkg/schemas",)}


def test_derivation_follows_every_kind_of_import(tmp_path):
    root = _project(tmp_path, "stages: {}\n")
    got = required(root, "stages/run.py", "pkg", _DATA)
    assert set(got) == {"stages/run.py", "pkg/__init__.py", "pkg/cli.py", "pkg/records.py", "pkg/schemas",
                        "pkg/sub/__init__.py", "pkg/sub/worker.py", "pkg/helper.py", "pkg/deep/__init__.py",
                        "pkg/deep/leaf.py"}
    assert got["pkg/sub/worker.py"] == "pkg/cli.py"  # a function-level import
    assert got["pkg/schemas"] == "pkg/records.py"
    spawn = required(root, "stages/spawn.py", "pkg", _DATA)
    # a -m subprocess; an engine that loads the project's plugin, whose patches load by computed name
    assert {"pkg/spawned.py", "pkg/engine.py", "pkg/plugins/__init__.py", "pkg/plugins/one.py"} <= set(spawn)
    assert "pkg/unused.py" not in got | spawn


def test_a_missing_dep_is_reported_with_its_stage(tmp_path):
    root = _project(tmp_path, """\
stages:
  whole:
    cmd: python stages/run.py --out x
    deps: [stages/run.py, pkg/]
  loop:
    foreach: [a, b]
    do:
      cmd: python stages/run.py --item ${item}
      deps:
        - stages/run.py
        - pkg/__init__.py
        - pkg/cli.py
        - pkg/records.py
        - pkg/sub
        - pkg/deep
        - build/${item}
""")
    report = missing_deps(root, "pkg", _DATA)
    assert report == {"loop": {"pkg/helper.py": "pkg/sub/worker.py", "pkg/schemas": "pkg/records.py"}}
    text = _describe(report)
    assert "stage loop: deps miss pkg/helper.py" in text and "stage loop: deps miss pkg/schemas" in text


def test_a_directory_dep_covers_what_is_under_it_only():
    assert covered("pkg/sub/worker.py", ["pkg/sub"]) and covered("pkg/sub/worker.py", ["pkg/"])
    assert not covered("pkg/subway.py", ["pkg/sub"])
    assert not covered("pkg/sub", ["pkg/sub/worker.py"])


def test_a_module_the_stage_never_runs_is_reported_stale(tmp_path):
    root = _project(tmp_path, "stages:\n  run:\n    cmd: python stages/run.py\n    deps:\n      - pkg\n"
                              "      - pkg/unused.py\n      - pkg/cli.py\n")
    assert stale_deps(root, "pkg") == {"run": ["pkg/unused.py"]}
