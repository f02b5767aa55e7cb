"""The container images and the CI that builds them.

Static checks run on every change, offline: GitHub's workflow schema and actionlint
on .github/workflows, hadolint on every Dockerfile, `dvc stage list` on the pipeline,
and docker-bake.json against the image table. Each check is also shown to fail on a
broken input, so a green run means something.

The slow test builds the x86-64 CPU image for real with images/build (buildah,
daemonless, from a debootstrap'ed base) and runs its smoke test and a stage inside it.
The arm64 image is built by `images/build --arm64` under QEMU (about 20 minutes), too
slow for the suite; its result is recorded in docs/images/.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgepath.core.errors import EdgepathError
from edgepath.delivery import images
from edgepath.rules import coverage, fleet, select
from edgepath.rules.profile import HardwareProfile

from .conftest import ROOT, edgepath_command

BIN = Path(sys.executable).parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTIONS = sorted((ROOT / ".github" / "actions").glob("*/action.yml"))
DOCKERFILES = sorted((ROOT / "images").glob("*/Dockerfile"))


def _tool(name: str, *args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *map(str, args)], capture_output=True, text=True, cwd=cwd)


RUN_ARGS = "--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=4096:4096"
"""What this project's build machines need for `podman run` (images/build's default)."""


def _profile(name: str) -> HardwareProfile:
    return HardwareProfile.from_dict(json.loads((ROOT / "profiles" / f"{name}.json").read_text()))


# --- the workflows --------------------------------------------------------------------

def test_there_is_a_workflow_for_the_images_and_one_for_the_pipeline():
    assert [w.name for w in WORKFLOWS] == ["images.yml", "pipeline.yml"]
    assert [a.parent.name for a in ACTIONS] == ["dvc-remote"]


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_matches_githubs_schema_and_passes_actionlint(workflow):
    done = _tool("check-jsonschema", "--builtin-schema", "vendor.github-workflows", workflow)
    assert done.returncode == 0, done.stdout + done.stderr
    done = _tool("actionlint", "-no-color", workflow)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("action", ACTIONS, ids=lambda p: p.parent.name)
def test_local_action_matches_githubs_schema(action):
    done = _tool("check-jsonschema", "--builtin-schema", "vendor.github-actions", action)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_broken_workflow_fails_both_checks(tmp_path):
    workflow = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    # a job with no runner: invalid for the schema
    workflow["jobs"]["plan"].pop("runs-on")
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(workflow))
    assert _tool("check-jsonschema", "--builtin-schema", "vendor.github-workflows", broken).returncode != 0
    # an expression naming an output no job defines: valid YAML, caught by actionlint
    text = (ROOT / ".github/workflows/images.yml").read_text()
    typo = tmp_path / "typo.yml"
    typo.write_text(text.replace("needs.plan.outputs.builds", "needs.plan.outputs.bulids"))
    done = _tool("actionlint", "-no-color", typo)
    assert done.returncode != 0 and "bulids" in done.stdout


def test_no_credentials_in_the_workflows():
    for workflow in WORKFLOWS + ACTIONS:
        text = workflow.read_text()
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "password"):
            for line in text.splitlines():
                if key in line and ":" in line and not line.strip().startswith("#"):
                    value = line.split(":", 1)[1].strip()
                    assert value.startswith("${{ secrets."), f"{workflow.name}: {line.strip()}"


# --- the Dockerfiles ---------------------------------------------------------------

def test_one_dockerfile_per_runtime():
    assert sorted(p.parent.name for p in DOCKERFILES) == sorted({i.runtime for i in images.IMAGES.values()})
    # the CPU runtime, for both architectures
    assert images.IMAGES["cpu-arm64"].dockerfile == images.IMAGES["cpu-vllm"].dockerfile


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint_and_follows_the_conventions(dockerfile):
    done = _tool("hadolint", dockerfile)
    assert done.returncode == 0, done.stdout + done.stderr
    text = dockerfile.read_text()
    # one Dockerfile for CI's public base and images/build's local one
    assert f"ARG BASE={images.PUBLIC_BASE}\nFROM ${{BASE}}" in text
    for label in ("org.opencontainers.image.source", "org.opencontainers.image.revision",
                  'io.edgepath.image="${IMAGE}"', 'io.edgepath.targets="${TARGETS}"'):
        assert label in text
    user = [line for line in text.splitlines() if line.startswith("USER ")]
    assert user == ["USER 10001:10001"]  # numeric, so runAsNonRoot can check it


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y python3\n")
    done = _tool("hadolint", bad)
    assert done.returncode != 0 and "DL3007" in done.stdout  # 'latest'


def test_bake_file_is_generated_from_the_image_table_and_fleet():
    committed = (ROOT / "docker-bake.json").read_text()
    assert committed == images.bake_json(fleet.load(ROOT / "params.yaml"), ROOT), (
        "docker-bake.json is stale: run `edgepath images bake --out docker-bake.json`")
    bake = json.loads(committed)
    assert bake["group"]["default"]["targets"] == list(images.IMAGES)
    for name, image in images.IMAGES.items():
        target = bake["target"][name]
        assert target["dockerfile"] == image.dockerfile and (ROOT / target["dockerfile"]).is_file()
        assert target["platforms"] == list(image.platforms)
        assert (target["args"]["IMAGE"], target["args"]["DESCRIPTION"]) == (name, image.description)
    assert bake["target"]["cpu-vllm"]["args"]["TARGETS"] == "xeon-amx,x86-avx2"
    assert bake["target"]["cpu-arm64"]["args"]["TARGETS"] == "arm64-server"


def test_dvc_sees_every_stage():
    done = _tool("dvc", "stage", "list", "--name-only")
    assert done.returncode == 0, done.stderr
    stages = set(done.stdout.split())
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for tag in params["targets"]:
        assert {f"probe@{tag}", f"select@{tag}"} <= stages
    for path in params["quantize"]["paths"]:
        assert {f"quantize@{path}", f"patch_verify@{path}"} <= stages
    assert {"model", "control", "benchmark", "manifest"} <= stages


# --- which image serves which device ------------------------------------------------

@pytest.mark.parametrize("profile, image", [
    ("xeon-amx", "cpu-vllm"), ("x86-avx2", "cpu-vllm"), ("arm64-server", "cpu-arm64"),
    ("phone-npu", "export"), ("phone-cpu", "export"), ("gpu-cuda", "gpu"),
])
def test_a_device_gets_the_image_of_its_runtime(profile, image):
    p = _profile(profile)
    assert images.image_for_profile(p).name == image
    # the export image is for phones: the selector's own test of what a phone is
    assert (image == "export") == (coverage.device_class(p) is coverage.DeviceClass.PHONE)


def test_no_image_for_an_unknown_architecture():
    data = json.loads((ROOT / "profiles/x86-avx2.json").read_text())
    data.update(arch="riscv64")
    with pytest.raises(EdgepathError, match="riscv64"):
        images.image_for_profile(HardwareProfile.from_dict(data))


def test_a_target_whose_platform_its_image_lacks_is_refused():
    target = fleet.Target("arm64-server", "profiles/arm64-server.json", "speed", "linux/amd64")
    with pytest.raises(EdgepathError, match=r"arm64-server.*aarch64 CPU.*must be linux/arm64 \(or auto\), "
                                            r"not linux/amd64"):
        images.image_for_target(target, ROOT)
    phone = fleet.Target("phone-npu", "profiles/phone-npu.json", "speed", "linux/arm64")
    with pytest.raises(EdgepathError, match=r"phone-npu.*export.*must be linux/amd64 \(or auto\), not linux/arm64"):
        images.image_for_target(phone, ROOT)


@pytest.mark.parametrize("kind", list(coverage.DeviceClass))
def test_each_device_image_is_built_for_the_platform_the_fleet_rule_names(kind):
    """select and images plan apply one rule (fleet.check_platform); the image serving a
    kind of device is built for exactly that rule's platform."""
    assert images.IMAGES[images.IMAGE_OF_DEVICE[kind]].platforms == (fleet.PLATFORM_OF_DEVICE[kind],)


def test_a_target_argument_is_checked_in_either_form():
    assert images.target_argument("select", ["--profile", "p.json", "--target=arm64-server"]) == "arm64-server"
    assert images.target_argument("quantize", ["--path", "w4a8-gptq"]) is None
    with pytest.raises(EdgepathError, match=r"select --target: 'x;id' is not a device tag"):
        images.target_argument("select", ["--target", "x;id"])
    with pytest.raises(EdgepathError, match="probe: --target needs a device tag"):
        images.target_argument("probe", ["--target"])


def test_plan_tags_every_captured_device_and_leaves_the_probed_host_out():
    params = fleet.load(ROOT / "params.yaml")
    plan = images.plan(params, ROOT, "ghcr.io/acme", "1.2.0")
    devices = {d["tag"]: d for d in plan["devices"]}
    assert set(devices) == {t for t, target in params.targets.items() if target.profile != fleet.PROBE}
    assert devices["arm64-server"]["source"] == "ghcr.io/acme/edgepath-cpu-arm64:1.2.0"
    assert devices["arm64-server"]["references"] == ["ghcr.io/acme/edgepath:arm64-server-1.2.0",
                                                     "ghcr.io/acme/edgepath:arm64-server"]
    by_image = {i["name"]: i for i in plan["images"]}
    assert by_image["export"]["targets"] == ["phone-npu", "phone-cpu"]
    assert by_image["gpu"]["built_here"] is False


def test_stages_run_in_the_image_of_their_device_or_the_build_host():
    params = fleet.load(ROOT / "params.yaml")
    pick = lambda stage, *args: images.image_for_stage(stage, list(args), params, ROOT).name  # noqa: E731
    assert pick("select", "--target", "arm64-server", "--profile", "x.json") == "cpu-arm64"
    assert pick("probe", "--target", "phone-npu") == "export"
    assert pick("quantize", "--path", "w4a8-gptq") == "cpu-vllm"
    assert pick("export", "--path", "w4a8-xnnpack") == "export"
    with pytest.raises(EdgepathError, match="unknown device tag 'nope'"):
        pick("select", "--target", "nope")


# --- edgepath run -------------------------------------------------------------------

def test_run_without_in_image_runs_the_stage_here():
    done = edgepath_command("run", "select", "--profile", "profiles/arm64-server.json")
    assert json.loads(done.stdout)["name"] == select.select_weight_path(_profile("arm64-server"), "speed").name


def test_run_in_image_without_a_container_tool_says_so(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no podman, no docker
    done = subprocess.run([str(BIN / "edgepath"), "run", "--in-image", "probe"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "no container tool (podman or docker) on PATH" in done.stderr


def test_run_refuses_an_unknown_stage_or_image():
    done = edgepath_command("run", "deploy", check=False)
    assert done.returncode == 2 and "invalid choice: 'deploy'" in done.stderr
    done = edgepath_command("run", "--in-image", "--image", "tpu", "probe", check=False)
    assert done.returncode == 2 and "unknown image 'tpu'" in done.stderr


@pytest.mark.skipif(shutil.which("podman") is None, reason="podman not installed (scripts/setup_images.sh)")
def test_run_in_an_image_that_is_not_there_says_how_to_get_it():
    env = {**os.environ, images.RUN_ARGS_ENV: RUN_ARGS}
    done = subprocess.run([str(BIN / "edgepath"), "run", "--in-image", "--version", "no-such-version", "probe"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "probe in localhost/edgepath-cpu-vllm:no-such-version exited with 125; build it with images/build" \
        in done.stderr


# --- the images, built and run for real ---------------------------------------------

def _cannot_build() -> str | None:
    missing = [t for t in ("buildah", "podman", "debootstrap") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (scripts/setup_images.sh installs them on Debian, as root)"
    if os.getuid() != 0:
        return "images/build needs root (debootstrap, buildah's chroot isolation)"
    return None


@pytest.fixture(scope="module")
def cpu_vllm_image():
    reason = _cannot_build()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([str(ROOT / "images" / "build")], cwd=ROOT, capture_output=True, text=True,
                          timeout=40 * 60)
    assert done.returncode == 0, done.stderr[-4000:]
    smoke = json.loads((ROOT / "build/images/smoke-cpu-vllm.json").read_text())
    return smoke["reference"], smoke


@pytest.mark.slow
def test_cpu_vllm_image_builds_and_its_smoke_test_passes(cpu_vllm_image):
    from edgepath.stages import probe

    reference, smoke = cpu_vllm_image
    host = probe.probe()
    assert smoke["machine"] == "x86_64" and smoke["uid"] == 10001
    assert smoke["probe"]["kernel_isa"] == host.kernel_isa()
    # the selector inside the image picks what it picks here, for the same machine
    assert smoke["select"]["name"] == select.select_weight_path(host, "speed").name
    # vLLM imports and loads the kernel build for this CPU's tier: one image, every tier
    vllm = smoke["vllm"]
    assert vllm["installed"] and vllm["version"] == "0.32.0" and vllm["torch"] == "2.13.0+cpu"
    expected = {"x86_64 AVX2": "_C_AVX2.abi3.so", "x86_64 AVX512": "_C_AVX512.abi3.so"}.get(
        host.kernel_isa(), "_C.abi3.so")
    assert vllm["kernel_libraries"] == [expected]

    labels = json.loads(subprocess.run(["podman", "image", "inspect", "--format", "{{json .Labels}}", reference],
                                       check=True, capture_output=True, text=True).stdout)
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == (revision or "unknown")
    assert labels["io.edgepath.image"] == "cpu-vllm"
    assert labels["io.edgepath.targets"] == "xeon-amx,x86-avx2"


@pytest.mark.slow
def test_a_stage_runs_inside_its_image(cpu_vllm_image, tmp_path):
    """`edgepath run --in-image`: the stage runs in the image with the work tree mounted,
    reads a relative path, and writes its output into the work tree as the caller."""
    from edgepath.stages import probe

    out = Path("build/images/in-image-host.json")
    (ROOT / out).unlink(missing_ok=True)
    env = {**os.environ, images.RUN_ARGS_ENV: RUN_ARGS}
    done = subprocess.run([str(BIN / "edgepath"), "run", "--in-image", "probe", "--target", "host", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run: podman run --rm --platform linux/amd64 --user {os.getuid()}:{os.getgid()}" in done.stderr
    assert cpu_vllm_image[0] in done.stderr
    inside = HardwareProfile.from_dict(json.loads((ROOT / out).read_text()))
    here = probe.probe()
    assert (inside.arch, inside.cpu_model, inside.kernel_isa()) == (here.arch, here.cpu_model, here.kernel_isa())
    assert (ROOT / out).stat().st_uid == os.getuid()
