"""The weight-path families (``edgepath/paths/``): every registry record has one, and
the stages are loops over paths that name none and branch on no engine."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from edgepath import paths
from edgepath.core.errors import EdgepathError
from edgepath.rules import weight_paths
from edgepath.rules.weight_paths import Engine

from .conftest import ROOT

STAGES = sorted((ROOT / "edgepath" / "stages").glob("*.py"))
DELIVERY = sorted((ROOT / "edgepath" / "delivery").glob("*.py"))
# The names a stage must not carry: every path's and former path's name that cannot be
# read as something else ("bf16" is also a dtype, a head's storage, a control's name).
PATH_NAMES = sorted(n for n in [*weight_paths.PATHS, *weight_paths.RENAMED] if "-" in n)
ENGINE_VALUES = {e.value for e in Engine}


def path_knowledge(source: str) -> list[str]:
    """Where ``source`` (a module's text) names a weight path or branches on an engine:
    a path's name anywhere (code, docstring, help), ``Engine.<member>``, a comparison
    with an engine's name, or a comparison of anything's ``engine``."""
    found = [f"names {name}" for name in PATH_NAMES
             if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Engine":
            found.append(f"line {node.lineno}: Engine.{node.attr}")
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in ENGINE_VALUES for o in operands) or any(
                    isinstance(o, ast.Attribute) and o.attr == "engine" or
                    isinstance(o, ast.Subscript) and isinstance(o.slice, ast.Constant) and o.slice.value == "engine"
                    for o in operands):
                found.append(f"line {node.lineno}: a comparison on an engine")
    return found


@pytest.mark.parametrize("module", STAGES, ids=lambda p: p.stem)
def test_no_stage_names_a_path_or_branches_on_an_engine(module):
    assert path_knowledge(module.read_text()) == [], f"{module.name}: ask the path's family (edgepath/paths/)"


@pytest.mark.parametrize("module", DELIVERY, ids=lambda p: p.stem)
def test_delivery_branches_on_no_engine(module):
    assert [f for f in path_knowledge(module.read_text()) if not f.startswith("names ")] == []


@pytest.mark.parametrize("snippet, finding", [
    ('if spec.engine is Engine.LLAMA_CPP:\n    pass\n', "Engine.LLAMA_CPP"),
    ('if record["engine"] == "llama.cpp":\n    pass\n', "a comparison on an engine"),
    ('if spec.engine != other:\n    pass\n', "a comparison on an engine"),
    ('QNN = "w8a16-qnn"\n', "names w8a16-qnn"),
    ('"""builds w4a8-amx too"""\n', "names w4a8-amx"),
])
def test_the_check_sees_a_path_name_and_an_engine_branch(snippet, finding):
    assert any(finding in f for f in path_knowledge(snippet)), path_knowledge(snippet)


def test_a_path_name_inside_another_word_is_not_a_path_name():
    assert path_knowledge('"q4_0-gguf-like", "my-w4a8-gptq"\n') == []


@pytest.mark.parametrize("name", list(weight_paths.PATHS))
def test_every_record_has_the_family_of_its_engine_and_stage(name):
    spec = weight_paths.get(name)
    family = paths.of(name)
    assert (family.engine, family.built_by) == (spec.engine, spec.built_by) and family.spec is spec
    # a quantize-stage build writes a check record the manifest can summarise
    assert (family.check_kind is not None) == (spec.built_by is weight_paths.Stage.QUANTIZE)


def test_a_former_name_reaches_its_path_s_family():
    assert paths.of("w4a8-amx").spec is weight_paths.get("w4a8-gptq")


def test_what_a_family_does_not_do_is_refused_by_name():
    with pytest.raises(EdgepathError, match="w8a16-qnn is a executorch path built by the export stage: it has no "
                                            "benchmark arm"):
        paths.of("w8a16-qnn").benchmark_arm(Path("."), 1)


def test_a_record_no_family_builds_is_refused(monkeypatch):
    spec = weight_paths.WeightPathSpec(name="fp8-npu", engine=Engine.EXECUTORCH, built_by=weight_paths.Stage.MODEL,
                                       summary="", activations="", weight_bits=8)
    with pytest.raises(EdgepathError, match="fp8-npu: no family builds executorch paths of the model stage"):
        paths.of(spec)
