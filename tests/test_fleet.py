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
    with pytest.raises(EdgepathError, match=r"q\.yaml: quantize: \[1, 2\] is not of type 'object'"):
        fleet.namespace(tmp_path / "q.yaml", "quantize")
    # the fleet is not read: a file without targets serves a stage that needs none
    assert fleet.namespace(tmp_path / "p.yaml", "benchmark") == {}


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
    (lambda d: mutate(d, "x86-avx2", prority="speed"), r"targets\.x86-avx2\.prority: unknown key"),
    (lambda d: d["targets"]["gpu-cuda"].pop("platform") and d, r"targets\.gpu-cuda\.platform: missing"),
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


def test_a_cpu_build_in_vllm_needs_the_cpus_own_platform():
    from edgepath.profile import HardwareProfile

    arm = HardwareProfile.from_dict(yaml.safe_load((ROOT / "profiles/arm64-server.json").read_text()))
    vllm_build = {"name": "w4a16-tinygemm", "runs_in_vllm": True}
    fleet.check_platform("arm64-server", "linux/arm64", vllm_build, arm)
    with pytest.raises(EdgepathError, match="arm64-server: its w4a16-tinygemm build .* must be linux/arm64, not "
                                            "linux/amd64"):
        fleet.check_platform("arm64-server", "linux/amd64", vllm_build, arm)
    # a build made on a build machine (a phone's export) may be made on any platform
    fleet.check_platform("arm64-server", "linux/amd64", {"name": "w4a8-xnnpack", "runs_in_vllm": False}, arm)
