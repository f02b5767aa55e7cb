"""Atomic writes: an interrupted stage leaves the previous output or none.

Everything is built beside its destination (same filesystem, so the final
``os.replace``/``rename`` is atomic) under a name no stage reads, then moved
into place in one step.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file, fsync and rename."""
    path = Path(os.path.abspath(path))
    created = _make_parents(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except BaseException:
        _remove_created(created)
        raise
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are ordinary files
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _remove_created(created)
        raise


@contextlib.contextmanager
def directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty scratch directory that becomes ``path`` when the block ends
    without an exception. An existing ``path`` is replaced only then; on any error
    the scratch directory is removed. A kill (SIGKILL, OOM) leaves it under a
    dot-name; the next write of ``path`` removes it, so a folder that holds
    ``path`` (a stage's dependency) holds no partial output for long."""
    path = Path(os.path.abspath(path))
    created = _make_parents(path)
    for stale in [*path.parent.glob(f".{glob.escape(path.name)}.*.tmp"),
                  *path.parent.glob(f".{glob.escape(path.name)}.*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(scratch, 0o777 & ~_umask())
    try:
        yield scratch
        if path.exists():
            retired = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, retired / path.name)
            os.rename(scratch, path)
            shutil.rmtree(retired)
        else:
            os.rename(scratch, path)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        _remove_created(created)
        raise


def _make_parents(path: Path) -> Path | None:
    """Create ``path``'s missing parent directories; the topmost one created, if any,
    so that a failed write can take them away again."""
    missing = [p for p in path.parents if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


def _remove_created(top: Path | None) -> None:
    """Remove the directories ``_make_parents`` created (they hold nothing else)."""
    if top is not None:
        shutil.rmtree(top, ignore_errors=True)
