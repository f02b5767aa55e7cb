import json
import shutil

import pytest
import yaml

from edgepath.core.errors import EdgepathError
from edgepath.rules import fleet

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
    assert params.quantize["paths"] == ["w4a8-gptq", "w4a16-tinygemm", "q4_0-gguf"]
    # a target without an engine lets the selector choose; arm64-server asks for llama.cpp
    assert {t.engine for tag, t in params.targets.items() if tag != "arm64-server"} == {"auto"}
    assert params.targets["arm64-server"].engine == "llama.cpp"


def test_a_namespace_is_read_without_the_fleet(tmp_path):
    (tmp_path / "p.yaml").write_text("quantize:\n  head: bf16\n")
    assert fleet.namespace(tmp_path / "p.yaml", "quantize") == {"head": "bf16"}
    (tmp_path / "q.yaml").write_text("quantize: [1, 2]\n")
    with pytest.raises(EdgepathError, match=r"q\.yaml: quantize: \[1, 2\] is not of type 'object'"):
        fleet.namespace(tmp_path / "q.yaml", "quantize")
    # the fleet is not read: a file without targets serves a stage that needs none
    assert fleet.namespace(tmp_path / "p.yaml", "benchmark") == {}


def _profile(name, **changes):
    from edgepath.rules.profile import HardwareProfile

    return HardwareProfile.from_dict({**json.loads((ROOT / "profiles" / f"{name}.json").read_text()), **changes})


def test_auto_platform_is_the_one_the_kind_of_device_runs_on():
    t = fleet.Target("host", "probe", "speed", "auto")
    assert t.resolve_platform(_profile("x86-avx2")) == "linux/amd64"
    assert t.resolve_platform(_profile("arm64-server")) == "linux/arm64"
    assert t.resolve_platform(_profile("phone-npu")) == "linux/amd64"  # an aarch64 phone: its export toolchain's
    with pytest.raises(EdgepathError, match="riscv64"):
        t.resolve_platform(_profile("x86-avx2", arch="riscv64"))


def mutate(data, tag, **fields):
    data["targets"][tag] = {**data["targets"][tag], **fields}
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: mutate(d, "x86-avx2", priority="fast"), r"targets\.x86-avx2\.priority: 'fast'"),
    (lambda d: mutate(d, "x86-avx2", platform="windows/amd64"), r"x86-avx2\.platform"),
    (lambda d: mutate(d, "x86-avx2", engine="tgi"), r"targets\.x86-avx2\.engine: 'tgi'"),
    (lambda d: mutate(d, "x86-avx2", profile="profiles/nope.json"), r"no such profile file 'profiles/nope.json'"),
    (lambda d: mutate(d, "x86-avx2", profile="/etc/passwd"), r"targets\.x86-avx2\.profile: '/etc/passwd' is not a path "
                                                              r"inside the repository"),
    (lambda d: mutate(d, "x86-avx2", profile="../x86-avx2.json"), r"'\.\./x86-avx2\.json' leads outside the "
                                                                   r"repository"),
    (lambda d: mutate(d, "x86-avx2", profile="profiles/../../x.json"), r"leads outside the repository"),
    (lambda d: mutate(d, "x86-avx2", profile="~/x.json"), r"not a path inside the repository"),
    (lambda d: mutate(d, "x86-avx2", profile="profiles"), r"'profiles' is not a regular file"),
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
    with pytest.raises(EdgepathError, match=r"missing\.yaml: no such file \(the params file"):
        fleet.load(tmp_path / "missing.yaml")


def test_a_cpu_build_in_vllm_needs_the_cpus_own_platform():
    from edgepath.rules.profile import HardwareProfile

    arm = HardwareProfile.from_dict(yaml.safe_load((ROOT / "profiles/arm64-server.json").read_text()))
    vllm_build = {"name": "w4a16-tinygemm", "runs_in_vllm": True}
    fleet.check_platform("arm64-server", "linux/arm64", vllm_build, arm)
    with pytest.raises(EdgepathError, match=r"arm64-server: its w4a16-tinygemm build .* must be linux/arm64 "
                                            r"\(or auto\), not linux/amd64"):
        fleet.check_platform("arm64-server", "linux/amd64", vllm_build, arm)
    # the platform follows the kind of device, whichever build: select and images plan agree
    with pytest.raises(EdgepathError, match="must be linux/arm64"):
        fleet.check_platform("arm64-server", "linux/amd64", {"name": "w4a8-xnnpack", "runs_in_vllm": False}, arm)


def test_a_profile_symlink_that_leads_out_is_refused(project):
    root, data = project
    (root / "profiles" / "zero.json").symlink_to("/dev/zero")
    with pytest.raises(EdgepathError, match=r"targets\.x86-avx2\.profile: 'profiles/zero\.json' leads outside"):
        fleet.parse(mutate(data, "x86-avx2", profile="profiles/zero.json"), root=root)


@pytest.mark.parametrize("tag", ["host\n", "x;touch F;", "$(id)", "Host", "a b", "-a", "a" * 64, "", 3, None])
def test_a_tag_that_is_not_a_device_tag_is_refused(tag):
    with pytest.raises(EdgepathError, match=r"--target: .* is not a device tag \(a device tag is lower-case"):
        fleet.check_tag(tag, "--target")


def test_the_tag_pattern_is_the_selection_schemas():
    from edgepath.core import records

    tag = records.schema("selection")["$defs"]["tag"]
    assert records.schema("params")["properties"]["targets"]["propertyNames"] == {
        "$ref": "selection.schema.json#/$defs/tag"}
    assert fleet.check_tag("arm64-server") == "arm64-server" and fleet.check_tag("a" * 63)
    assert "hint" in tag


def test_a_device_runs_on_one_platform_by_kind():
    for name, platform in [("xeon-amx", "linux/amd64"), ("arm64-server", "linux/arm64"),
                           ("phone-npu", "linux/amd64"), ("gpu-cuda", "linux/amd64")]:
        fleet.check_platform(name, platform, None, _profile(name))
    with pytest.raises(EdgepathError, match=r"target phone-npu: its build is an export, made by a toolchain for "
                                            r"linux/amd64 only, so its platform must be linux/amd64 \(or auto\), "
                                            r"not linux/arm64"):
        fleet.check_platform("phone-npu", "linux/arm64", None, _profile("phone-npu"))
    with pytest.raises(EdgepathError, match=r"its w4a16-tinygemm build runs on the device's aarch64 CPU"):
        fleet.check_platform("arm64-server", "linux/amd64", {"name": "w4a16-tinygemm"}, _profile("arm64-server"))
