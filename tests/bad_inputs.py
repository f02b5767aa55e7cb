"""The bad-input cases' shape and runner, shared by tests/test_bad_input*.py.

A case runs the real ``edgepath`` command in a subprocess (so a traceback or a hang
shows as one), in a fresh directory the case's ``setup`` fills, and checks what a
careless or hostile input must get: the exit status, one line on stderr that names
the problem (no traceback), and what must and must not exist afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EDGEPATH = [sys.executable, "-m", "edgepath.cli"]
TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Path], list[str]]
    """The arguments after ``edgepath``, given the case's directory (also its cwd)."""
    message: str
    """A regular expression the one stderr line must contain (after ``error: ``)."""
    setup: Callable[[Path], None] | None = None
    code: int = 2
    exists: tuple[str, ...] = ()
    """Paths (relative to the case's directory) that must exist afterwards."""
    absent: tuple[str, ...] = ()
    """Paths that must not exist afterwards (``*`` globs allowed)."""
    unchanged: tuple[str, ...] = ()
    """Files whose bytes the command must not change."""


def copy_project(d: Path) -> Path:
    """The project's params.yaml and captured profiles, in ``d``."""
    shutil.copy(ROOT / "params.yaml", d / "params.yaml")
    shutil.copytree(ROOT / "profiles", d / "profiles")
    return d


def run_case(case: Case, d: Path) -> subprocess.CompletedProcess:
    if case.setup is not None:
        case.setup(d)
    before = {p: (d / p).read_bytes() for p in case.unchanged}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*EDGEPATH, *case.argv(d)], cwd=d, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    where = f"exit {proc.returncode}\nstdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, where
    assert proc.returncode == case.code, where
    if case.code != 0:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, f"not one line:\n{where}"
        assert re.match(r"edgepath [\w-]+: error: ", lines[0]), where
        assert re.search(case.message, lines[0]), f"{case.message!r} not in the message\n{where}"
    for p in case.exists:
        assert (d / p).exists() or (d / p).is_symlink(), f"{p} is gone\n{where}"
    for pattern in case.absent:
        found = list(d.glob(pattern)) if "*" in pattern else [d / pattern] if (d / pattern).exists() else []
        assert not found, f"{found} exist(s)\n{where}"
    for p, data in before.items():
        assert (d / p).read_bytes() == data, f"{p} was changed\n{where}"
    return proc
