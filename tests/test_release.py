"""Versions of device builds: content digests, the version each change gets, the
artifacts section of dvc.yaml, and dvc.lock read at a version's git tag."""

import subprocess
from pathlib import Path

import pytest
import yaml

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.delivery import pull, release
from edgepath.rules import fleet, versions, weight_paths

ROOT = Path(__file__).resolve().parent.parent


def _file(name, sha="a", size=1, path=None):
    return {"path": path or f"build/weights/{name}", "name": name, "size": size, "sha256": sha * 64}


def _target(tag, path, files, fallback=None):
    entry = {"tag": tag, "path": {"name": path}, "artifacts": files}
    if fallback is not None:
        entry["export"] = {"fallback": {"artifacts": fallback}}
    return entry


def _released(tag, version, entry):
    return {**versions.empty_releases(), "artifacts": {
        tag: {"version": version, "digest": versions.build_digest(versions.build_files(entry)),
              "path": entry["path"]["name"]}}}


def test_digest_is_the_content_not_the_order_or_where_it_was_built():
    files = [_file("p/a.json", "a"), _file("p/b.bin", "b", 10)]
    moved = [{**f, "path": f"elsewhere/{f['name']}"} for f in reversed(files)]
    assert versions.build_digest(files) == versions.build_digest(moved)
    assert versions.build_digest(files) != versions.build_digest([files[0], _file("p/b.bin", "c", 10)])
    assert versions.build_digest(files) != versions.build_digest([files[0], _file("p/renamed.bin", "b", 10)])
    assert versions.build_digest(files).startswith("sha256:")


def test_a_phones_fallback_build_is_part_of_its_content():
    main = [_file("w8a16-qnn/export.json")]
    alone, with_fallback = _target("p", "w8a16-qnn", main), _target("p", "w8a16-qnn", main, [_file("x/model.pte", "f")])
    assert versions.build_files(with_fallback) == [*main, _file("x/model.pte", "f")]
    assert versions.build_digest(versions.build_files(alone)) != versions.build_digest(versions.build_files(with_fallback))


def test_release_state_of_a_target():
    entry = _target("host", "w4a16-tinygemm", [_file("w4a16-tinygemm/model.safetensors")])
    none = versions.empty_releases()
    assert versions.state(entry, none)["state"] == "unreleased"
    assert "never released" in versions.state(entry, none)["detail"]
    same = _released("host", "v1.2.0", entry)
    assert versions.state(entry, same) == {"state": "released", "version": "v1.2.0",
                                          "digest": versions.build_digest(entry["artifacts"]),
                                          "detail": "git tag host@v1.2.0"}
    changed = _target("host", "w4a16-tinygemm", [_file("w4a16-tinygemm/model.safetensors", "b")])
    assert versions.state(changed, same)["version"] is None
    assert "differs from v1.2.0" in versions.state(changed, same)["detail"]
    assert versions.state(_target("host", "w4a16-tinygemm", []), same)["state"] == "not built"


def _manifest(releases, *entries):
    return {"targets": [{**e, "release": versions.state(e, releases)} for e in entries]}


def test_plan_versions_only_what_changed_with_the_reason():
    old = _target("host", "w4a16-tinygemm", [_file("w4a16-tinygemm/m.safetensors", "a")])
    releases = _released("host", "v1.2.3", old)
    assert release.plan(_manifest(releases, old), releases) == []
    new_weights = _target("host", "w4a16-tinygemm", [_file("w4a16-tinygemm/m.safetensors", "b")])
    (change,) = release.plan(_manifest(releases, new_weights), releases)
    assert (change["version"], change["previous"]) == ("v1.3.0", "v1.2.3") and "new content" in change["why"]
    new_path = _target("host", "w4a8-gptq", [_file("w4a8-gptq/m.safetensors", "c")])
    (change,) = release.plan(_manifest(releases, new_path), releases)
    assert change["version"] == "v2.0.0" and "another runtime" in change["why"]
    first = _target("gpu", "bf16", [_file("model/hf/model.safetensors")])
    pending = _target("phone", "w4a8-xnnpack", [])
    changes = release.plan(_manifest(releases, old, first, pending), releases)
    assert [(c["tag"], c["version"], c["why"]) for c in changes] == [("gpu", "v1.0.0", "first release")]


@pytest.mark.parametrize("version", ["1.2", "v01.2.3", "v1.2.3-rc1", "latest", ""])
def test_versions_are_plain_semver(version):
    with pytest.raises(EdgepathError, match="not a release version"):
        versions.normalize_version(version)
    assert versions.normalize_version("1.2.3") == versions.normalize_version("v1.2.3") == "v1.2.3"


def test_releases_record_refuses_a_bad_version_or_digest():
    bad = {**versions.empty_releases(), "artifacts": {"host": {"version": "1.0", "digest": "sha256:" + "0" * 64,
                                                              "path": "w4a16-tinygemm"}}}
    with pytest.raises(EdgepathError, match="version"):
        records.validate("releases", bad)
    bad["artifacts"]["host"].update(version="v1.0.0", digest="0" * 64)
    with pytest.raises(EdgepathError, match="digest"):
        records.validate("releases", bad)


def test_committed_dvc_yaml_declares_one_artifact_per_device_of_params():
    from dvc.repo.artifacts import check_name_format

    tags = list(fleet.load(ROOT / "params.yaml").targets)
    text = (ROOT / "dvc.yaml").read_text()
    assert release.with_artifacts(text, tags) == text, "run `edgepath release` (it rewrites the section)"
    artifacts = yaml.safe_load(text)["artifacts"]
    assert list(artifacts) == tags
    for tag, artifact in artifacts.items():
        check_name_format(tag)  # GTO's rule for an artifact name; raises where it breaks it
        assert artifact["path"] == f"build/devices/{tag}"
    assert yaml.safe_load(release.with_artifacts(text, ["a", "b"]))["stages"] == yaml.safe_load(text)["stages"]
    versions.read_releases(ROOT / versions.RELEASES)  # the committed record is valid


@pytest.mark.parametrize("tag", ["x86.avx2", "phone-", "-phone", "Phone"])
def test_device_tags_are_valid_artifact_names(tmp_path, tag):
    with pytest.raises(EdgepathError, match="device tag"):
        fleet.parse({"model": {"source": "embedded"},
                     "targets": {tag: {"profile": "probe", "priority": "speed", "platform": "auto"}}}, tmp_path)


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_pull_reads_dvc_lock_at_the_version_tag(tmp_path):
    from .test_pull import dvc_project

    lock = "schema: '2.0'\nstages:\n  manifest:\n    cmd: m\n    outs:\n    - path: manifest.json\n      md5: {md5}\n"
    dvc_project(tmp_path, lock.format(md5="a" * 32), "stages:\n  manifest:\n    cmd: m\n    outs:\n    - manifest.json\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    _git(tmp_path, "tag", "-a", "host@v1.0.0", "-m", "host v1.0.0")
    (tmp_path / "dvc.lock").write_text(lock.format(md5="b" * 32))
    _git(tmp_path, "commit", "-qam", "two")
    at_tag = pull.read_lock(tmp_path, "host", "1.0.0")
    assert pull.manifest_output(at_tag.where, at_tag.outputs).md5 == "a" * 32
    assert at_tag.where == "dvc.lock at host@v1.0.0"
    with pytest.raises(EdgepathError, match=r"no git tag host@v2\.0\.0 .* its versions here: host@v1\.0\.0"):
        pull.read_lock(tmp_path, "host", "v2.0.0")
    with pytest.raises(EdgepathError, match="needs a device tag"):
        pull.read_lock(tmp_path, None, "v1.0.0")
    workspace = pull.read_lock(tmp_path, "host", None)
    assert pull.manifest_output(workspace.where, workspace.outputs).md5 == "b" * 32


def test_release_refuses_a_dirty_tree(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "params.yaml").write_text("targets: {}\n")
    _git(tmp_path, "add", "params.yaml")
    _git(tmp_path, "commit", "-qm", "one")
    (tmp_path / "params.yaml").write_text("targets: {a: {}}\n")
    with pytest.raises(EdgepathError, match="(?s)uncommitted changes.*params.yaml"):
        release.release(tmp_path)
    with pytest.raises(EdgepathError, match="not the top of a git repository"):
        (tmp_path / "sub").mkdir()
        release.release(tmp_path / "sub")


def test_a_release_built_under_a_former_path_name_is_the_same_runtime():
    """A version released before a path was renamed keeps the old name; the next release
    of the same path is new content (minor), not a new runtime (major)."""
    (former,) = [name for name, now in weight_paths.RENAMED.items() if now == "w4a8-gptq"]
    old = _target("amx", former, [_file(f"{former}/m.safetensors", "a")])
    releases = _released("amx", "v1.4.0", old)
    renamed = _target("amx", "w4a8-gptq", [_file("w4a8-gptq/m.safetensors", "b")])
    (change,) = release.plan(_manifest(releases, renamed), releases)
    assert change["version"] == "v1.5.0" and "new content of w4a8-gptq" in change["why"]
