"""The package's layers, checked by import-linter against the contracts in
pyproject.toml (``[tool.importlinter]``): each layer imports only those below it, no
sibling modules import each other round, the decision logic loads no engine, and the
manifest reads the stages' records, not their code. Function-level imports count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

LINT = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT), "--no-cache", *args], cwd=cwd, capture_output=True, text=True)


def test_the_package_keeps_every_contract():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    # every contract of pyproject.toml ran, none was left out
    assert "5 kept, 0 broken" in done.stdout, done.stdout


def _package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


_CONTRACTS = """\
[tool.importlinter]
root_package = "pkg"

[[tool.importlinter.contracts]]
name = "layers"
type = "layers"
layers = ["pkg.stages", "pkg.rules", "pkg.core"]

[[tool.importlinter.contracts]]
name = "no cycles"
type = "acyclic_siblings"
ancestors = ["pkg"]
"""


_LAYERS = {"pyproject.toml": _CONTRACTS, "pkg/__init__.py": "", "pkg/core/__init__.py": "",
           "pkg/rules/__init__.py": "", "pkg/stages/__init__.py": ""}
"""A package of three empty layers under the contracts above."""


def test_an_import_up_a_layer_inside_a_function_breaks_the_contract(tmp_path):
    root = _package(tmp_path, {
        **_LAYERS,
        "pkg/core/errors.py": "",
        "pkg/rules/select.py": "from ..core import errors\n\ndef pick():\n    from ..stages import run\n",
        "pkg/stages/run.py": "from ..rules import select\n",
    })
    done = _lint(root)
    assert done.returncode == 1
    assert "pkg.rules is not allowed to import pkg.stages" in done.stdout
    assert "pkg.rules.select -> pkg.stages.run" in done.stdout


def test_a_cycle_between_siblings_breaks_the_contract(tmp_path):
    root = _package(tmp_path, {
        **_LAYERS,
        "pkg/rules/a.py": "from . import b\n",
        "pkg/rules/b.py": "def f():\n    from . import a\n",
    })
    done = _lint(root)
    assert done.returncode == 1 and "no cycles BROKEN" in done.stdout, done.stdout


def test_importing_the_manifest_loads_no_engine_or_tensor_library():
    # the contract holds the manifest's own imports; its path families load engines only
    # inside the functions that run them, which the manifest never calls
    code = ("import sys, edgepath.stages.manifest, edgepath.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'vllm', 'executorch', "
            "'torchao', 'llama_cpp', 'numpy', 'safetensors', 'gguf'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
