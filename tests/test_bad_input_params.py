"""Bad input in params.yaml, device tags and the commands that read them (issue 19).

Each case runs the real ``edgepath`` command (``tests/bad_inputs.run_case``) on a copy of
the project's params.yaml and profiles with one thing wrong, and checks the one line it
must print (exit 2, no traceback) and that nothing was run or written. The findings:

- params reach a shell (finding 3): shell metacharacters in a device tag or a weight
  path are refused by the one tag pattern / the registry before any stage command is
  built from them; ``test_dvc_repro_*`` prove it with the real ``dvc repro``;
- one tag pattern for DVC's stage names, image tags and release tags, wherever a tag
  arrives (``--target`` of probe, select and run; releases.json);
- params.yaml's milder findings: duplicate keys, keys YAML reads as other types (``on``),
  profile paths outside the repository, a params "file" that is binary, a directory, a
  FIFO or /dev/zero; ``select`` and ``images plan`` apply one platform rule;
- ``images plan``, ``release --dry-run``, ``run`` and ``params`` with bad input: one line.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .bad_inputs import ROOT, Case, copy_project, run_case

MARKER = "PWNED"
"""The file an injected shell command would create in the case's directory."""
TAG_HINT = r"is not a device tag \(a device tag is lower-case letters"


def _edit_params(old: str, new: str):
    """A setup: the project's params.yaml with the text ``old`` replaced by ``new``."""
    def setup(d: Path) -> None:
        copy_project(d)
        text = (d / "params.yaml").read_text()
        assert old in text, old
        (d / "params.yaml").write_text(text.replace(old, new, 1))
    return setup


_tag_injected = _edit_params("  x86-avx2:\n", f'  "x;touch {MARKER};":\n')
_tag_substituted = _edit_params("  x86-avx2:\n", f"  '$(touch {MARKER}) \"q\"':\n")
_tag_newline = _edit_params("  x86-avx2:\n", '  "x86\\n\\e[2J":\n')
_tag_on = _edit_params("  x86-avx2:\n", "  on:\n")
_tag_twice = _edit_params("  phone-cpu:\n", "  phone-npu:\n")
# nine levels of ten aliases each: a kilobyte that expands to 10^9 nodes if walked as a tree
_ALIAS_BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" if i else "l0: &l0 [x]\n"
                      for i in range(10))
_alias_bomb = _edit_params("calibration:\n", "bomb:\n" + "".join(f"  {line}\n" for line in _ALIAS_BOMB.splitlines())
                           + "calibration:\n")
_alias_in_a_target = _edit_params("  x86-avx2:\n    profile: profiles/x86-avx2.json\n",
                                  "  x86-avx2: &t\n    profile: profiles/x86-avx2.json\n")
_path_injected = _edit_params("    - w4a16-tinygemm\n", f"    - w4a16-tinygemm\n    - \"$(touch {MARKER}) 'x y'\"\n")
_source_injected = _edit_params("  source: embedded\n", f"  source: '/x \"y\"; touch {MARKER} $(touch {MARKER}) #'\n")
_profile_absolute = _edit_params("profile: profiles/x86-avx2.json", "profile: /etc/passwd")
_profile_up = _edit_params("profile: profiles/x86-avx2.json", "profile: profiles/../../x86-avx2.json")
_profile_home = _edit_params("profile: profiles/x86-avx2.json", "profile: ~/x86-avx2.json")
_phone_on_arm = _edit_params(
    "    # the export (ExecuTorch + QNN SDK) runs on an x86_64 build machine\n    platform: linux/amd64",
    "    platform: linux/arm64")


def _profile_to_dev_zero(d: Path) -> None:
    _edit_params("profile: profiles/x86-avx2.json", "profile: profiles/zero.json")(d)
    (d / "profiles" / "zero.json").symlink_to("/dev/zero")


def _params_binary(d: Path) -> None:
    copy_project(d)
    (d / "params.yaml").write_bytes(b"\xff\xfe\x00model:\x00\x9c")


def _params_directory(d: Path) -> None:
    copy_project(d)
    (d / "params.yaml").unlink()
    (d / "params.yaml").mkdir()


def _params_fifo(d: Path) -> None:
    copy_project(d)
    (d / "params.yaml").unlink()
    os.mkfifo(d / "params.yaml")


def _params_dev_zero(d: Path) -> None:
    copy_project(d)
    (d / "params.yaml").unlink()
    (d / "params.yaml").symlink_to("/dev/zero")


def _user_file_at_out(d: Path) -> None:
    copy_project(d)
    (d / "notes.json").write_text('{"mine": true}\n')


def _directory_at_out(d: Path) -> None:
    copy_project(d)
    (d / "out").mkdir()
    (d / "out" / "keep.txt").write_text("mine\n")


def _releases_with_bad_tag(d: Path) -> None:
    digest = "sha256:" + "a" * 64
    (d / "releases.json").write_text(
        '{"kind": "edgepath.releases", "schema_version": 1, "artifacts": '
        f'{{"x;touch {MARKER};": {{"version": "v1.0.0", "digest": "{digest}", "path": "w4a8-gptq"}}}}}}\n')


def _git_without_dvc(d: Path) -> None:
    subprocess.run(["git", "init", "-q", str(d)], check=True)


PLAN = ["images", "plan"]
SELECT_ARGS = ["--profile", "profiles/x86-avx2.json"]

CASES = [
    # -- finding 3: a value that would reach DVC's shell is refused before any stage runs
    Case("params-tag-with-semicolon", lambda d: ["params", "--out", "build/params.json"],
         rf"params\.yaml: targets\.x;touch {MARKER};: .* \(a device tag is", _tag_injected,
         absent=(MARKER, "build")),
    Case("params-tag-with-substitution-and-quotes", lambda d: ["params"],
         r"params\.yaml: targets\.\$\(touch PWNED\) \"q\": .*does not match", _tag_substituted, absent=(MARKER,)),
    Case("params-quantize-path-with-substitution", lambda d: ["params", "--out", "build/params.json"],
         r"params\.yaml: quantize\.paths\.\d+: \"\$\(touch PWNED\) 'x y'\" is not one of the paths the quantize stage",
         _path_injected, absent=(MARKER, "build")),
    Case("params-model-source-with-metacharacters-is-data", lambda d: ["params"], "", _source_injected, code=0,
         absent=(MARKER,)),
    Case("images-plan-tag-with-semicolon", lambda d: PLAN, r"targets\.x;touch PWNED;: ", _tag_injected,
         absent=(MARKER,)),
    Case("images-plan-quantize-path-injected", lambda d: PLAN, r"quantize\.paths\.\d+: .* is not one of the paths",
         _path_injected, absent=(MARKER,)),
    # -- one tag pattern, wherever a tag arrives
    Case("probe-target-with-semicolon", lambda d: ["probe", "--target", f"x;touch {MARKER};"],
         rf"--target: 'x;touch {MARKER};' {TAG_HINT}", copy_project, absent=(MARKER,)),
    Case("probe-target-unknown", lambda d: ["probe", "--target", "toaster"],
         r"unknown device tag 'toaster'; the fleet has: host, xeon-amx", copy_project),
    Case("probe-target-upper-case", lambda d: ["probe", "--target", "Host"], rf"--target: 'Host' {TAG_HINT}",
         copy_project),
    Case("select-target-with-substitution", lambda d: ["select", "--target", f"$(touch {MARKER})", *SELECT_ARGS],
         rf"--target: '\$\(touch {MARKER}\)' {TAG_HINT}", copy_project, absent=(MARKER,)),
    Case("select-target-with-space-and-quote", lambda d: ["select", "--target", "a 'b", *SELECT_ARGS],
         rf"--target: \"a 'b\" {TAG_HINT}", copy_project),
    Case("select-target-too-long", lambda d: ["select", "--target", "a" * 64, *SELECT_ARGS], TAG_HINT, copy_project),
    Case("run-in-image-target-with-semicolon", lambda d: ["run", "--in-image", "select", "--target", "x;id",
                                                          *SELECT_ARGS],
         rf"select --target: 'x;id' {TAG_HINT}", copy_project),
    Case("run-in-image-target-equals-unknown", lambda d: ["run", "--in-image", "probe", "--target=toaster"],
         r"unknown device tag 'toaster'", copy_project),
    Case("run-in-image-target-without-value", lambda d: ["run", "--in-image", "probe", "--target"],
         r"probe: --target needs a device tag", copy_project),
    Case("run-here-target-with-space", lambda d: ["run", "probe", "--target", "a b"], rf"--target: 'a b' {TAG_HINT}",
         copy_project),
    Case("run-in-image-params-missing", lambda d: ["run", "--in-image", "--params", "nope.yaml", "probe", "--target",
                                                   "host"],
         r"nope\.yaml: no such file \(the params file", copy_project),
    Case("release-dry-run-releases-bad-tag", lambda d: ["release", "--dry-run"],
         r"releases\.json: not a valid releases record: at artifacts: 'x;touch PWNED;' does not match",
         _releases_with_bad_tag, absent=(MARKER,)),
    # -- params.yaml's milder findings
    Case("params-tag-with-newline-and-escape", lambda d: ["params"], r"targets\.x86\\x0a\\x1b\[2J: ", _tag_newline),
    Case("images-plan-tag-on-is-a-boolean", lambda d: PLAN,
         r"params\.yaml: not valid YAML \(key 'on' on line \d+ is not a string in YAML \(it reads as bool\)", _tag_on),
    Case("probe-duplicate-tag", lambda d: ["probe", "--target", "phone-npu"],
         r"params\.yaml: not valid YAML \(key 'phone-npu' appears twice", _tag_twice),
    Case("params-duplicate-tag", lambda d: ["params"], r"key 'phone-npu' appears twice", _tag_twice),
    # -- a YAML alias bomb answers at once, in every reader of params.yaml
    Case("params-alias-bomb", lambda d: ["params"], r"params\.yaml: not valid YAML \(alias \*l0 on line \d+: "
         r"edgepath's YAML files take no aliases", _alias_bomb),
    Case("select-target-alias-bomb", lambda d: ["select", "--target", "host", *SELECT_ARGS], r"take no aliases",
         _alias_bomb),
    Case("images-plan-alias-bomb", lambda d: PLAN, r"take no aliases", _alias_bomb),
    Case("params-an-anchor-without-alias-is-fine", lambda d: ["params"], "", _alias_in_a_target, code=0),
    Case("images-plan-registry-garbage", lambda d: [*PLAN, "--registry", "not a registry;rm -rf"],
         r"--registry 'not a registry;rm -rf': not a registry", copy_project),
    Case("images-plan-registry-upper-case-path", lambda d: [*PLAN, "--registry", "ghcr.io/Edge"],
         r"not a registry", copy_project),
    Case("images-plan-profile-etc-passwd", lambda d: PLAN,
         r"targets\.x86-avx2\.profile: '/etc/passwd' is not a path inside the repository", _profile_absolute),
    Case("params-profile-dotdot", lambda d: ["params"],
         r"targets\.x86-avx2\.profile: 'profiles/\.\./\.\./x86-avx2\.json' leads outside the repository",
         _profile_up),
    Case("select-profile-home", lambda d: ["select", "--target", "host", *SELECT_ARGS],
         r"targets\.x86-avx2\.profile: '~/x86-avx2\.json' is not a path inside the repository", _profile_home),
    Case("images-plan-profile-symlink-to-dev-zero", lambda d: PLAN,
         r"targets\.x86-avx2\.profile: 'profiles/zero\.json' leads outside the repository", _profile_to_dev_zero),
    Case("images-plan-params-binary", lambda d: PLAN, r"params\.yaml: not UTF-8 text", _params_binary),
    Case("params-params-binary", lambda d: ["params"], r"params\.yaml: not UTF-8 text", _params_binary),
    Case("images-plan-params-directory", lambda d: PLAN, r"params\.yaml: a directory, not a regular file",
         _params_directory),
    Case("images-plan-params-fifo", lambda d: PLAN, r"params\.yaml: a FIFO, not a regular file", _params_fifo),
    Case("params-params-dev-zero", lambda d: ["params"], r"params\.yaml: a character device, not a regular file",
         _params_dev_zero),
    Case("images-plan-params-missing", lambda d: [*PLAN, "--params", "nope.yaml"],
         r"nope\.yaml: no such file \(the params file", copy_project),
    Case("images-plan-params-empty-path", lambda d: [*PLAN, "--params", ""], r"--params: empty path", copy_project),
    # select and images plan: one platform rule
    Case("images-plan-phone-on-arm64", lambda d: PLAN,
         r"target phone-npu: its build is an export, made by a toolchain for linux/amd64 only, so its platform "
         r"must be linux/amd64 \(or auto\), not linux/arm64", _phone_on_arm),
    Case("select-phone-on-arm64", lambda d: ["select", "--target", "phone-npu", "--profile",
                                             "profiles/phone-npu.json"],
         r"target phone-npu: its w8a16-qnn build is an export, made by a toolchain for linux/amd64 only, so its "
         r"platform must be linux/amd64 \(or auto\), not linux/arm64", _phone_on_arm),
    Case("run-in-image-phone-on-arm64", lambda d: ["run", "--in-image", "probe", "--target", "phone-npu"],
         r"target phone-npu: its build is an export", _phone_on_arm),
    # -- the params command's output and the release command's project
    Case("params-out-is-a-users-file", lambda d: ["params", "--out", "notes.json"],
         r"notes\.json: exists and is not an earlier params check's output; not replaced", _user_file_at_out,
         unchanged=("notes.json",)),
    Case("params-out-is-a-directory", lambda d: ["params", "--out", "out"],
         r"out: exists and is not an earlier params check's output", _directory_at_out,
         unchanged=("out/keep.txt",)),
    Case("params-out-empty-path", lambda d: ["params", "--out", ""], r"--out: empty path", copy_project),
    Case("images-bake-out-is-a-users-file", lambda d: ["images", "bake", "--out", "notes.json"],
         r"notes\.json: exists and is not a bake file; not replaced", _user_file_at_out, unchanged=("notes.json",)),
    Case("images-bake-out-empty-path", lambda d: ["images", "bake", "--out", ""], r"--out: empty path", copy_project),
    Case("release-dry-run-project-empty", lambda d: ["release", "--dry-run", "--project", ""],
         r"--project: empty path", None),
    Case("release-dry-run-project-missing", lambda d: ["release", "--dry-run", "--project", "nope"],
         r"nope: no such directory \(--project names the project's clone\)", None),
    Case("release-dry-run-not-git", lambda d: ["release", "--dry-run"], r"\.: not the top of a git repository",
         None),
    Case("release-dry-run-git-without-dvc", lambda d: ["release", "--dry-run"],
         r"dvc status failed: NotDvcRepoError: you are not inside of a DVC repository", _git_without_dvc),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    run_case(case, tmp_path)


# -- the real `dvc repro`: no params value reaches its shell ------------------------------

VENV_BIN = Path(sys.executable).parent


def _dvc_project(d: Path, change) -> Path:
    """A git + DVC repository with the project's pipeline (dvc.yaml, stages/, the
    edgepath sources its stages list as deps, params.yaml and profiles), whose
    params.yaml ``change`` edits (a function of the parsed file)."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, d / name)
    for name in ("stages", "profiles", "edgepath"):
        shutil.copytree(ROOT / name, d / name, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((d / "params.yaml").read_text())
    change(params)
    (d / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=d, check=True)
    subprocess.run([str(VENV_BIN / "dvc"), "init", "-q"], cwd=d, check=True)
    return d


def _dvc_repro(d: Path) -> subprocess.CompletedProcess:
    """Plain ``dvc repro``, as a user runs it: ``python`` is the venv's, edgepath this tree's."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
           "DVC_NO_ANALYTICS": "1"}
    return subprocess.run([str(VENV_BIN / "dvc"), "repro"], cwd=d, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def _rename_target(params: dict, old: str, new: str) -> None:
    params["targets"] = {new if tag == old else tag: spec for tag, spec in params["targets"].items()}


INJECTIONS = {
    # every kind at once: the check refuses the first it meets, and nothing runs
    "source-tag-and-path": (lambda p: (p["model"].update(source=f"/x; touch {MARKER} #"),
                                       _rename_target(p, "x86-avx2", f"x;touch {MARKER};"),
                                       p["quantize"]["paths"].append(f"$(touch {MARKER})")),
                            rf"targets\.x;touch {MARKER};: "),
    "tag-substitution-quotes-space": (lambda p: _rename_target(p, "phone-cpu", f"a \"b\" '$(touch {MARKER})'"),
                                      r"targets\.a \"b\" '\$\(touch PWNED\)': "),
    "quantize-path": (lambda p: p["quantize"]["paths"].append(f"w4a8-gptq; touch {MARKER}"),
                      rf"quantize\.paths\.\d+: 'w4a8-gptq; touch {MARKER}' is not one of the paths"),
    "export-path": (lambda p: p["export"]["paths"].append(f"`touch {MARKER}`"),
                    rf"export\.paths\.2: '`touch {MARKER}`' is not one of the paths"),
}


@pytest.mark.parametrize("name", INJECTIONS)
def test_dvc_repro_stops_at_the_params_check(name, tmp_path):
    """The params stage runs first (every stage that builds a command from a params value,
    and the model stage, depend on its output) and stops `dvc repro` with one line."""
    change, message = INJECTIONS[name]
    d = _dvc_project(tmp_path, change)
    done = _dvc_repro(d)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert not list(d.rglob(f"*{MARKER}*")), f"an injected command ran:\n{output}"
    errors = [line for line in output.splitlines() if line.startswith("edgepath ")]
    assert len(errors) == 1 and errors[0].startswith("edgepath params: error: params.yaml: "), output
    assert re.search(message, errors[0]), output
    assert "failed to reproduce 'params'" in output, output
    assert not (d / "build").exists(), output  # no stage after the check ran


def test_dvc_repro_takes_a_model_source_as_a_path(tmp_path):
    """model.source never enters a command: with metacharacters, spaces and quotes it
    passes the params check (it is a path) and the model stage refuses it as a path
    that is not there, naming it, without a shell ever seeing it. The fleet is cut to a
    captured profile so that no stage but the model's has work that takes time."""
    source = f"/no such \"dir\" 'x'; touch {MARKER} $(touch {MARKER}) #"

    def change(params):
        params["model"]["source"] = source
        params["targets"] = {"phone-cpu": params["targets"]["phone-cpu"]}

    d = _dvc_project(tmp_path, change)
    done = _dvc_repro(d)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert not list(d.rglob(f"*{MARKER}*")), f"an injected command ran:\n{output}"
    assert "Running stage 'params'" in output and "failed to reproduce 'model'" in output, output
    errors = [line for line in output.splitlines() if line.startswith("edgepath ")]
    assert len(errors) == 1 and errors[0].startswith("edgepath model: error: "), output
    assert source in errors[0], output
