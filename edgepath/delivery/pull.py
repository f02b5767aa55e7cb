"""Pull one device's build from the DVC remote, verified against the manifest.

Lifecycle of ``edgepath pull <tag> [--version V] -o DIR``:

1. Read ``dvc.lock`` through DVC (``dvc.api.DVCFileSystem`` on the project):
   the workspace's, or with ``--version`` the one committed at the git tag
   ``<tag>@V`` (``edgepath release``). It names, by md5, every stage output the
   remote holds, ``manifest.json`` among them.
2. Read the manifest: the workspace's file where its md5 is the one
   ``dvc.lock`` names, otherwise its object downloaded from the remote (a fresh
   clone has no ``build/``).
3. The device's build is the target's ``artifacts`` (and a phone's fallback
   build). Each file is found, by md5, in the stage output that holds it (a
   directory output's listing is its ``.dir`` object, which DVC reads from the
   local cache or the remote; it must hash to the name ``dvc.lock`` gives it).
   Pulls in one project read listings one at a time (``index_lock``).
4. Exactly those objects are downloaded into a scratch directory beside
   ``DIR`` (which must be missing, empty, or an earlier pull: its receipt marks
   it, ``records.output_directory``); every file's size and sha256 must be the
   manifest's, and the outputs' listings may name no file in the build's directories that the
   manifest does not; the files' content digest must be the manifest's (and
   with ``--version``, the manifest must record that version). A receipt
   (``edgepath-pull.json``) records what was pulled and its version; then the
   scratch directory becomes ``DIR`` in one rename.

Anything missing, extra or altered fails the pull naming the file, and leaves
``DIR`` as it was (and no folder it created on the way to ``DIR``). The remote
is the workspace's DVC configuration (``.dvc/config``, ``.dvc/config.local``,
``AWS_*`` in the environment), also for an old version: not the configuration
committed at its tag, which may name a remote since moved, or keys kept out of git.

``DIR`` holds each file at its manifest ``name`` (relative to the folder above
its stage output): ``w4a16-tinygemm/model.safetensors``, ``model/hf/config.json``,
``w8a16-qnn/export.json``; ``build/devices/<tag>`` (the bundle) has the same layout.

``edgepath ls`` only reads, and writes nothing in the project (which may be a
read-only checkout): it finds the manifest's md5 in ``dvc.lock`` read as a YAML
document (``workspace_outputs``; a DVC repository opened on the workspace makes
``.dvc/tmp``), and a manifest it must download goes to the system's temporary
directory.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import posixpath
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.command import Command, printable
from ..core.errors import EdgepathError, one_line
from ..core.files import safe_relative, sha256_file
from ..rules import coverage, weight_paths
from ..rules.versions import build_digest, build_files, git_tag, normalize_version, target
from .release import add_project_options

LOCK_FILE = "dvc.lock"
MANIFEST = "manifest.json"
RECEIPT = records.FILE_NAMES["pull"]


@dataclass(frozen=True)
class Output:
    """One stage output as ``dvc.lock`` records it: a file, or a directory
    (``md5`` ends in ``.dir``: the object listing its files)."""

    path: str
    md5: str

    @property
    def is_dir(self) -> bool:
        return self.md5.endswith(".dir")


def _owner(outputs: list[Output], path: str) -> Output:
    for out in outputs:
        if path == out.path or path.startswith(out.path.rstrip("/") + "/"):
            return out
    raise EdgepathError(f"{path}: no stage output in {LOCK_FILE} holds this file; the manifest and "
                        f"{LOCK_FILE} disagree (re-run `dvc repro`)")


class Remote:
    """Read-only access to the objects of one DVC remote (DVC's own remote
    filesystems: local, S3, ...)."""

    def __init__(self, root: Path, name: str | None):
        from dvc.exceptions import DvcException
        from dvc.repo import Repo

        try:
            repo = Repo(str(root))
            self.name = name or repo.config["core"].get("remote")
            self._odb = repo.cloud.get_remote_odb(self.name, command="edgepath pull")
            self.config = dict(repo.config["remote"][self.name])  # as DVC resolved it: its url, keys, ...
            self.all_config = {name: dict(conf) for name, conf in repo.config["remote"].items()}
            self.url = self.config["url"]
        except DvcException as e:
            raise EdgepathError(f"{root}: {one_line(e)}") from None

    def _fail(self, what: str, error: BaseException) -> EdgepathError:
        """``error``, met while reading ``what`` from this remote, as the user's problem."""
        if isinstance(error, FileNotFoundError):
            return EdgepathError(f"{what}: missing from remote {self.name} ({self.url}); push it with "
                                 f"`dvc push -r {self.name}`")
        text = f"{type(error).__name__}: {one_line(error)}"
        if isinstance(error, PermissionError) or any(k in text for k in ("InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                                         "AccessDenied", "Forbidden")):
            return EdgepathError(f"remote {self.name} ({self.url}) refused the credentials while reading {what}: "
                                 f"set them with `dvc remote modify --local {self.name} access_key_id ...` and "
                                 f"`... secret_access_key ...`, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        return EdgepathError(f"remote {self.name} ({self.url}): could not read {what}: {text}")

    def download(self, md5: str, dest: Path, what: str) -> None:
        """Object ``md5`` into ``dest``; a missing object fails naming ``what``."""
        path = self._odb.oid_to_path(md5)
        try:
            self._odb.fs.get_file(path, os.fspath(dest))
        except Exception as e:  # the remote's client errors (botocore, aiohttp, OSError) reach here
            raise self._fail(what, e) from None

    def read_json(self, md5: str, what: str, scratch: Path) -> Any:
        """The JSON object stored as ``md5`` (checked against its name), read as
        ``files.read_json`` reads a document: bounded, UTF-8, an object."""
        dest = scratch / f".{md5.replace('/', '_')}"
        self.download(md5, dest, what)
        try:
            if _md5(dest) != md5.removesuffix(".dir"):
                raise EdgepathError(f"{what}: remote {self.name} object {md5} does not hash to its name (altered)")
            return files.read_json(dest)
        except EdgepathError as e:
            raise EdgepathError(f"{what}: remote object {md5}: {e}") from None
        finally:
            dest.unlink(missing_ok=True)


def _md5(path: Path) -> str:
    """DVC's object name for a file's content."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def manifest_output(where: str, outputs: list[Output]) -> Output:
    """The manifest's entry in a ``dvc.lock`` (read from ``where``)."""
    out = next((o for o in outputs if o.path == MANIFEST), None)
    if out is None:
        raise EdgepathError(f"{where}: names no {MANIFEST}; run the manifest stage")
    return out


def workspace_outputs(root: Path) -> list[Output]:
    """The stage outputs the workspace's ``dvc.lock`` names (``stages.<name>.outs``),
    read as a document (``files.read_yaml``) without opening a DVC repository."""
    lock = root / LOCK_FILE
    data = files.read_yaml(lock, missing="run in a clone of the project after `dvc repro`")
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict):
        raise EdgepathError(f"{lock}: not a dvc.lock (no stages); run `dvc repro`")
    return [Output(o["path"], o["md5"]) for stage in stages.values() if isinstance(stage, dict)
            for o in stage.get("outs") or () if isinstance(o, dict)
            and isinstance(o.get("path"), str) and isinstance(o.get("md5"), str)]


def load_manifest(root: Path, out: Output, open_remote: Callable[[], Remote], scratch: Path) -> dict[str, Any]:
    """The manifest ``dvc.lock`` names (``out``): the workspace's where it is that
    file, else downloaded from the remote ``open_remote`` gives."""
    local = root / MANIFEST
    if local.is_file() and _md5(local) == out.md5:
        return records.read(local, "manifest")
    remote = open_remote()
    record = remote.read_json(out.md5, f"{MANIFEST} (md5 {out.md5})", scratch)
    records.validate("manifest", record, where=f"{MANIFEST} from remote {remote.name}")
    return record


def target_for_machine(manifest: dict[str, Any], profile, priority: str = "speed") -> tuple[str, str]:
    """The manifest's target for a machine (``profile``, a HardwareProfile): a built
    target of that priority whose path the selector picks for this machine under the
    target's own engine setting; among several, one whose build a run on this machine
    would stand for (``coverage.why_host_does_not_stand_for``: the same kernel ISA
    tier), then one of the same architecture. Returns (tag, why)."""
    from ..rules.select import engines_for, select_weight_path

    here = profile.summary()
    picked = {engine: select_weight_path(profile, priority, engine=engine).name
              for engine in dict.fromkeys(t["engine"] for t in manifest["targets"] if t["priority"] == priority)
              if engine in engines_for(profile)}
    built = [t for t in manifest["targets"] if t["priority"] == priority and t["artifacts"]
             and picked.get(t["engine"]) == weight_paths.current_name(t["path"]["name"])]
    if not built:
        path = picked.get("auto") or select_weight_path(profile, priority).name
        raise EdgepathError(f"the selector picks {path} for this machine ({here['arch']}, {here['kernel_isa']}), but "
                            f"no target of the manifest with priority {priority} has that build; add this device "
                            f"to params.yaml (`edgepath probe --out profiles/<tag>.json`) and run the pipeline")
    best = min(built, key=lambda t: (
        coverage.why_host_does_not_stand_for(t["profile"]["summary"], here) is not None,
        t["profile"]["summary"]["arch"] != here["arch"]))
    return best["tag"], (f"this machine ({here['arch']}, {here['kernel_isa']}) gets {best['path']['name']} "
                         f"(engine {best['engine']}); {best['tag']} "
                         f"({best['profile']['summary']['kernel_isa']}) is built with it")


def device_files(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A target's build, which must have files to pull."""
    files = build_files(entry)
    if not files:
        raise EdgepathError(f"{entry['tag']}: nothing to pull: its build is {entry['build']['state']} "
                            f"({entry['build']['detail']})")
    return files


# The name the workspace's remote goes by in DVC's view of the project at a git tag,
# whose committed config may define remotes of its own (one of the same name, with
# settings since changed): a name no project config uses.
_PULL_REMOTE = "edgepath-pull"


@contextlib.contextmanager
def index_lock(root: Path):
    """Held while DVC reads a project's stage outputs and listings: DVC keeps one
    data index per project and fills it as it reads ``.dir`` objects. In one CI run,
    one of two concurrent pulls in a clone read a listing that hashed to another name
    ("altered"); not reproduced since, and this shared index is the state two pulls
    share there. A project without ``.dvc/`` takes no lock; DVC refuses it next."""
    if not (root / ".dvc").is_dir():
        yield
        return
    (root / ".dvc" / "tmp").mkdir(exist_ok=True)
    with open(root / ".dvc" / "tmp" / "edgepath-index.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


class Lock:
    """The stage outputs a ``dvc.lock`` names, as DVC reads it (``dvc.api.DVCFileSystem``
    on the project at ``rev``: a git revision, or None for the workspace), and the
    files of its directory outputs. ``remote`` (``open_remote()``, where given): the
    remote DVC reads ``.dir`` objects from where the local cache has none (the
    workspace's, also at an old tag)."""

    def __init__(self, root: Path, rev: str | None, where: str, open_remote: Callable[[], Remote] | None = None):
        from dvc.api import DVCFileSystem
        from dvc.exceptions import DvcException

        self.where = where
        self.remote = open_remote() if open_remote else None
        # every workspace remote too: DVC merges the workspace's .dvc/config.local into the
        # config committed at ``rev``, which may lack a remote that config.local sets keys for
        config = self.remote and {"core": {"remote": _PULL_REMOTE},
                                  "remote": {**self.remote.all_config, _PULL_REMOTE: self.remote.config}}
        self.root = root
        self.fs = DVCFileSystem(str(root), rev=rev, config=config)
        try:
            with index_lock(root):
                outs = [o for o in self.fs.repo.index.outs if o.hash_info and o.hash_info.value]
        except DvcException as e:
            raise EdgepathError(f"{where}: not a dvc.lock with stage outputs ({one_line(e)})") from None
        if not outs:
            raise EdgepathError(f"{where}: names no stage output; run `dvc repro` and `dvc push` first")
        # longest path first: the output that holds a file is the first that is its prefix
        self.outputs = sorted((Output("/".join(o.index_key[1]), o.hash_info.value) for o in outs),
                              key=lambda o: -len(o.path))

    def listing(self, out: Output) -> dict[str, str]:
        """Directory output ``out``'s files, path relative to it -> md5, from its
        ``.dir`` object (DVC reads it from the local cache, else the remote); the
        listing must hash to the name ``dvc.lock`` gives it."""
        from dvc_data.hashfile.hash_info import HashInfo
        from dvc_data.hashfile.tree import Tree
        from dvc_data.index import DataIndexDirError

        what, remote = f"{out.path} (listing {out.md5})", self.remote
        try:
            with index_lock(self.root):
                found = self.fs.find(out.path, detail=True, dvc_only=True)
        except DataIndexDirError as e:  # DVC's wrapper around what the storage raised
            raise remote._fail(what, e.__cause__ or e) from None
        except FileNotFoundError as e:
            raise remote._fail(what, e) from None
        files = {posixpath.relpath(path, out.path): info["dvc_info"]["md5"] for path, info in found.items()}
        tree = Tree()  # DVC names a .dir object by this digest of its entries
        for rel, md5 in files.items():
            tree.add(tuple(rel.split("/")), None, HashInfo("md5", md5))
        tree.digest()
        if tree.hash_info.value != out.md5:
            raise EdgepathError(f"{what}: the listing DVC read (local cache or remote {remote.name}) hashes to "
                                f"{tree.hash_info.value}, not to its name (altered)")
        return files


def read_lock(root: Path, tag: str | None = None, version: str | None = None,
              open_remote: Callable[[], Remote] | None = None) -> Lock:
    """``dvc.lock``: the workspace's, or with ``version`` the one committed at device
    ``tag``'s git tag for it (read from git: a clone's workspace may be at any commit).
    ``open_remote``: as ``Lock``'s, called once the lock is known to exist."""
    if version is None:
        lock = root / LOCK_FILE
        # DVC reads both without edgepath's checks (a FIFO would hang it, /dev/zero fill
        # memory, binary bytes end in a traceback): read them first as any input is read
        files.read_text(lock, missing="run in a clone of the project after `dvc repro`")
        if os.path.lexists(root / "dvc.yaml"):
            files.read_text(root / "dvc.yaml")
        return Lock(root, None, str(lock), open_remote)
    if tag is None:
        raise EdgepathError("--version needs a device tag (a version is one device's)")
    from dvc.api import all_tags
    from dvc.exceptions import DvcException

    name = git_tag(tag, normalize_version(version))
    try:
        known = sorted(t for t in all_tags(str(root)) if t.startswith(git_tag(tag, "v")))
    except DvcException as e:
        raise EdgepathError(f"{root}: {one_line(e)}") from None
    if name not in known:
        raise EdgepathError(f"no git tag {name} in {root}; its versions here: "
                            f"{', '.join(known) or 'none'} (`git fetch --tags` for the remote's)")
    return Lock(root, f"refs/tags/{name}", f"{LOCK_FILE} at {name}", open_remote)


def pull(root: str | os.PathLike, tag: str | None, dest: str | os.PathLike, remote_name: str | None = None,
         progress=print, profile=None, priority: str = "speed", version: str | None = None) -> dict[str, Any]:
    """Pull device ``tag``'s build into ``dest`` (see the module's lifecycle);
    return the receipt. With ``profile`` (and no tag): the build the selector
    picks for that machine (``target_for_machine``). With ``version``: that release of
    ``tag``, from the manifest its git tag's ``dvc.lock`` names."""
    root = Path(root)
    # ``dest`` is checked (missing, empty, or an earlier pull) before anything is read,
    # and a refusal on the way leaves neither it nor a folder created above it
    with records.output_directory(dest, "pull") as scratch:
        lock = read_lock(root, tag, version, lambda: Remote(root, remote_name))
        outputs, where, remote = lock.outputs, lock.where, lock.remote
        manifest_out = manifest_output(where, outputs)
        manifest = load_manifest(root, manifest_out, lambda: remote, scratch)
        chosen = None
        if tag is None:
            tag, why = target_for_machine(manifest, profile, priority)
            chosen = {"profile": profile.summary(), "priority": priority, "why": why}
            progress(f"pull: {why}")
        entry = target(manifest, tag)
        if version is not None and entry["release"]["version"] != normalize_version(version):
            raise EdgepathError(f"{where} names a manifest in which {tag} is {entry['release']['state']} "
                                f"({entry['release']['detail']}), not {normalize_version(version)}: a tag made "
                                f"outside `edgepath release`")
        files = device_files(entry)
        listings: dict[str, dict[str, str]] = {}
        placed = []
        for f in files:
            path = safe_relative(f["path"], f"{MANIFEST}, target {tag}")
            out = _owner(outputs, path)
            if out.is_dir and out.path not in listings:
                listings[out.path] = lock.listing(out)
            md5 = listings[out.path].get(posixpath.relpath(path, out.path)) if out.is_dir else out.md5
            if md5 is None:
                raise EdgepathError(f"{path}: missing: the manifest names it but {out.path} on the remote has no such file")
            placed.append((f, out, md5, safe_relative(f["name"], f"{MANIFEST}, target {tag}, {path}'s name")))
        _refuse_extra(tag, files, listings)
        total = sum(f["size"] for f, *_ in placed)
        done = 0
        for f, out, md5, rel in placed:
            target_file = scratch / rel
            if not target_file.resolve().is_relative_to(scratch.resolve()):
                raise EdgepathError(f"{f['path']}: refused: it would write outside the pull's directory")
            target_file.parent.mkdir(parents=True, exist_ok=True)
            remote.download(md5, target_file, f["path"])
            size, sha = target_file.stat().st_size, sha256_file(target_file)
            if (size, sha) != (f["size"], f["sha256"]):
                raise EdgepathError(f"{f['path']}: altered: the remote's copy has {size} bytes, sha256 {sha}; "
                                    f"the manifest says {f['size']} bytes, sha256 {f['sha256']}")
            done += size
            progress(f"pull {tag}: {rel} ({size / 2**20:.1f} MiB, sha256 ok) [{done / 2**20:.0f}/{total / 2**20:.0f} MiB]")
        digest = build_digest([{**f, "name": rel} for f, _, _, rel in placed])
        if digest != entry["release"]["digest"]:
            raise EdgepathError(f"{tag}: the files pulled have content digest {digest}; the manifest says "
                                f"{entry['release']['digest']}")
        receipt = {
            **records.envelope("pull"),
            "tag": tag,
            "release": {"state": entry["release"]["state"], "version": entry["release"]["version"], "digest": digest,
                        **({"git_tag": git_tag(tag, entry["release"]["version"])} if version else {})},
            **({"selected_for_this_machine": chosen} if chosen else {}),
            "remote": {"name": remote.name, "url": remote.url},
            "manifest_md5": manifest_out.md5,
            "model": manifest["model"],
            "path": {k: entry["path"][k] for k in ("name", "rationale")},
            "verification": {k: entry["verification"][k] for k in ("verified", "state", "detail")},
            "files": [{"path": rel, "source": f["path"], "size": f["size"], "sha256": f["sha256"]}
                      for f, _, _, rel in placed],
        }
        records.write(scratch / RECEIPT, "pull", receipt)
    return receipt


def _refuse_extra(tag: str, files: list[dict[str, Any]],
                  listings: dict[str, dict[str, str]]) -> None:
    """A file the remote holds in one of the build's directories that the
    manifest does not name: the manifest and the remote disagree."""
    named = {f["path"] for f in files}
    folders = {posixpath.dirname(p) for p in named}
    for out_path, listing in listings.items():
        for rel in listing:
            path = posixpath.join(out_path, rel)
            if posixpath.dirname(path) in folders and path not in named:
                raise EdgepathError(f"{path}: extra: the remote holds it beside {tag}'s build, but the manifest "
                                    f"does not name it")


def listing(root: str | os.PathLike, remote_name: str | None = None) -> list[dict[str, Any]]:
    """Each device tag of the manifest: its path, build state, verification
    and size (the sum of its files)."""
    root = Path(root)
    out = manifest_output(str(root / LOCK_FILE), workspace_outputs(root))
    with tempfile.TemporaryDirectory(prefix="edgepath-ls.") as scratch:  # not in the project: ls only reads
        manifest = load_manifest(root, out, lambda: Remote(root, remote_name), Path(scratch))
    rows = []
    for t in manifest["targets"]:
        files = build_files(t)
        rows.append({"tag": t["tag"], "path": t["path"]["name"], "build": t["build"]["state"],
                     "verified": t["verification"]["verified"], "release": t["release"], "files": len(files),
                     "bytes": sum(f["size"] for f in files)})
    return rows



# ---------------------------------------------------------------- the commands

def _cmd_pull(args: argparse.Namespace) -> None:
    if (args.tag is None) == (not args.probe):
        raise EdgepathError("name a device tag, or pass --probe (not both)")
    profile = None
    if args.probe:
        from ..stages.probe import probe

        profile = probe()
    out = args.out or args.tag or "build-for-this-machine"
    receipt = pull(args.project, args.tag, out, args.remote, progress=lambda line: print(line, file=sys.stderr),
                   profile=profile, priority=args.priority, version=args.version)
    size = sum(f["size"] for f in receipt["files"])
    print(f"pull {receipt['tag']} {receipt['release']['version'] or '(unreleased)'}: {receipt['path']['name']}, "
          f"{len(receipt['files'])} files, {size / 2**20:.1f} MiB, every sha256 as the manifest's -> {out} "
          f"(from {receipt['remote']['url']})")


def _cmd_ls(args: argparse.Namespace) -> None:
    from ..stages import manifest

    rows = listing(args.project, args.remote)
    if args.json:  # JSON escapes control characters itself
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    rows = printable(rows)
    print("\n".join(manifest.table([("TAG", "PATH", "BUILD", "VERIFIED", "VERSION", "FILES", "SIZE")] + [
        (r["tag"], r["path"], r["build"], "yes" if r["verified"] else "no", manifest.version_cell(r["release"]),
         str(r["files"]), f"{r['bytes'] / 2**20:.1f} MiB") for r in rows])))


def _pull_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tag", nargs="?", help="the device tag (`edgepath ls`)")
    p.add_argument("--probe", action="store_true", help="this machine's build, as the selector picks it")
    p.add_argument("--priority", default="speed", choices=("speed", "fidelity"), help="with --probe (default: speed)")
    p.add_argument("--version", help="a released version (git tag <tag>@V; default: the workspace's build)")
    p.add_argument("-o", "--out", help="the directory to write (default: the tag)")
    add_project_options(p)


def _ls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_project_options(p)


PULL = Command("pull", "fetch one device's build from the DVC remote, verified", """\
    Fetch exactly one device's build (the manifest's files for that tag) from the
    project's DVC remote, check every file's size and sha256 against the manifest,
    and write DIR in one rename: a missing, extra or altered file fails the pull,
    naming it, and leaves DIR as it was. Runs in a clone of the project (it reads
    dvc.lock; the manifest comes from the remote where the clone has none).
    DIR gets edgepath-pull.json: what was pulled, from where, and its verification.

    With --probe instead of a tag: probe this machine, and pull the build of the
    weight path the selector picks for it (a target of the manifest built with it).

    examples: edgepath pull x86-avx2 -o /opt/models/smollm2
              edgepath pull --probe -o /opt/models/smollm2""", _pull_arguments, _cmd_pull)
LS = Command("ls", "the manifest's device tags, paths, versions and sizes", """\
    List every device tag of the manifest with its weight path, build state,
    verification, version, and the number and size of its files.""", _ls_arguments, _cmd_ls)
COMMANDS = (PULL, LS)
