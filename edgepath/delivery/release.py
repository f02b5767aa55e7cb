"""Versions of each device's build: git tags ``<tag>@vX.Y.Z`` (GTO), one DVC artifact per device.

A device's build has a content digest, and ``releases.json`` holds the version
last released for each device tag with that version's digest (``versions``: the
record and the rules the manifest and pull read too); this module writes them.

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

import argparse
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core import atomic, files, records
from ..core.command import Command
from ..core.errors import EdgepathError, one_line
from ..rules import weight_paths
from ..rules.versions import RELEASES, git_tag, read_releases, version_key

DVC_YAML = "dvc.yaml"
DEVICES_DIR = "build/devices"
# Everything below this line of dvc.yaml is written by `edgepath release` from the fleet.
ARTIFACTS_MARKER = "# artifacts: one per device tag of params.yaml, written by `edgepath release`"


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
            if weight_paths.current_name(last["path"]) != path:
                version = f"v{major + 1}.0.0"
                why = f"weight path {last['path']} -> {path} since {last['version']}: a consumer needs another runtime"
            else:
                version = f"v{major}.{minor + 1}.0"
                why = f"new content of {path} since {last['version']}"
        changes.append({"tag": tag, "version": version, "previous": last and last["version"], "path": path,
                        "digest": t["release"]["digest"], "why": why})
    return changes


def artifacts_section(tags: list[str]) -> str:
    """``dvc.yaml``'s ``artifacts:`` block for the fleet's device tags, each checked
    (``fleet.check_tag``): a tag is written into the YAML as it is, and names a git tag."""
    from ..rules import fleet

    lines = [ARTIFACTS_MARKER, "# (versions: git tags <tag>@vX.Y.Z; `edgepath pull <tag> --version V`)", "artifacts:"]
    for tag in map(fleet.check_tag, tags):
        lines += [f"  {tag}:", f"    path: {DEVICES_DIR}/{tag}", "    type: model",
                  f"    desc: edgepath build for device {tag} (params.yaml targets.{tag}); its edgepath-device.json"
                  " says which weight path and why"]
    return "\n".join(lines) + "\n"


def with_artifacts(dvc_yaml: str, tags: list[str]) -> str:
    """``dvc_yaml``'s text with its artifacts section (from the marker on) for ``tags``."""
    head, _, _ = dvc_yaml.partition(ARTIFACTS_MARKER)
    return head.rstrip("\n") + "\n\n" + artifacts_section(tags)


class _Project:
    """git (its command line) and DVC (in this process, ``dvc.repo.Repo``, as
    ``edgepath pull`` reads the project) on one project."""

    def __init__(self, root: Path):
        self.root = root

    def git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise EdgepathError(f"git {' '.join(args)}: {one_line(done.stderr or done.stdout)}")
        return done

    def dvc(self, command: str, action: Callable[[Any], Any], reads_only: bool = False) -> Any:
        """``action(repo)`` on a fresh ``dvc.repo.Repo`` of the project, from its root as
        the ``dvc`` command line runs (stage names are relative to the working
        directory); its failure is an EdgepathError naming ``command``, one line.
        ``reads_only``: the action only reads, so DVC's scratch (its lock and btime
        files, normally ``.dvc/tmp``) goes to a temporary directory outside the project:
        a dry run writes nothing there, and works on a read-only checkout."""
        from dvc.repo import Repo

        root = self.root.resolve()
        try:
            with contextlib.ExitStack() as stack:
                repo_class = Repo
                if reads_only:
                    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="edgepath-dvc-"))

                    class ReadingRepo(Repo):
                        tmp_dir = scratch  # shadows Repo's cached property, .dvc/tmp

                        def _ignore(self) -> None:
                            """Repo adds its tmp_dir to .gitignore (a write, and refused for a
                            directory outside the repository); a reader adds nothing."""

                    repo_class = ReadingRepo
                stack.enter_context(contextlib.chdir(root))
                repo = stack.enter_context(repo_class(str(root)))
                repo.scm_context.quiet = True  # no "git add ..." hints: the release commits itself
                return action(repo)
        except Exception as e:  # DvcException, and what the remote's storage raises (OSError, botocore, ...)
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
            raise EdgepathError(one_line(f"{command} failed: {type(e).__name__}: {e}{cause}")) from None

    def has_tag(self, name: str) -> bool:
        return self.git("rev-parse", "-q", "--verify", f"refs/tags/{name}", check=False).returncode == 0


def _check(project: _Project, releases: dict[str, Any]) -> None:
    top = project.git("rev-parse", "--show-toplevel", check=False)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != project.root.resolve():
        raise EdgepathError(f"{project.root}: not the top of a git repository; a release is a git tag")
    # --no-optional-locks: `git status` would otherwise refresh .git/index, a write
    dirty = [line[3:] for line in project.git("--no-optional-locks", "status", "--porcelain",
                                              "--untracked-files=no").stdout.splitlines()]
    if dirty:
        shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
        raise EdgepathError(f"uncommitted changes to tracked files ({shown}); a version tags the commit that "
                            f"built it: commit them first")
    stale = {stage: why for stage, why in project.dvc("dvc status", lambda repo: repo.status(), reads_only=True).items()
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
    from ..rules import fleet

    project = _Project(files.path_of(root, "--project"))
    root = project.root
    if not root.is_dir():
        raise EdgepathError(f"{root}: no such directory (--project names the project's clone)")
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
        project.dvc("dvc repro --single-item manifest bundle",
                    lambda repo: repo.reproduce(["manifest", "bundle"], single_item=True))
        released = {t["tag"]: t["release"] for t in records.read(root / "manifest.json", "manifest")["targets"]}
        for c in changes:
            if released[c["tag"]]["version"] != c["version"]:
                raise EdgepathError(f"the manifest stage did not record {c['tag']} {c['version']}: "
                                    f"{released[c['tag']]['detail']}")
        progress(f"release: dvc push{f' -r {remote}' if remote else ''}")
        project.dvc(f"dvc push{f' -r {remote}' if remote else ''}", lambda repo: repo.push(remote=remote))
        project.git("add", "--", *restore)
        summary = ", ".join(git_tag(c["tag"], c["version"]) for c in changes)
        project.git("commit", "-q", "-m", f"release: {summary}")
    except BaseException:
        project.git("checkout", "HEAD", "--", *restore, check=False)
        with contextlib.suppress(EdgepathError):  # the first failure is the one to report
            project.dvc("dvc checkout manifest bundle", lambda repo: repo.checkout(targets=["manifest", "bundle"]))
        raise
    from gto.api import register

    for c in changes:
        register(str(root), c["tag"], "HEAD", version=c["version"],
                 message=f"{c['tag']} {c['version']}: {c['path']}, {c['digest']} ({c['why']})")
    progress(f"release: tagged {summary}; publish the tags with `git push origin {summary.replace(', ', ' ')}`")
    return changes


# ---------------------------------------------------------------- the command

def add_project_options(p: argparse.ArgumentParser) -> None:
    """The clone and the DVC remote a command reads (release, pull, ls)."""
    p.add_argument("-r", "--remote", help="the DVC remote (default: the project's default)")
    p.add_argument("--project", default=".", help="the project's clone (default: .)")


def _cmd(args: argparse.Namespace) -> None:
    changes = release(args.project, args.remote, args.dry_run, progress=print)
    if not changes:
        print("release: every built device's content is its last release's; nothing to register")
    elif args.dry_run:
        print(f"release --dry-run: {len(changes)} versions would be registered; nothing written")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the versions it would register; write nothing")
    add_project_options(p)


COMMAND = Command("release", "version each device build that changed", """\
    For each device whose build's content (its files' names, sizes and sha256)
    differs from its last release: the next version (v1.0.0 first; major where
    its weight path changed, else minor), recorded in releases.json and in the
    manifest, pushed to the DVC remote, committed, and registered with GTO as
    the annotated git tag <tag>@<version> on that commit (not pushed to git).
    Needs a clean git tree and an up-to-date pipeline.""", _arguments, _cmd)
