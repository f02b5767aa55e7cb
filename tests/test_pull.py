"""`edgepath pull`'s checks that need no remote: dvc.lock's outputs (as DVC reads them)
and manifest paths."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from edgepath.core import files
from edgepath.core.errors import EdgepathError
from edgepath.delivery import pull
from edgepath.rules import weight_paths

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
DVC_YAML = """\
stages:
  model:
    cmd: python stages/model.py
    outs:
    - build/model
  manifest:
    cmd: python stages/manifest.py
    outs:
    - manifest.json
"""


def dvc_project(d: Path, lock: str | None = LOCK, dvc_yaml: str = DVC_YAML) -> Path:
    """A git repository with DVC initialised, ``dvc_yaml`` and (where given) ``lock`` as dvc.lock."""
    from dvc.repo import Repo

    d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=d, check=True)
    Repo.init(str(d)).close()
    (d / "dvc.yaml").write_text(dvc_yaml)
    if lock is not None:
        (d / "dvc.lock").write_text(lock)
    return d


def test_lock_outputs_names_files_and_directories(tmp_path):
    lock = pull.read_lock(dvc_project(tmp_path))
    outs = {o.path: o for o in lock.outputs}
    assert set(outs) == {"build/model", "manifest.json"} and lock.where == str(tmp_path / "dvc.lock")
    assert outs["build/model"].is_dir and not outs["manifest.json"].is_dir
    assert outs["build/model"].md5 == "0123456789abcdef0123456789abcdef.dir"


@pytest.mark.parametrize("text", ["", "stages: 3", "stages:\n  x:\n    cmd: y\n", ": : :",
                                  "schema: '2.0'\nstages: {}\n"])
def test_lock_without_outputs_is_refused(tmp_path, text):
    with pytest.raises(EdgepathError, match="dvc.lock"):
        pull.read_lock(dvc_project(tmp_path, text))


def test_missing_lock_is_refused(tmp_path):
    with pytest.raises(EdgepathError, match="dvc.lock: no such file"):
        pull.read_lock(dvc_project(tmp_path, None))


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", "", "a\\..\\b"])
def test_paths_leaving_the_directory_are_refused(path):
    with pytest.raises(EdgepathError, match="refused path"):
        files.safe_relative(path, "manifest")


def test_plain_relative_paths_pass():
    assert files.safe_relative("build/weights/w4a16-tinygemm/model.safetensors", "m") == \
        "build/weights/w4a16-tinygemm/model.safetensors"


BUILD_YAML = """\
stages:
  build:
    cmd: mkdir -p out/a && echo one > out/a/x && echo three > out/a/w && echo two > out/y
    outs:
    - out
  manifest:
    cmd: echo {} > manifest.json
    outs:
    - manifest.json
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def _built_and_pushed(tmp_path: Path) -> tuple[Path, Path]:
    """(project, remote): a directory output built and pushed to a local remote, committed."""
    from dvc.repo import Repo

    project, remote = dvc_project(tmp_path / "project", None, BUILD_YAML), tmp_path / "remote"
    with open(project / ".dvc" / "config", "a") as f:
        f.write(f"[core]\n    remote = local\n['remote \"local\"']\n    url = {remote}\n")
    with Repo(str(project)) as repo:
        repo.reproduce(str(project / "dvc.yaml"))
        repo.push()
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "build")
    return project, remote


def _listing_in_a_clone(project: Path, clone: Path) -> dict[str, str]:
    """What a fresh clone (no cache) reads of ``project``'s directory output."""
    _git(clone.parent, "clone", "-q", str(project), str(clone))
    lock = pull.read_lock(clone, open_remote=lambda: pull.Remote(clone, None))
    (out,) = [o for o in lock.outputs if o.is_dir]
    return lock.listing(out)


def test_a_directory_outputs_listing_comes_from_the_remote_checked(tmp_path):
    project, remote = _built_and_pushed(tmp_path)
    md5 = lambda text: hashlib.md5(text.encode()).hexdigest()  # noqa: E731
    assert _listing_in_a_clone(project, tmp_path / "clone") == {"a/x": md5("one\n"), "a/w": md5("three\n"),
                                                                "y": md5("two\n")}
    (listing,) = (remote / "files" / "md5").glob("*/*.dir")
    listing.chmod(0o644)
    listing.write_text(listing.read_text().replace('"y"', '"z"'))  # a file renamed in the remote's listing
    with pytest.raises(EdgepathError, match=r"out \(listing .*\.dir\): .* not to its name \(altered\)"):
        _listing_in_a_clone(project, tmp_path / "clone2")
    listing.unlink()
    with pytest.raises(EdgepathError, match=r"out \(listing .*\.dir\): missing from remote local"):
        _listing_in_a_clone(project, tmp_path / "clone3")


def _device_manifest(project: Path, *paths: str, names: dict[str, str] | None = None) -> dict:
    """A manifest whose one target, ``dev``, is the project's files ``paths`` (each named
    by its path under ``out/``, or as ``names`` says)."""
    from edgepath.rules.versions import build_digest

    names = names or {}
    files = [{"path": p, "name": names.get(p, p.removeprefix("out/")), "size": (project / p).stat().st_size,
              "sha256": hashlib.sha256((project / p).read_bytes()).hexdigest()} for p in paths]
    entry = {"tag": "dev", "path": {"name": "w4a16-tinygemm", "rationale": "r"}, "artifacts": files,
             "build": {"state": "built", "detail": ""},
             "verification": {"verified": True, "state": "passed", "detail": "d"},
             "release": {"state": "unreleased", "version": None, "digest": build_digest(files), "detail": ""}}
    return {"model": {}, "targets": [entry]}


def test_pull_through_dvc_refuses_what_is_missing_extra_altered_or_escaping(tmp_path, monkeypatch):
    """The whole pull against a real local remote, from a fresh clone; only the manifest
    (a schema-valid one needs the pipeline: tests/test_registry_e2e.py) is given."""
    project, remote = _built_and_pushed(tmp_path)
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(project), str(clone))
    manifest = {}
    monkeypatch.setattr(pull, "load_manifest", lambda *args: manifest)

    def pulled(*paths, names=None):
        manifest.update(_device_manifest(project, *paths, names=names))
        return pull.pull(clone, "dev", tmp_path / "got", progress=lambda line: None)

    receipt = pulled("out/a/x", "out/a/w", "out/y")
    assert {f["path"] for f in receipt["files"]} == {"a/x", "a/w", "y"}
    assert (tmp_path / "got" / "a" / "w").read_text() == "three\n" and receipt["remote"]["name"] == "local"
    assert pulled("out/a/x", "out/a/w", "out/y") == receipt  # again, over its own earlier pull (its receipt)
    with pytest.raises(EdgepathError, match=r"out/a/w: extra: the remote holds it beside dev's build"):
        pulled("out/a/x", "out/y")
    with pytest.raises(EdgepathError, match=r"refused path '\.\./escape'"):
        pulled("out/a/x", "out/a/w", "out/y", names={"out/y": "../escape"})
    with pytest.raises(EdgepathError, match=r"elsewhere/f: no stage output in dvc.lock holds this file"):
        manifest.update(_device_manifest(project, "out/y"))
        manifest["targets"][0]["artifacts"].append({**manifest["targets"][0]["artifacts"][0], "path": "elsewhere/f"})
        pull.pull(clone, "dev", tmp_path / "got", progress=lambda line: None)
    objects = {p.name: p for p in (remote / "files" / "md5").glob("*/*")}
    y = objects[hashlib.md5((project / "out" / "y").read_bytes()).hexdigest()[2:]]
    y.chmod(0o644)
    y.write_text("owt\n")  # same size, other bytes
    with pytest.raises(EdgepathError, match=r"out/y: altered: the remote's copy has 4 bytes"):
        pulled("out/a/x", "out/a/w", "out/y")
    y.unlink()
    with pytest.raises(EdgepathError, match=r"out/y: missing from remote local"):
        pulled("out/a/x", "out/a/w", "out/y")
    assert (tmp_path / "got" / "a" / "w").read_text() == "three\n"  # the first pull, as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clone", "got", "project", "remote"]


def test_pull_refuses_to_overwrite_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(EdgepathError, match=r"mine: holds files edgepath did not write there \(notes.txt\).*"
                                            r"no edgepath-pull.json"):
        pull.pull(tmp_path, "host", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def _profile(name):
    from edgepath.core import records
    from edgepath.rules.profile import HardwareProfile

    return HardwareProfile.from_dict(records.read(ROOT / "profiles" / f"{name}.json", "profile"))


def _target(tag, path, priority, profile, engine="vllm"):
    return {"tag": tag, "priority": priority, "engine": engine, "path": {"name": path},
            "profile": {"summary": profile.summary()},
            "artifacts": [{"path": f"build/weights/{path}/model.safetensors", "size": 1, "sha256": "0" * 64}]}


def test_probe_picks_the_target_built_with_the_selected_path_and_same_isa_tier():
    manifest = {"targets": [
        _target("amx", "w4a8-gptq", "speed", _profile("xeon-amx")),
        _target("avx2", "w4a16-tinygemm", "speed", _profile("x86-avx2")),
        _target("arm", "w4a16-tinygemm", "speed", _profile("arm64-server")),
    ]}
    assert pull.target_for_machine(manifest, _profile("arm64-server"))[0] == "arm"
    assert pull.target_for_machine(manifest, _profile("x86-avx2"))[0] == "avx2"
    assert pull.target_for_machine(manifest, _profile("xeon-amx"))[0] == "amx"
    with pytest.raises(EdgepathError, match="no target of the manifest with priority fidelity"):
        pull.target_for_machine(manifest, _profile("arm64-server"), "fidelity")
    manifest["targets"][0]["artifacts"] = []  # not built: not a candidate
    with pytest.raises(EdgepathError, match="selector picks w4a8-gptq"):
        pull.target_for_machine(manifest, _profile("xeon-amx"))
    # a target's engine setting is the selector's for this machine too: an Arm machine takes
    # the Arm target built for llama.cpp over an x86 one of the same path
    manifest["targets"] += [_target("avx2-gguf", "q4_0-gguf", "speed", _profile("x86-avx2"), "llama.cpp"),
                            _target("arm-gguf", "q4_0-gguf", "speed", _profile("arm64-server"), "llama.cpp")]
    manifest["targets"].pop(2)  # the Arm target built in vLLM
    tag, why = pull.target_for_machine(manifest, _profile("arm64-server"))
    assert tag == "arm-gguf" and "q4_0-gguf (engine llama.cpp)" in why


def test_probe_takes_a_target_released_under_its_paths_former_name():
    manifest = {"targets": [_target("amx", "w4a8-amx", "speed", _profile("xeon-amx"))]}
    assert weight_paths.current_name("w4a8-amx") == "w4a8-gptq"
    assert pull.target_for_machine(manifest, _profile("xeon-amx"))[0] == "amx"


def test_pulls_in_one_project_read_dvc_s_index_one_at_a_time(tmp_path):
    """Two pulls in one clone: each holds the project's index lock while DVC reads the
    outputs and listings, so neither reads the other's half-filled index."""
    (tmp_path / ".dvc").mkdir()
    holder = ("import sys, time\nfrom pathlib import Path\nfrom edgepath.delivery.pull import index_lock\n"
              "with index_lock(Path(sys.argv[1])):\n    start = time.monotonic()\n    time.sleep(1)\n"
              "    print(start, time.monotonic())\n")
    runs = [subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    (a_start, a_end), (b_start, b_end) = sorted(tuple(map(float, p.communicate(timeout=60)[0].split())) for p in runs)
    assert b_start >= a_end > a_start  # the second held it only once the first let go
    assert (tmp_path / ".dvc" / "tmp" / "edgepath-index.lock").is_file()
