"""params.yaml against its one JSON Schema (edgepath/schemas/params.schema.json):
what it refuses, how it says so, and that it agrees with the stages that read it."""

import dataclasses
import re

import jsonschema
import pytest
import yaml

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.rules import fleet, select
from edgepath.stages import benchmark, calibrate, export, quantize

from .conftest import ROOT


@pytest.fixture
def shipped():
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def write(tmp_path, data) -> str:
    """``data`` as tmp_path/params.yaml, with the captured profiles it names."""
    (tmp_path / "profiles").mkdir(exist_ok=True)
    for f in (ROOT / "profiles").glob("*.json"):
        (tmp_path / "profiles" / f.name).write_text(f.read_text())
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_schema_is_a_valid_draft_2020_12_schema():
    schema = records.schema("params")
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_the_shipped_params_conform(shipped):
    fleet.validate(shipped, "params.yaml")
    assert set(shipped) == set(records.schema("params")["properties"])


def _set(data, dotted, value):
    *parents, key = dotted.split(".")
    for p in parents:
        data = data[p]
    data[key] = value


def _delete(data, dotted):
    *parents, key = dotted.split(".")
    for p in parents:
        data = data[p]
    del data[key]


@pytest.mark.parametrize("change, message", [
    # an unknown key: a typo, an old layout, a namespace no stage reads
    (lambda d: _set(d, "quantize.gptq.dampening", 0.1),
     "params.yaml: quantize.gptq.dampening: unknown key (known: search, damp, group_order)"),
    (lambda d: _set(d, "quantize.calibration", {"corpus": "austen"}),
     "params.yaml: quantize.calibration: unknown key (known: paths, head, w4a8_bf16_down_proj, true_sequential, rotate, gptq, eval)"),
    (lambda d: _set(d, "quantise", {}), "params.yaml: quantise: unknown key (known: model, targets, calibration, "
                                        "quantize, export, control, benchmark, manifest)"),
    (lambda d: _set(d, "targets.host.prority", "speed"), "params.yaml: targets.host.prority: unknown key"),
    # a wrong type
    (lambda d: _set(d, "quantize.gptq.damp", "x"), "params.yaml: quantize.gptq.damp: 'x' is not of type 'number'"),
    (lambda d: _set(d, "benchmark.passes", 3.0), "params.yaml: benchmark.passes: 3.0 is not of type 'integer'"),
    (lambda d: _set(d, "calibration.samples", True), "params.yaml: calibration.samples: True is not of type 'integer'"),
    (lambda d: _set(d, "calibration.holdout", "persuasion"),
     "params.yaml: calibration.holdout: 'persuasion' is not of type 'array' (a list of document names)"),
    (lambda d: _set(d, "export.qnn", [1]), "params.yaml: export.qnn: [1] is not of type 'object'"),
    # a value out of range, or not one of the choices
    (lambda d: _set(d, "benchmark.passes", 2), "params.yaml: benchmark.passes: 2 is less than the minimum of 3"),
    (lambda d: _set(d, "quantize.gptq.search", "magic"), "params.yaml: quantize.gptq.search: 'magic' is not one of"),
    (lambda d: _set(d, "quantize.paths", ["w4a8-gptq", "w3a8"]),
     "params.yaml: quantize.paths.1: 'w3a8' is not one of the paths the quantize stage builds (w4a8-gptq, "),
    (lambda d: _set(d, "quantize.paths", ["w4a8-amx"]),
     "quantize.paths.0: 'w4a8-amx' is not one of the paths the quantize stage builds (w4a8-gptq, w4a16-tinygemm, "
     "q4_0-gguf); 'w4a8-amx' was renamed 'w4a8-gptq': write that"),
    (lambda d: _set(d, "export.paths", ["w4a8-gptq"]),
     "params.yaml: export.paths.0: 'w4a8-gptq' is not one of the paths the export stage builds"),
    (lambda d: _set(d, "targets.host.platform", "windows/amd64"), "params.yaml: targets.host.platform: 'windows/amd64'"),
    # a missing required field
    (lambda d: _delete(d, "targets.gpu-cuda.platform"), "params.yaml: targets.gpu-cuda.platform: missing (required)"),
    (lambda d: _delete(d, "model.source"), "params.yaml: model.source: missing (required)"),
    (lambda d: _delete(d, "targets"), "params.yaml: targets: missing (required)"),
    # a device tag that cannot name a stage, an artifact and a git tag
    (lambda d: d["targets"].update({"Bad Tag": dict(d["targets"]["host"])}),  # a copy: YAML would alias it
     "params.yaml: targets.Bad Tag: 'Bad Tag' does not match"),
])
def test_a_bad_params_file_is_refused_in_one_line_naming_the_key_path(tmp_path, shipped, change, message):
    change(shipped)
    path = write(tmp_path, shipped)
    with pytest.raises(EdgepathError) as refused:
        fleet.load(path)
    text = str(refused.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert text.removeprefix(f"{path}: ").startswith(message.removeprefix("params.yaml: ")), text


def test_a_namespace_is_checked_alone(tmp_path, shipped):
    shipped["targets"]["host"]["priority"] = "fast"  # a stage that reads no fleet is not refused for it
    shipped["quantize"]["gptq"]["damp"] = "x"
    path = write(tmp_path, shipped)
    assert fleet.namespace(path, "benchmark") == shipped["benchmark"]
    assert fleet.calibration(path) == fleet.Calibration()
    with pytest.raises(EdgepathError, match=rf"^{re.escape(str(path))}: quantize\.gptq\.damp: 'x' is not of type"):
        fleet.namespace(path, "quantize")
    with pytest.raises(EdgepathError, match=r"targets\.host\.priority: 'fast' is not one of"):
        fleet.load(path)


def test_every_stage_reads_the_shipped_params_as_its_defaults():
    params = ROOT / "params.yaml"
    assert fleet.calibration(params) == fleet.Calibration()
    assert quantize.Settings.from_params(fleet.namespace(params, "quantize"),
                                         fleet.namespace(params, "calibration")) == quantize.Settings()
    assert export.Settings.from_file(params) == export.Settings()
    assert calibrate.Settings.from_params(fleet.namespace(params, "calibration"),
                                          fleet.namespace(params, "quantize")) == calibrate.Settings()
    assert benchmark.Settings.from_params(fleet.namespace(params, "benchmark")) == benchmark.Settings()


def test_quantize_flags_override_params_and_are_checked_like_them():
    settings = quantize.Settings.from_params({"head": "int4", "gptq": {"damp": 0.1}}, {"samples": 64},
                                             search="none", head="bf16")
    assert (settings.calibration.samples, settings.search, settings.head, settings.damp) == (64, "none", "bf16", 0.1)
    unchanged = quantize.Settings.from_params({"true_sequential": ["q4_0-gguf"]}, {"samples": 64}, search=None)
    assert (unchanged.calibration.samples, unchanged.search, unchanged.true_sequential) == \
        (64, "output-error", ("q4_0-gguf",))
    with pytest.raises(EdgepathError, match=r"^flags: quantize\.gptq\.search: 'magic' is not one of"):
        quantize.Settings.from_params({}, {}, where="flags", search="magic")
    with pytest.raises(EdgepathError, match=r"calibration\.samples: 0 is less than the minimum of 1"):
        quantize.Settings.from_params({}, {"samples": 0})
    with pytest.raises(EdgepathError, match=r"quantize\.true_sequential\.0: 'w8a16-qnn' is not one of the paths"):
        quantize.Settings.from_params({"true_sequential": ["w8a16-qnn"]}, {})


def test_rotation_is_taken_per_quantize_path():
    settings = quantize.Settings.from_params({"rotate": ["q4_0-gguf", "w4a16-tinygemm"]}, {})
    assert settings.rotate == ("q4_0-gguf", "w4a16-tinygemm")
    assert quantize.Settings.from_params({}, {}).rotate == ()
    # the phone's programs are the export stage's: they are not rotated
    with pytest.raises(EdgepathError, match=r"quantize\.rotate\.0: 'w4a8-xnnpack' is not one of the paths"):
        quantize.Settings.from_params({"rotate": ["w4a8-xnnpack"]}, {})


# -- the schema and the code that reads the settings say the same ----------------------

def _properties(*path):
    node = records.schema("params")
    for name in path:
        node = node["properties"][name]
    return node


def test_the_schema_names_every_setting_a_stage_has():
    assert set(_properties("calibration")["properties"]) == {f.name for f in dataclasses.fields(fleet.Calibration)}
    assert set(_properties("benchmark")["properties"]) == {f.name for f in dataclasses.fields(benchmark.Settings)}
    assert set(_properties("export", "qnn")["properties"]) == {f.name for f in dataclasses.fields(export.QnnSettings)}
    assert set(_properties("export", "xnnpack")["properties"]) == {
        f.name for f in dataclasses.fields(export.XnnpackSettings)}
    quantize_keys = ({"calibration"} | set(_properties("quantize")["properties"]) - {"paths", "gptq", "eval"}
                     | set(_properties("quantize", "gptq")["properties"]))
    assert quantize_keys == {f.name for f in dataclasses.fields(quantize.Settings)}
    assert ({"calibration"} | {f"eval_{k}" for k in _properties("quantize", "eval")["properties"]}
            == {f.name for f in dataclasses.fields(calibrate.Settings)})


def test_the_schema_choices_are_the_code_choices():
    target = records.schema("params")["$defs"]["target"]["properties"]
    assert target["priority"]["enum"] == list(select.PRIORITIES)
    assert target["platform"]["enum"] == [*fleet.PLATFORMS, fleet.AUTO]
    assert target["engine"]["enum"] == list(select.ENGINES) == \
        records.schema("selection")["properties"]["engine"]["enum"]
    assert select.ENGINES[0] == fleet.AUTO == fleet.Target("t", "probe", "speed", "auto").engine
    assert _properties("quantize", "head")["enum"] == list(quantize.HEADS)
    assert _properties("quantize", "gptq", "search")["enum"] == list(quantize.SEARCH_NAMES)
    assert set(quantize.OVERRIDES) == {"search", "head"}


def test_dvc_yaml_params_name_keys_of_params_yaml(shipped):
    """Every ``params:`` entry of dvc.yaml is a key of params.yaml (a stale one, such as
    the old quantize.calibration, would make DVC track nothing)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    tag = next(iter(shipped["targets"]))
    checked = 0
    for name, stage in stages.items():
        for entry in stage.get("do", stage).get("params", []):
            node = shipped
            for part in entry.replace("${key}", tag).split("."):
                assert isinstance(node, dict) and part in node, f"dvc.yaml stage {name}: no params key {entry}"
                node = node[part]
            checked += 1
    assert checked > 10
