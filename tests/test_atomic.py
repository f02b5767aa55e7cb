import os
import signal
import subprocess
import sys
import textwrap

import pytest

from edgepath.core import atomic


def test_write_text_replaces_whole(tmp_path):
    target = tmp_path / "a" / "out.json"
    atomic.write_text(target, "one")
    atomic.write_text(target, "two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_directory_failure_keeps_previous_output(tmp_path):
    out = tmp_path / "out"
    with atomic.directory(out) as d:
        (d / "file").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic.directory(out) as d:
            (d / "file").write_text("half")
            raise RuntimeError("interrupted")
    assert (out / "file").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_directory_replaces_on_success(tmp_path):
    out = tmp_path / "out"
    for version in ("v1", "v2"):
        with atomic.directory(out) as d:
            (d / version).write_text(version)
    assert sorted(p.name for p in out.iterdir()) == ["v2"]


def test_sigkill_mid_write_leaves_previous_output_and_no_trusted_partial(tmp_path):
    out = tmp_path / "out"
    with atomic.directory(out) as d:
        (d / "model.json").write_text("complete")
    script = textwrap.dedent(f"""
        import os, signal
        from edgepath.core import atomic
        with atomic.directory({str(out)!r}) as d:
            (d / "model.json").write_text("partial")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script])
    assert done.returncode == -signal.SIGKILL
    assert (out / "model.json").read_text() == "complete"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "out"]
    assert all(name.startswith(".out.") for name in leftovers)  # scratch only, under a dot-name
