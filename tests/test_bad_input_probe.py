"""Bad input to ``edgepath probe`` (issue 19, finding 4 and the categories behind it).

Each case runs the real CLI (``tests/bad_inputs.py``) and expects one line, exit 2,
no traceback, and nothing written: no ``--out`` profile, no snapshot directory (nor
the parents it would have made), the user's files unchanged. The probe refuses a
root that is not a device (missing, empty, a file), a cpuinfo that is not a CPU
description (missing, unreadable, not a regular file, over the limit, random bytes,
no processor entries, no architecture), facts it cannot read (no meminfo, a
malformed CPU list); ``--capture-snapshot`` refuses the same roots and any place that
is not a new, empty or earlier snapshot directory; ``--profile`` refuses what is not
a profile record. Then: a GPU capture that is empty or malformed probes as no GPU.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from .bad_inputs import ROOT, Case, run_case
from .conftest import HOSTS

HOST = "ryzen-5800x-desktop"
"""The snapshot the cases spoil: no GPU of its own, and a CPU without bf16, so a GPU
made up from a bad capture would show in both ``accelerator`` and ``supports_bf16``."""
PROBE_SNAP = ["probe", "--root", "snap", "--out", "p.json"]


# ---------------------------------------------------------------- setups

def snap(d: Path) -> Path:
    """``d/snap``: a copy of ``HOST``'s snapshot."""
    shutil.copytree(HOSTS / HOST, d / "snap")
    return d / "snap"


def cpuinfo_is(content: bytes | str):
    return file_is("proc/cpuinfo", content)


def random_cpuinfo(d: Path) -> None:
    (snap(d) / "proc/cpuinfo").write_bytes(os.urandom(4096) + b"\xff")  # never valid UTF-8


def cpuinfo_directory(d: Path) -> None:
    path = snap(d) / "proc/cpuinfo"
    path.unlink()
    path.mkdir()


def cpuinfo_fifo(d: Path) -> None:
    path = snap(d) / "proc/cpuinfo"
    path.unlink()
    os.mkfifo(path)


def cpuinfo_dev_zero(d: Path) -> None:
    path = snap(d) / "proc/cpuinfo"
    path.unlink()
    path.symlink_to("/dev/zero")


def cpuinfo_symlink_loop(d: Path) -> None:
    path = snap(d) / "proc/cpuinfo"
    path.unlink()
    path.symlink_to("cpuinfo")


def cpuinfo_huge(d: Path) -> None:
    with open(snap(d) / "proc/cpuinfo", "r+b") as f:
        f.truncate(64 << 20)  # sparse: no disk used


def cpuinfo_unreadable(d: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root, which reads a chmod-000 file anyway; tests/test_probe.py "
                    "simulates permission denied at os.open instead")
    (snap(d) / "proc/cpuinfo").chmod(0)


def no_architecture(d: Path) -> None:
    root = snap(d)
    (root / ".edgepath/uname-m").unlink()
    (root / "proc/cpuinfo").write_text("processor\t: 0\nmodel name\t: a CPU of no known family\n")


def file_is(rel: str, content: bytes | str):
    def setup(d: Path) -> None:
        (snap(d) / rel).write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def file_removed(rel: str):
    def setup(d: Path) -> None:
        (snap(d) / rel).unlink()
    return setup


def meminfo_directory(d: Path) -> None:
    path = snap(d) / "proc/meminfo"
    path.unlink()
    path.mkdir()


def empty_dir(name: str):
    def setup(d: Path) -> None:
        (d / name).mkdir()
    return setup


def root_is_a_file(d: Path) -> None:
    (d / "snap").write_text("not a directory\n")


def users_dir(d: Path) -> None:
    snap(d)
    (d / "mine").mkdir()
    (d / "mine" / "notes.txt").write_text("mine\n")


def users_file(d: Path) -> None:
    snap(d)
    (d / "mine.txt").write_text("mine\n")


def snap_and_symlinked_dir(d: Path) -> None:
    snap(d)
    (d / "elsewhere").mkdir()
    (d / "link").symlink_to("elsewhere")


def node_cpulist_huge(d: Path) -> None:
    """A file the probe only globs (it counts NUMA nodes) but a capture copies: the
    root probes, and the copy fails part-way through the snapshot."""
    with open(snap(d) / "sys/devices/system/node/node0/cpulist", "r+b") as f:
        f.truncate(64 << 20)


def snap_inside_outer(d: Path) -> None:
    (d / "outer").mkdir()
    snap(d / "outer")


def profile_is(content: bytes | str):
    def setup(d: Path) -> None:
        (d / "profile.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def profile_directory(d: Path) -> None:
    (d / "profile.json").mkdir()


def profile_fifo(d: Path) -> None:
    os.mkfifo(d / "profile.json")


def profile_dev_zero(d: Path) -> None:
    (d / "profile.json").symlink_to("/dev/zero")


def profile_unreadable(d: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root, which reads a chmod-000 file anyway")
    shutil.copy(ROOT / "profiles" / "x86-avx2.json", d / "profile.json")
    (d / "profile.json").chmod(0)


def gpu_capture(text: str):
    def setup(d: Path) -> None:
        (snap(d) / ".edgepath/nvidia-smi.csv").write_text(text)
    return setup


# ---------------------------------------------------------------- the cases

def probe_case(id: str, setup, message: str) -> Case:
    """``probe --root snap --out p.json`` refused: no p.json."""
    return Case(f"probe-{id}", lambda d: PROBE_SNAP, message, setup, absent=("p.json",))


def capture_case(id: str, argv, message: str, setup=None, **kwargs) -> Case:
    """``probe --capture-snapshot ...`` refused: no new directory, no leftover scratch."""
    kwargs.setdefault("absent", ("new", "a", ".new.*", ".a.*"))
    return Case(f"capture-{id}", argv, message, setup, **kwargs)


def profile_case(id: str, setup, message: str, path: str = "profile.json") -> Case:
    """``probe --profile PATH --out p.json`` refused: no p.json."""
    return Case(f"profile-{id}", lambda d: ["probe", "--profile", path, "--out", "p.json"], message, setup,
                absent=("p.json",))


CASES = [
    # The root is not a device's filesystem root.
    Case("probe-root-nonexistent", lambda d: ["probe", "--root", "/nonexistent", "--out", "p.json"],
         r"/nonexistent: no such file or directory", absent=("p.json",)),
    probe_case("root-empty-folder", empty_dir("snap"), r"snap/proc/cpuinfo: no such file"),
    probe_case("root-is-a-file", root_is_a_file, r"snap: not a directory"),
    Case("probe-root-empty-string", lambda d: ["probe", "--root", "", "--out", "p.json"],
         r"--root: empty path", absent=("p.json",)),
    Case("probe-root-nouser", lambda d: ["probe", "--root", "~nouser-edgepath/snap", "--out", "p.json"],
         r"no such user", absent=("p.json",)),
    # The cpuinfo is unreadable or not a regular file of bounded size.
    probe_case("cpuinfo-permission-denied", cpuinfo_unreadable, r"proc/cpuinfo: permission denied"),
    probe_case("cpuinfo-directory", cpuinfo_directory, r"proc/cpuinfo: a directory, not a regular file"),
    probe_case("cpuinfo-fifo", cpuinfo_fifo, r"proc/cpuinfo: a FIFO, not a regular file"),
    probe_case("cpuinfo-dev-zero", cpuinfo_dev_zero, r"proc/cpuinfo: a character device, not a regular file"),
    probe_case("cpuinfo-symlink-loop", cpuinfo_symlink_loop, r"proc/cpuinfo: too many levels of symbolic links"),
    probe_case("cpuinfo-over-the-limit", cpuinfo_huge, r"proc/cpuinfo: \d+ bytes, over the \d+ bytes"),
    # The cpuinfo is read but is not a CPU description.
    probe_case("cpuinfo-random-bytes", random_cpuinfo, r"proc/cpuinfo: not UTF-8 text"),
    probe_case("cpuinfo-empty", cpuinfo_is(""), r"proc/cpuinfo: not a CPU description"),
    probe_case("cpuinfo-other-text", cpuinfo_is("root:x:0:0:root:/root:/bin/bash\n" * 50),
               r"proc/cpuinfo: not a CPU description"),
    probe_case("cpuinfo-no-processor-entry", cpuinfo_is("flags\t\t: fpu avx2\nmodel name\t: x\n"),
               r"proc/cpuinfo: not a CPU description"),
    probe_case("cpuinfo-processor-not-a-number", cpuinfo_is("processor\t: zero\nflags\t\t: avx2\n"),
               r"proc/cpuinfo: not a CPU description"),
    probe_case("cpuinfo-no-architecture", no_architecture, r"proc/cpuinfo: cannot tell the architecture"),
    probe_case("uname-m-not-a-machine-name", file_is(".edgepath/uname-m", "x86_64; touch PWNED\n"),
               r"uname-m: .* is not a machine name"),
    probe_case("uname-m-binary", file_is(".edgepath/uname-m", b"\xff\xfe\n"), r"uname-m: not UTF-8 text"),
    # Facts the probe cannot read are refused, not recorded as 0.
    probe_case("cpu-online-empty", file_is("sys/devices/system/cpu/online", "\n"),
               r"cpu/online: '' is not a list of CPUs"),
    probe_case("cpu-online-garbage", file_is("sys/devices/system/cpu/online", "all of them\n"),
               r"cpu/online: .* is not a list of CPUs"),
    probe_case("cpu-online-backwards", file_is("sys/devices/system/cpu/online", "7-0\n"),
               r"cpu/online: .* is not a list of CPUs"),
    probe_case("meminfo-missing", file_removed("proc/meminfo"), r"proc/meminfo: no such file .*RAM"),
    probe_case("meminfo-no-memtotal", file_is("proc/meminfo", "MemFree: 1024 kB\n"),
               r"proc/meminfo: no MemTotal"),
    probe_case("meminfo-not-numbers", file_is("proc/meminfo", "MemTotal: lots\nMemAvailable: some\n"),
               r"proc/meminfo: no MemTotal"),
    probe_case("meminfo-directory", meminfo_directory, r"proc/meminfo: a directory, not a regular file"),
    probe_case("torch-amx-record-not-boolean", file_is(".edgepath/torch_amx_tile_supported", "maybe\n"),
               r"torch_amx_tile_supported: 'maybe', not true or false"),
    # --capture-snapshot: a root that does not probe, a place that is not a snapshot's.
    capture_case("root-nonexistent", lambda d: ["probe", "--root", "/nonexistent", "--capture-snapshot", "new"],
                 r"/nonexistent: no such file or directory"),
    capture_case("root-nonexistent-nested-out",
                 lambda d: ["probe", "--root", "/nonexistent", "--capture-snapshot", "a/b/new"],
                 r"/nonexistent: no such file or directory"),
    capture_case("root-empty-folder", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "new"],
                 r"snap/proc/cpuinfo: no such file", empty_dir("snap")),
    capture_case("root-cpuinfo-random-bytes", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "new"],
                 r"proc/cpuinfo: not UTF-8 text", random_cpuinfo),
    capture_case("root-cpuinfo-dev-zero", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "new"],
                 r"proc/cpuinfo: a character device", cpuinfo_dev_zero),
    capture_case("root-meminfo-missing", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "new"],
                 r"proc/meminfo: no such file", file_removed("proc/meminfo")),
    capture_case("copy-fails-part-way", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "a/new"],
                 r"node0/cpulist: \d+ bytes, over the", node_cpulist_huge),
    capture_case("into-a-users-folder", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "mine"],
                 r"mine: holds files that are not a snapshot", users_dir, unchanged=("mine/notes.txt",)),
    capture_case("into-a-users-file", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "mine.txt"],
                 r"mine.txt: exists and is not a directory", users_file, unchanged=("mine.txt",)),
    capture_case("into-a-symlink", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "link"],
                 r"link: is a symbolic link; not replaced \(name the directory it points to", snap_and_symlinked_dir,
                 exists=("elsewhere", "link")),
    capture_case("root-a-symlink-loop", lambda d: ["probe", "--root", "loop", "--capture-snapshot", "new"],
                 r"loop: too many levels of symbolic links", lambda d: (d / "loop").symlink_to("loop")),
    capture_case("into-the-current-folder", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "."],
                 r"\.: is the current directory", snap, unchanged=("snap/proc/cpuinfo",)),
    capture_case("into-the-root-itself", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "snap"],
                 r"snap: is or holds the root it would copy", snap, unchanged=("snap/proc/cpuinfo",)),
    capture_case("into-a-folder-holding-the-root",
                 lambda d: ["probe", "--root", "outer/snap", "--capture-snapshot", "outer"],
                 r"outer: is or holds the root it would copy",
                 snap_inside_outer,
                 unchanged=("outer/snap/proc/cpuinfo",)),
    capture_case("empty-string", lambda d: ["probe", "--root", "snap", "--capture-snapshot", ""],
                 r"--capture-snapshot: empty path", snap),
    capture_case("nouser", lambda d: ["probe", "--root", "snap", "--capture-snapshot", "~nouser-edgepath/new"],
                 r"no such user", snap),
    # --profile: what is not a profile record.
    profile_case("missing", None, r"profile.json: no such file"),
    profile_case("directory", profile_directory, r"profile.json: a directory, not a regular file"),
    profile_case("fifo", profile_fifo, r"profile.json: a FIFO, not a regular file"),
    profile_case("dev-zero", profile_dev_zero, r"profile.json: a character device, not a regular file"),
    profile_case("permission-denied", profile_unreadable, r"profile.json: permission denied"),
    profile_case("empty-file", profile_is(""), r"profile.json: not valid JSON"),
    profile_case("binary-garbage", profile_is(b"\x89PNG\r\n\x1a\n\x00\x00\xff"), r"profile.json: not UTF-8 text"),
    profile_case("json-list", profile_is('["x86_64"]'), r"profile.json: a JSON array where a JSON object"),
    profile_case("json-string", profile_is('"x86_64"'), r"profile.json: a JSON string where a JSON object"),
    profile_case("deeply-nested", profile_is("[" * 100_000 + "]" * 100_000), r"profile.json: JSON nested deeper"),
    profile_case("deeply-nested-object", profile_is('{"a":' * 1000 + "1" + "}" * 1000),
                 r"profile.json: JSON nested deeper"),
    profile_case("not-a-profile-record", profile_is('{"kind": "edgepath.model", "schema_version": 1}'),
                 r"profile.json: a record of kind 'edgepath.model', not an edgepath profile record"),
    profile_case("nouser", None, r"no such user", path="~nouser-edgepath/x.json"),
    profile_case("empty-string", None, r"--profile: empty path", path=""),
    # --out of a good probe onto what is not an earlier profile record.
    Case("probe-out-is-a-users-file", lambda d: ["probe", "--root", "snap", "--out", "mine.txt"],
         r"mine.txt: exists and is not an edgepath profile record", users_file, unchanged=("mine.txt",)),
    Case("probe-out-is-a-folder", lambda d: ["probe", "--root", "snap", "--out", "mine"],
         r"mine: exists and is not an edgepath profile record", users_dir, unchanged=("mine/notes.txt",)),
    Case("probe-out-empty-string", lambda d: ["probe", "--root", "snap", "--out", ""],
         r"empty path", snap),
]

GPU_CAPTURES = {
    "empty": "", "blank-lines": "\n\n", "commas": ",,,\n", "two-commas": ",,\n", "one-field": "NVIDIA L4\n",
    "two-fields": "NVIDIA L4, 23034\n", "four-fields": "NVIDIA L4, 23034, 8.9, 1\n",
    "empty-name": " , 23034, 8.9\n", "memory-not-a-number": "NVIDIA L4, lots, 8.9\n",
    "memory-negative": "NVIDIA L4, -1, 8.9\n", "compute-capability-not-a-number": "NVIDIA L4, 23034, eight\n",
    "an-error-message": "No devices were found\n",
}
"""``.edgepath/nvidia-smi.csv`` captures that are no GPU: the probe succeeds and says
no GPU (``test_a_gpu_capture_that_is_not_a_gpu_is_no_gpu`` reads the profile)."""
CASES += [Case(f"gpu-capture-{id}", lambda d: PROBE_SNAP, "", gpu_capture(text), code=0, exists=("p.json",))
          for id, text in GPU_CAPTURES.items()]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    run_case(case, tmp_path)


@pytest.mark.parametrize("case", [c for c in CASES if c.id.startswith("gpu-capture-")], ids=lambda c: c.id)
def test_a_gpu_capture_that_is_not_a_gpu_is_no_gpu(case, tmp_path):
    run_case(case, tmp_path)
    profile = json.loads((tmp_path / "p.json").read_text())
    assert (profile["accelerator"], profile["gpu_name"], profile["gpu_mem_bytes"], profile["supports_bf16"]) == (
        "none", None, None, False)


def test_a_good_gpu_capture_is_a_gpu(tmp_path):
    """The control: the same snapshot with a well-formed capture does probe as a GPU."""
    run_case(Case("gpu-capture-good", lambda d: PROBE_SNAP, "", gpu_capture("NVIDIA L4, 23034, 8.9\n"), code=0,
                  exists=("p.json",)), tmp_path)
    profile = json.loads((tmp_path / "p.json").read_text())
    assert (profile["accelerator"], profile["gpu_name"], profile["supports_bf16"]) == (
        "cuda_discrete", "NVIDIA L4", True)
