import shutil

import pytest
import yaml

from edgepath import fleet
from edgepath.errors import EdgepathError

from .conftest import ROOT


@pytest.fixture
def project(tmp_path):
    shutil.copytree(ROOT / "profiles", tmp_path / "profiles")
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    return tmp_path, data


def test_shipped_params_are_valid():
    params = fleet.load(ROOT / "params.yaml")
    assert list(params.targets) == ["host", "xeon-amx", "x86-avx2", "arm64-server", "phone-npu", "phone-cpu",
                                    "gpu-cuda"]
    assert params.targets["host"].profile == fleet.PROBE
    assert params.model_source == "embedded"
    assert params.quantize["paths"] == ["w4a8-amx", "w4a16-tinygemm"]


def test_a_namespace_is_read_without_the_fleet(tmp_path):
    (tmp_path / "p.yaml").write_text("quantize:\n  head: bf16\n")
    assert fleet.namespace(tmp_path / "p.yaml", "quantize") == {"head": "bf16"}
    (tmp_path / "q.yaml").write_text("quantize: [1, 2]\n")
    with pytest.raises(EdgepathError, match="quantize: expected a mapping"):
        fleet.namespace(tmp_path / "q.yaml", "quantize")


def test_auto_platform_follows_the_architecture():
    t = fleet.Target("host", "probe", "speed", "auto")
    assert t.resolve_platform("x86_64") == "linux/amd64"
    assert t.resolve_platform("aarch64") == "linux/arm64"
    with pytest.raises(EdgepathError, match="riscv64"):
        t.resolve_platform("riscv64")


def mutate(data, tag, **fields):
    data["targets"][tag] = {**data["targets"][tag], **fields}
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: mutate(d, "x86-avx2", priority="fast"), r"targets\.x86-avx2\.priority: 'fast'"),
    (lambda d: mutate(d, "x86-avx2", platform="windows/amd64"), r"x86-avx2\.platform"),
    (lambda d: mutate(d, "x86-avx2", profile="profiles/nope.json"), r"no such profile file 'profiles/nope.json'"),
    (lambda d: mutate(d, "x86-avx2", prority="speed"), r"unknown field\(s\) prority"),
    (lambda d: d["targets"]["gpu-cuda"].pop("platform") and d, r"gpu-cuda: missing field\(s\) platform"),
    (lambda d: {**d, "targets": [{"tag": "host"}]}, "a mapping, not a list"),
    (lambda d: {**d, "targets": {}}, "a mapping, not a list"),
    (lambda d: {**d, "targets": {"Bad Tag": d["targets"]["host"]}}, "device tag"),
    (lambda d: {**d, "model": {"source": 3}}, "model.source"),
])
def test_bad_params_are_refused_with_the_field_named(project, change, message):
    root, data = project
    with pytest.raises(EdgepathError, match=message):
        fleet.parse(change(data), root=root)


def test_unknown_device_tag_is_refused(project):
    root, data = project
    with pytest.raises(EdgepathError, match="unknown device tag 'toaster'.*host"):
        fleet.parse(data, root=root).target("toaster")


def test_unreadable_params_file(tmp_path):
    (tmp_path / "params.yaml").write_text("targets: [unclosed\n")
    with pytest.raises(EdgepathError, match="not valid YAML"):
        fleet.load(tmp_path / "params.yaml")
    with pytest.raises(EdgepathError, match="no such params file"):
        fleet.load(tmp_path / "missing.yaml")
