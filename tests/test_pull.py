"""`edgepath pull`'s checks that need no remote: dvc.lock's outputs and manifest paths."""

from pathlib import Path

import pytest

from edgepath import pull
from edgepath.errors import EdgepathError

ROOT = Path(__file__).resolve().parent.parent

LOCK = """\
schema: '2.0'
stages:
  model:
    cmd: python stages/model.py
    outs:
    - path: build/model
      hash: md5
      md5: 0123456789abcdef0123456789abcdef.dir
  manifest:
    cmd: python stages/manifest.py
    outs:
    - path: manifest.json
      hash: md5
      md5: fedcba9876543210fedcba9876543210
"""


def test_lock_outputs_names_files_and_directories():
    outs = {o.path: o for o in pull.lock_outputs(LOCK)}
    assert set(outs) == {"build/model", "manifest.json"}
    assert outs["build/model"].is_dir and not outs["manifest.json"].is_dir


@pytest.mark.parametrize("text", ["", "stages: 3", "stages:\n  x:\n    cmd: y\n", ": : :"])
def test_lock_without_outputs_is_refused(text):
    with pytest.raises(EdgepathError, match="dvc.lock"):
        pull.lock_outputs(text)


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", "", "a\\..\\b"])
def test_paths_leaving_the_directory_are_refused(path):
    with pytest.raises(EdgepathError, match="refused path"):
        pull.safe_relative(path, "manifest")


def test_plain_relative_paths_pass():
    assert pull.safe_relative("build/weights/w4a16-tinygemm/model.safetensors", "m") == \
        "build/weights/w4a16-tinygemm/model.safetensors"


def test_pull_refuses_to_overwrite_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(EdgepathError, match="not an earlier pull"):
        pull.pull(tmp_path, "host", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def _profile(name):
    from edgepath import records
    from edgepath.profile import HardwareProfile

    return HardwareProfile.from_dict(records.read(ROOT / "profiles" / f"{name}.json", "profile"))


def _target(tag, path, priority, profile):
    return {"tag": tag, "priority": priority, "path": {"name": path}, "profile": {"summary": profile.summary()},
            "artifacts": [{"path": f"build/weights/{path}/model.safetensors", "size": 1, "sha256": "0" * 64}]}


def test_probe_picks_the_target_built_with_the_selected_path_and_same_isa_tier():
    manifest = {"targets": [
        _target("amx", "w4a8-amx", "speed", _profile("xeon-amx")),
        _target("avx2", "w4a16-tinygemm", "speed", _profile("x86-avx2")),
        _target("arm", "w4a16-tinygemm", "speed", _profile("arm64-server")),
    ]}
    assert pull.target_for(manifest, _profile("arm64-server"))[0] == "arm"
    assert pull.target_for(manifest, _profile("x86-avx2"))[0] == "avx2"
    assert pull.target_for(manifest, _profile("xeon-amx"))[0] == "amx"
    with pytest.raises(EdgepathError, match="no target of the manifest with priority fidelity"):
        pull.target_for(manifest, _profile("arm64-server"), "fidelity")
    manifest["targets"][0]["artifacts"] = []  # not built: not a candidate
    with pytest.raises(EdgepathError, match="selector picks w4a8-amx"):
        pull.target_for(manifest, _profile("xeon-amx"))
