"""One device's build as one directory: the DVC artifact ``build/devices/<tag>``.

The bundle stage (``bundle@<tag>``) copies the files the manifest names for the
target (its artifacts, and a phone's fallback build) to their ``name``s under
the directory, checking each copy's size and sha256 against the manifest, and
writes ``edgepath-device.json`` (a ``device`` record: the target's manifest
entry, which says its weight path, why, its verification and its version). The
copies are the same DVC objects as the stage outputs they come from, so a
remote stores them once. ``dvc artifacts get`` fetches this directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.command import Command
from ..core.errors import EdgepathError
from ..core.files import sha256_file
from ..rules.versions import build_files, target

DEVICE_RECORD = records.FILE_NAMES["device"]


def _copy_checked(source: Path, dest: Path, entry: dict[str, Any]) -> None:
    """Copy ``source`` to ``dest``; it must be a regular file of the manifest's size
    (a FIFO or ``/dev/zero`` is refused, not read forever), and the copy must have
    the manifest's sha256."""
    with files.open_regular(source) as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry["size"]:
            raise EdgepathError(f"{source}: {size} bytes; the manifest says {entry['size']} bytes "
                                f"(re-run the manifest stage)")
        with open(dest, "xb") as copy:
            shutil.copyfileobj(f, copy)
    size, sha = dest.stat().st_size, sha256_file(dest)
    if (size, sha) != (entry["size"], entry["sha256"]):
        raise EdgepathError(f"{source}: {size} bytes, sha256 {sha}; the manifest says "
                            f"{entry['size']} bytes, sha256 {entry['sha256']} (re-run the manifest stage)")


def write(manifest_path: str | os.PathLike, tag: str, out: str | os.PathLike) -> dict[str, Any]:
    """Write device ``tag``'s bundle to ``out`` atomically; return its device record.
    ``out`` replaces only an earlier bundle (``records.output_directory``), and may not
    be, hold or lie inside the manifest or a folder of the files it copies."""
    manifest_path = Path(manifest_path)
    manifest = records.read(manifest_path, "manifest")
    entry = target(manifest, tag)
    base = manifest_path.parent
    where = f"{manifest_path}, target {tag}"
    # a path may be absolute (a model directory outside the project); the name, where
    # the copy goes, stays inside OUT
    copies = [(base / f["path"], files.safe_relative(f["name"], where), f) for f in build_files(entry)]
    sources = [manifest_path, *dict.fromkeys(source.parent for source, _, _ in copies)]
    with records.output_directory(out, "device", sources=sources) as scratch:
        for source, name, f in copies:
            dest = scratch / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            _copy_checked(source, dest, f)
        record = {**records.envelope("device"), "edgepath_version": manifest["edgepath_version"],
                  "model": manifest["model"], "target": entry}
        records.write(scratch / DEVICE_RECORD, "device", record)
    return record


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    record = write(args.manifest, args.target, args.out)
    t = record["target"]
    print(f"bundle {t['tag']}: {t['path']['name']}, {t['build']['state']}, {t['release']['state']} "
          f"{t['release']['version'] or ''}".rstrip() + f" -> {args.out}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="the device tag")
    p.add_argument("--manifest", default="manifest.json")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier bundle)")


COMMAND = Command("bundle", "one device's build as one directory", """\
    Copy the files the manifest names for one device (a phone's fallback build
    included) to their names under OUT, each checked against the manifest's
    sha256, with edgepath-device.json (the device's manifest entry: path, why,
    verification, version). OUT is the device's DVC artifact; written atomically,
    replacing only an earlier bundle (or an empty folder), never the manifest or
    the folders of the files it copies.""", _arguments, _cmd)
