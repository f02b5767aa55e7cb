"""A device build's version: its content digest, and the releases record that names it.

A device's build has a content digest (``build_digest``: its files' names, sizes
and sha256). ``releases.json`` (git-tracked, a ``releases`` record) holds the
version last released for each device tag and that version's digest. The manifest
reads it (``state``: which version a target's build is, or that it is unreleased),
``edgepath release`` writes it, and ``edgepath pull --version`` finds the git tag
(``git_tag``) of a version. Plain functions over records.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from ..core import records
from ..core.errors import EdgepathError

RELEASES = "releases.json"
_VERSION = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")


def build_files(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A manifest target's build: its artifacts, then a phone's fallback build's
    (none where it is not built)."""
    fallback = entry.get("export", {}).get("fallback") or {}
    return [*entry["artifacts"], *fallback.get("artifacts", [])]


def target(manifest: dict[str, Any], tag: str) -> dict[str, Any]:
    """The manifest's entry for the device ``tag``; an unknown tag is refused, naming the known ones."""
    for t in manifest["targets"]:
        if t["tag"] == tag:
            return t
    raise EdgepathError(f"no device tag {tag!r} in the manifest; it has: "
                        f"{', '.join(t['tag'] for t in manifest['targets'])}")


def build_digest(files: list[dict[str, Any]]) -> str:
    """A device build's content digest: sha256 over its files' ``name``, size and
    sha256, sorted by name (where they came from in the project does not count)."""
    lines = sorted(f"{f['sha256']}  {f['size']}  {f['name']}\n" for f in files)
    return "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest()


def empty_releases() -> dict[str, Any]:
    return {**records.envelope("releases"), "artifacts": {}}


def read_releases(path: str | os.PathLike) -> dict[str, Any]:
    """The releases record at ``path``; none released where nothing is there. Anything
    that is there is read as a record (a directory, a FIFO or a broken link is refused,
    naming it, not taken for "never released")."""
    return records.read(path, "releases") if os.path.lexists(path) else empty_releases()


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
