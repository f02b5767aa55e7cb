"""`dvc repro` for real, in a temporary copy of the repository."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgepath import manifest, records
from edgepath.errors import EdgepathError

from .conftest import ROOT

pytestmark = pytest.mark.e2e


def _run(cmd, cwd, env):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A fresh copy of the project's files (what git would clone), pipeline run once."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    dest = tmp_path_factory.mktemp("repo")
    for rel in filter(None, files):
        if (ROOT / rel).is_file() and rel != "dvc.lock":
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1"}
    # a small calibration: the pipeline's wiring is under test here; the full-size
    # quantization belongs to `scripts/run.sh` and benchmarks/quantize.py
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["quantize"]["calibration"].update(samples=8, length=64)
    params["quantize"]["eval"].update(windows=2, length=128)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _run(["git", "init", "-q"], dest, env)
    log = _run(["dvc", "repro"], dest, env)
    return dest, env, log


def test_repro_writes_a_valid_manifest_naming_every_target(repo):
    dest, _, log = repo
    fleet = yaml.safe_load((dest / "params.yaml").read_text())["targets"]
    m = records.read(dest / "manifest.json", "manifest")
    assert [t["tag"] for t in m["targets"]] == list(fleet)
    for stage in ("model", *(f"{s}@{tag}" for s in ("probe", "select") for tag in fleet),
                  "quantize@w4a8-amx", "manifest"):
        assert f"Running stage '{stage}'" in log
    model_record = records.read(dest / "build/model/model.json", "model")
    assert m["model"]["fingerprint"] == model_record["fingerprint"]
    by_tag = {t["tag"]: t for t in m["targets"]}
    assert by_tag["phone-npu"]["path"]["name"] == "w8a16-export"
    assert by_tag["arm64-server"]["path"]["verified"] is False
    assert by_tag["arm64-server"]["platform"] == "linux/arm64"
    assert by_tag["x86-avx2"]["path"]["group_size"] == 64  # from SmolLM2's 576-wide layers
    amx = by_tag["xeon-amx"]  # the one target whose path the quantize stage builds
    assert amx["path"]["name"] == "w4a8-amx" and amx["build"]["state"] == "built"
    assert amx["quantization"]["engine_check"]["passed"] is True
    assert amx["quantization"]["engine_check"]["kernel_op"] == "_C::int4_scaled_mm_cpu"
    assert {a["path"] for a in amx["artifacts"]} >= {
        "build/weights/w4a8-amx/model.safetensors", "build/weights/w4a8-amx/quantization_report.json",
        "build/weights/w4a8-amx/engine_check.json"}
    assert by_tag["x86-avx2"]["build"]["state"] == "pending"  # w4a16: its format is not built yet
    gpu = by_tag["gpu-cuda"]
    assert gpu["build"]["state"] == "built"
    for artifact in gpu["artifacts"]:  # the bf16 checkpoint itself, hashed
        assert (dest / artifact["path"]).stat().st_size == artifact["size"]


def test_manifest_show_prints_every_target(repo):
    dest, env, _ = repo
    out = _run(["edgepath", "manifest", "show"], dest, env)
    for tag in ("host", "xeon-amx", "x86-avx2", "arm64-server", "phone-npu", "gpu-cuda"):
        assert f"\n{tag} " in out and f"\n{tag}: " in out


def test_manifest_is_validated_when_read(repo, tmp_path):
    dest, _, _ = repo
    m = json.loads((dest / "manifest.json").read_text())
    del m["targets"][0]["path"]["rationale"]
    (tmp_path / "m.json").write_text(json.dumps(m))
    with pytest.raises(EdgepathError, match="rationale"):
        records.read(tmp_path / "m.json", "manifest")


def test_changing_one_priority_reruns_only_that_target(repo):
    dest, env, _ = repo
    params = dest / "params.yaml"
    original = params.read_text()
    data = yaml.safe_load(original)
    data["targets"]["x86-avx2"]["priority"] = "fidelity"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        log = _run(["dvc", "repro"], dest, env)
        assert "Running stage 'select@x86-avx2'" in log
        for tag in ("arm64-server", "phone-npu", "gpu-cuda"):
            assert f"Stage 'select@{tag}' didn't change, skipping" in log
        assert "Stage 'model' didn't change, skipping" in log
        assert "Stage 'quantize@w4a8-amx' didn't change, skipping" in log
        m = records.read(dest / "manifest.json", "manifest")
        assert {t["tag"]: t["priority"] for t in m["targets"]}["x86-avx2"] == "fidelity"
    finally:
        params.write_text(original)


def test_stale_selection_is_refused(repo, tmp_path):
    dest, _, _ = repo
    from edgepath import fleet

    sel = tmp_path / "selections"
    shutil.copytree(dest / "build/selections", sel)
    record = json.loads((sel / "gpu-cuda.json").read_text())
    record["model"]["fingerprint"] = "sha256:" + "1" * 64
    (sel / "gpu-cuda.json").write_text(json.dumps(record))
    with pytest.raises(EdgepathError, match="another model"):
        manifest.build(fleet.load(dest / "params.yaml"), dest / "build/model/model.json", sel,
                       tmp_path / "manifest.json", dest / "build/weights")
    assert not (tmp_path / "manifest.json").exists()
