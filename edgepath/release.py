"""Versions of each device's build: git tags ``<tag>@vX.Y.Z`` (GTO), one DVC artifact per device.

A device's build has a content digest (``build_digest``: its files' names, sizes
and sha256). ``releases.json`` (git-tracked, a ``releases`` record) holds the
version last released for each device tag and that version's digest; the manifest
stage reads it, so each target's ``release`` says which version its build is, or
that it is unreleased.

Lifecycle of ``edgepath release``:

1. Check: the project is a git repository at its top level with no uncommitted
   change to a tracked file; ``dvc status`` names no stage to re-run (the probes
   excepted: they always re-run and write the same profile); every version in
   ``releases.json`` has its git tag here.
2. Plan (``plan``): each built target whose digest differs from its last release
   gets the next version: ``v1.0.0`` first; the major version where its weight
   path changed (a consumer needs another runtime), else the minor version.
3. Write ``releases.json`` and ``dvc.yaml``'s ``artifacts:`` section (one
   artifact per device tag, ``build/devices/<tag>``), re-run the manifest and
   bundle stages (the manifest then records the versions), ``dvc push``, commit,
   and register each version with GTO at that commit: an annotated tag whose
   ``dvc.lock`` names the manifest that records it.

A failure before the commit restores ``releases.json``, ``dvc.yaml``, ``dvc.lock``
and the stages' outputs (``dvc checkout``) as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import atomic, records
from .errors import EdgepathError

RELEASES = "releases.json"
DVC_YAML = "dvc.yaml"
DEVICES_DIR = "build/devices"
_VERSION = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")
# Everything below this line of dvc.yaml is written by `edgepath release` from the fleet.
ARTIFACTS_MARKER = "# artifacts: one per device tag of params.yaml, written by `edgepath release`"


def build_files(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A manifest target's build: its artifacts, then a phone's fallback build's
    (none where it is not built)."""
    fallback = entry.get("export", {}).get("fallback") or {}
    return [*entry["artifacts"], *fallback.get("artifacts", [])]


def build_digest(files: list[dict[str, Any]]) -> str:
    """A device build's content digest: sha256 over its files' ``name``, size and
    sha256, sorted by name (where they came from in the project does not count)."""
    lines = sorted(f"{f['sha256']}  {f['size']}  {f['name']}\n" for f in files)
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def empty_releases() -> dict[str, Any]:
    return {**records.envelope("releases"), "artifacts": {}}


def read_releases(path: str | os.PathLike) -> dict[str, Any]:
    """The releases record at ``path``; none released where the file does not exist."""
    return records.read(path, "releases") if Path(path).is_file() else empty_releases()


def version_key(version: str) -> tuple[int, int, int]:
    match = _VERSION.match(version)
    if not match:
        raise EdgepathError(f"{version!r}: not a release version (vMAJOR.MINOR.PATCH, as v1.2.0)")
    return tuple(int(g) for g in match.groups())


def normalize_version(version: str) -> str:
    """``1.2.0`` or ``v1.2.0`` as ``v1.2.0``."""
    version = version if version.startswith("v") else f"v{version}"
    version_key(version)
    return version


def git_tag(tag: str, version: str) -> str:
    """The git tag of device ``tag``'s ``version`` (GTO's registration tag)."""
    return f"{tag}@{version}"


def state(entry: dict[str, Any], releases: dict[str, Any]) -> dict[str, Any]:
    """A manifest target's ``release`` (``entry`` without it): the version its build
    is, or why none."""
    tag, files = entry["tag"], build_files(entry)
    if not files:
        return {"state": "not built", "version": None, "digest": None,
                "detail": "nothing to release until it is built"}
    digest = build_digest(files)
    last = releases["artifacts"].get(tag)
    if last is not None and last["digest"] == digest:
        return {"state": "released", "version": last["version"], "digest": digest,
                "detail": f"git tag {git_tag(tag, last['version'])}"}
    why = "never released" if last is None else f"its content differs from {last['version']}"
    return {"state": "unreleased", "version": None, "digest": digest,
            "detail": f"{why}; `edgepath release` versions it"}


def plan(manifest: dict[str, Any], releases: dict[str, Any]) -> list[dict[str, Any]]:
    """The versions a release registers: one per built target whose content differs
    from its last release, with the reason for the version number."""
    changes = []
    for t in manifest["targets"]:
        if t["release"]["state"] != "unreleased":
            continue
        tag, path = t["tag"], t["path"]["name"]
        last = releases["artifacts"].get(tag)
        if last is None:
            version, why = "v1.0.0", "first release"
        else:
            major, minor, _ = version_key(last["version"])
            if last["path"] != path:
                version = f"v{major + 1}.0.0"
                why = f"weight path {last['path']} -> {path} since {last['version']}: a consumer needs another runtime"
            else:
                version = f"v{major}.{minor + 1}.0"
                why = f"new content of {path} since {last['version']}"
        changes.append({"tag": tag, "version": version, "previous": last and last["version"], "path": path,
                        "digest": t["release"]["digest"], "why": why})
    return changes


def artifacts_section(tags: list[str]) -> str:
    """``dvc.yaml``'s ``artifacts:`` block for the fleet's device tags."""
    lines = [ARTIFACTS_MARKER, "# (versions: git tags <tag>@vX.Y.Z; `edgepath pull <tag> --version V`)", "artifacts:"]
    for tag in tags:
        lines += [f"  {tag}:", f"    path: {DEVICES_DIR}/{tag}", "    type: model",
                  f"    desc: edgepath build for device {tag} (params.yaml targets.{tag}); its edgepath-device.json"
                  " says which weight path and why"]
    return "\n".join(lines) + "\n"


def with_artifacts(dvc_yaml: str, tags: list[str]) -> str:
    """``dvc_yaml``'s text with its artifacts section (from the marker on) for ``tags``."""
    head, _, _ = dvc_yaml.partition(ARTIFACTS_MARKER)
    return head.rstrip("\n") + "\n\n" + artifacts_section(tags)


class _Project:
    """git and DVC on one project, through their command lines (DVC: this
    interpreter's, so the stages run with this edgepath)."""

    def __init__(self, root: Path):
        self.root = root

    def git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise EdgepathError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def dvc(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=self.root, capture_output=True, text=True,
                              env={**os.environ, "DVC_NO_ANALYTICS": "1"})
        if done.returncode != 0:
            raise EdgepathError(f"dvc {' '.join(args)} failed:\n{(done.stdout + done.stderr).strip()}")
        return done.stdout

    def has_tag(self, name: str) -> bool:
        return self.git("rev-parse", "-q", "--verify", f"refs/tags/{name}", check=False).returncode == 0


def _check(project: _Project, releases: dict[str, Any]) -> None:
    top = project.git("rev-parse", "--show-toplevel", check=False)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != project.root.resolve():
        raise EdgepathError(f"{project.root}: not the top of a git repository; a release is a git tag")
    dirty = project.git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        raise EdgepathError(f"uncommitted changes to tracked files (a version tags the commit that built it); "
                            f"commit them first:\n{dirty}")
    stale = {stage: why for stage, why in json.loads(project.dvc("status", "--json") or "{}").items()
             if why != ["always changed"]}
    if stale:
        raise EdgepathError(f"the pipeline is not up to date ({', '.join(sorted(stale))}); run `dvc repro` and "
                            f"commit dvc.lock first")
    for tag, last in releases["artifacts"].items():
        if not project.has_tag(git_tag(tag, last["version"])):
            raise EdgepathError(f"{RELEASES} records {tag} {last['version']}, but this clone has no git tag "
                                f"{git_tag(tag, last['version'])}: `git fetch --tags` first")


def release(root: str | os.PathLike, remote: str | None = None, dry_run: bool = False,
            progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Register a version for each device whose build changed (the module's
    lifecycle); return the plan (with ``dry_run``, only return it)."""
    from . import fleet

    project = _Project(Path(root))
    root = project.root
    releases = read_releases(root / RELEASES)
    _check(project, releases)
    manifest = records.read(root / "manifest.json", "manifest")
    changes = plan(manifest, releases)
    for c in changes:
        progress(f"release: {c['tag']} {c['version']} ({c['why']})")
    if dry_run or not changes:
        return changes
    for c in changes:
        if project.has_tag(git_tag(c["tag"], c["version"])):
            raise EdgepathError(f"git tag {git_tag(c['tag'], c['version'])} exists already, but {RELEASES} does not "
                                f"record it; delete the tag or restore {RELEASES}")
    tags = list(fleet.load(root / "params.yaml").targets)
    restore = (RELEASES, DVC_YAML, "dvc.lock")
    try:
        updated = {**releases, "artifacts": {**releases["artifacts"], **{
            c["tag"]: {"version": c["version"], "digest": c["digest"], "path": c["path"]} for c in changes}}}
        records.write(root / RELEASES, "releases", updated)
        atomic.write_text(root / DVC_YAML, with_artifacts((root / DVC_YAML).read_text(encoding="utf-8"), tags))
        progress("release: re-running the manifest and bundle stages, which record the versions")
        project.dvc("repro", "--single-item", "manifest", "bundle")
        released = {t["tag"]: t["release"] for t in records.read(root / "manifest.json", "manifest")["targets"]}
        for c in changes:
            if released[c["tag"]]["version"] != c["version"]:
                raise EdgepathError(f"the manifest stage did not record {c['tag']} {c['version']}: "
                                    f"{released[c['tag']]['detail']}")
        progress(f"release: dvc push{f' -r {remote}' if remote else ''}")
        project.dvc("push", *(("-r", remote) if remote else ()))
        project.git("add", "--", *restore)
        summary = ", ".join(git_tag(c["tag"], c["version"]) for c in changes)
        project.git("commit", "-q", "-m", f"release: {summary}")
    except BaseException:
        project.git("checkout", "HEAD", "--", *restore, check=False)
        with contextlib.suppress(EdgepathError):  # the first failure is the one to report
            project.dvc("checkout", "--quiet", "manifest", "bundle")
        raise
    from gto.api import register

    for c in changes:
        register(str(root), c["tag"], "HEAD", version=c["version"],
                 message=f"{c['tag']} {c['version']}: {c['path']}, {c['digest']} ({c['why']})")
    progress(f"release: tagged {summary}; publish the tags with `git push origin {summary.replace(', ', ' ')}`")
    return changes
