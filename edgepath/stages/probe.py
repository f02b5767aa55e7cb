"""Probe a device: read what the hardware really is into a HardwareProfile.

Every read goes through a filesystem ``root``: ``/`` on the live host, or a
captured snapshot directory with the same layout (``proc/cpuinfo``,
``proc/meminfo``, ``sys/devices/system/cpu/...``). What cannot be read from
files -- ``uname -m``, ``nvidia-smi``, PyTorch's AMX check -- is run on the
live host and, in a snapshot, read from ``.edgepath/<name>`` files that
``capture_snapshot`` writes. So a snapshot taken on a device with
``edgepath probe --capture-snapshot DIR`` probes exactly as the device did.

A profile states only what the probe read. What it takes to be a device, refusing
anything else with one line that names the file (and writing nothing):

- ``root`` is a directory: ``/``, or a snapshot.
- ``proc/cpuinfo`` is a CPU description: a regular file of UTF-8 text, at most
  ``PROC_FILE_LIMIT`` bytes, with at least one processor block (a blank-line
  separated block whose ``processor`` field is a CPU number, as x86, Arm, RISC-V and
  POWER kernels write it), and an architecture that can be told: ``uname -m`` on the
  live host; in a snapshot its ``.edgepath/uname-m``, else the cpuinfo's own words
  (``flags``: x86_64, ``Features``: aarch64).
- The CPU count is at least one: ``sys/devices/system/cpu/online`` where there is
  one (a list such as ``0-3,8-11``), else the processor blocks.
- ``proc/meminfo`` has ``MemTotal`` and ``MemAvailable`` (``MemFree`` on kernels
  before 3.14): a profile does not claim RAM it did not read.

Every other file is optional: a missing one is a fact not known (no GPU, no NPU, an
empty kernel release), but one that is there must be readable. Permission denied,
a directory, FIFO or device where a file belongs, or a file over the limit is
refused, never taken for a missing file. An ``nvidia-smi`` line that is not
``name, memory MiB, major.minor`` (empty, ``,,,``, another number of fields, a
memory that is not a number, no name) is no GPU; nvidia-smi's own ``[N/A]`` or
``[Not Supported]`` for the memory or the compute capability is recorded as not
known.

Standard library only: the probe must run on a bare device (``files`` and
``atomic`` are standard library only too).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import stat
import subprocess
from pathlib import Path

from ..core import atomic, files
from ..core.command import Command, emit
from ..core.errors import EdgepathError
from ..rules.profile import HardwareProfile

PROC_FILE_LIMIT = 3 << 20
"""The most the probe reads of one /proc or /sys file (``/dev/zero`` in a snapshot
must not be read until memory runs out). /proc/cpuinfo is the largest: about 1.6 kB
per logical CPU on x86 (its flags line), so 3 MiB holds some 1900 CPUs, more than an
edge device or a two-socket server has; the other files are a few kB."""
_ROOT_HINT = "the probe reads a device's filesystem root: / or a snapshot from `edgepath probe --capture-snapshot`"

# /proc/cpuinfo spells some Arm features differently from the names the
# selector uses; x86 flags are already in Linux's normalised spelling.
_ARM_FEATURE_NAMES = {"asimd": "neon", "asimddp": "dotprod", "asimdhp": "fp16", "fphp": "fp16"}

# MIDR implementer / part numbers of common cores (Arm TRMs).
_ARM_IMPLEMENTERS = {
    "0x41": "ARM", "0x42": "Broadcom", "0x48": "HiSilicon", "0x4e": "NVIDIA",
    "0x51": "Qualcomm", "0x61": "Apple", "0xc0": "Ampere",
}
_ARM_PARTS = {
    ("0x41", "0xd05"): "Cortex-A55", ("0x41", "0xd0b"): "Cortex-A76",
    ("0x41", "0xd0c"): "Neoverse-N1", ("0x41", "0xd40"): "Neoverse-V1",
    ("0x41", "0xd41"): "Cortex-A78", ("0x41", "0xd44"): "Cortex-X1",
    ("0x41", "0xd46"): "Cortex-A510", ("0x41", "0xd47"): "Cortex-A710",
    ("0x41", "0xd48"): "Cortex-X2", ("0x41", "0xd49"): "Neoverse-N2",
    ("0x41", "0xd4d"): "Cortex-A715", ("0x41", "0xd4e"): "Cortex-X3",
    ("0x41", "0xd4f"): "Neoverse-V2", ("0x41", "0xd80"): "Cortex-A520",
    ("0x41", "0xd81"): "Cortex-A720", ("0x41", "0xd82"): "Cortex-X4",
    ("0x41", "0xd84"): "Neoverse-V3", ("0xc0", "0xac3"): "AmpereOne",
}

# Kernel drivers of NPUs exposed through the accel subsystem, by vendor.
_ACCEL_DRIVER_VENDORS = {
    "intel_vpu": "intel", "amdxdna": "amd", "qaic": "qualcomm", "rknpu": "rockchip",
    "apusys": "mediatek", "ethosu": "arm",
}
# Qualcomm Hexagon NPUs on phones are reached through FastRPC device nodes.
_FASTRPC_NODES = ("dev/fastrpc-cdsp", "dev/fastrpc-cdsp-secure", "dev/adsprpc-smd")

# Files capture_snapshot copies (globs relative to the root).
SNAPSHOT_GLOBS = (
    "proc/cpuinfo", "proc/meminfo", "proc/sys/kernel/osrelease",
    "proc/device-tree/model", "proc/device-tree/compatible", "etc/nv_tegra_release",
    "sys/devices/system/cpu/online",
    "sys/devices/system/cpu/cpu[0-9]*/topology/core_id",
    "sys/devices/system/cpu/cpu[0-9]*/topology/physical_package_id",
    "sys/devices/system/node/node[0-9]*/cpulist",
    "proc/driver/nvidia/gpus/*/information",
    "sys/class/accel/accel[0-9]*/device/uevent",
)
_NVIDIA_SMI_QUERY = "--query-gpu=name,memory.total,compute_cap"
# What nvidia-smi prints for a field the GPU does not report (a Jetson's memory).
_NOT_REPORTED = ("[N/A]", "[Not Supported]")


def _read(path: Path) -> str | None:
    """The text of the optional file ``path``, or None where there is none. Anything
    else that stops the read (permission denied, not a regular file, over
    ``PROC_FILE_LIMIT``, not UTF-8) is refused naming the file: a fact the probe
    could not read must not turn into a default."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        pass  # permission denied on the way, a symlink loop: the read below names it
    return files.read_text(path, PROC_FILE_LIMIT)


def _is_live(root: Path) -> bool:
    return Path(os.path.realpath(root)) == Path("/")  # a symlink loop is no live root (and no RuntimeError)


def normalise_flags(arch: str, raw: list[str]) -> list[str]:
    """Lower-case, Arm features renamed to the selector's names, sorted, unique."""
    names = {flag.strip().lower() for flag in raw if flag.strip()}
    if arch == "aarch64":
        names = {_ARM_FEATURE_NAMES.get(n, n) for n in names}
    return sorted(names)


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """One dict per processor block of /proc/cpuinfo (blank-line separated)."""
    blocks, current = [], {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            current[key.strip().lower()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


def _cpu_list_len(spec: str, path: Path) -> int:
    """Number of CPUs in a sysfs list such as ``0-3,8-11`` (read from ``path``)."""
    count = 0
    for part in spec.strip().split(","):
        bounds = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part.strip())
        if bounds is None or int(bounds[2] or bounds[1]) < int(bounds[1]):
            raise EdgepathError(f"{path}: {spec.strip()[:40]!r} is not a list of CPUs such as 0-3,8-11")
        count += int(bounds[2] or bounds[1]) - int(bounds[1]) + 1
    return count


def _processors(root: Path) -> list[dict[str, str]]:
    """The processor blocks of ``root``'s cpuinfo; refused where there are none."""
    path = root / "proc/cpuinfo"
    text = files.read_text(path, PROC_FILE_LIMIT, missing=_ROOT_HINT)
    processors = [b for b in parse_cpuinfo(text) if b.get("processor", "").isdigit()]
    if not processors:
        raise EdgepathError(f"{path}: not a CPU description (no 'processor : N' entry); {_ROOT_HINT}")
    return processors


def _arch(root: Path, processors: list[dict[str, str]]) -> str:
    if _is_live(root):
        return platform.machine()
    path = root / ".edgepath/uname-m"
    recorded = (_read(path) or "").strip()
    if recorded:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", recorded):
            raise EdgepathError(f"{path}: {recorded[:40]!r} is not a machine name as `uname -m` prints it")
        return recorded
    if any("flags" in b for b in processors):
        return "x86_64"
    if any("features" in b for b in processors):
        return "aarch64"
    raise EdgepathError(f"{root / 'proc/cpuinfo'}: cannot tell the architecture: its processors list neither "
                        f"flags (x86) nor Features (Arm), and there is no {path} (`uname -m` of the device)")


def _cpu_identity(arch: str, blocks: list[dict[str, str]], root: Path) -> tuple[str, str]:
    first = blocks[0] if blocks else {}
    if arch == "x86_64":
        return first.get("vendor_id", ""), first.get("model name", "")
    implementer = first.get("cpu implementer", "").lower()
    vendor = _ARM_IMPLEMENTERS.get(implementer, implementer)
    parts = []  # big.LITTLE phones list several core types
    for b in blocks:
        key = (b.get("cpu implementer", "").lower(), b.get("cpu part", "").lower())
        name = _ARM_PARTS.get(key, f"part {key[1]}" if key[1] else "")
        if name and name not in parts:
            parts.append(name)
    model = " + ".join(parts)
    board = (_read(root / "proc/device-tree/model") or "").strip("\x00\n ")
    return vendor, f"{board} ({model})" if board and model else (board or model)


def _topology(root: Path, blocks: list[dict[str, str]]) -> tuple[int, int]:
    """(physical cores, logical CPUs). Physical = distinct (package, core) pairs."""
    online_path = root / "sys/devices/system/cpu/online"
    online = _read(online_path)
    n_logical = _cpu_list_len(online, online_path) if online is not None else len(blocks)
    cores = set()
    for topo in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/topology")):
        core, package = _read(topo / "core_id"), _read(topo / "physical_package_id")
        if core is not None and package is not None:
            cores.add((package.strip(), core.strip()))
    if not cores:
        cores = {(b["physical id"], b["core id"]) for b in blocks if "physical id" in b and "core id" in b}
    return (len(cores) if cores else n_logical), n_logical


def _meminfo(root: Path) -> tuple[int, int]:
    """(total, available) bytes of RAM; refused where meminfo does not say."""
    path = root / "proc/meminfo"
    fields = {}
    text = files.read_text(path, PROC_FILE_LIMIT, missing=f"a profile does not guess the device's RAM; {_ROOT_HINT}")
    for line in text.splitlines():
        key, _, value = line.partition(":")
        number = value.strip().split()
        if number and re.fullmatch(r"[0-9]+", number[0]):
            fields[key.strip()] = int(number[0]) * 1024  # meminfo counts kB
    available = fields.get("MemAvailable", fields.get("MemFree"))
    if "MemTotal" not in fields or available is None:
        raise EdgepathError(f"{path}: no MemTotal and MemAvailable (or MemFree) in kB; "
                            f"a profile does not guess the device's RAM")
    return fields["MemTotal"], available


def _nvidia_smi(root: Path) -> str | None:
    if not _is_live(root):
        return _read(root / ".edgepath/nvidia-smi.csv")
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, _NVIDIA_SMI_QUERY, "--format=csv,noheader,nounits"],
            capture_output=True, encoding="utf-8", errors="replace", timeout=30, check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return done.stdout


def parse_nvidia_smi(text: str | None) -> tuple[str, int | None, str | None] | None:
    """(name, memory bytes, compute capability) of the first GPU in the output of
    ``nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader,nounits``;
    None where its first line is not such a GPU (see the module docstring)."""
    lines = (text or "").strip().splitlines()
    if not lines:
        return None
    fields = [f.strip() for f in lines[0].split(",")]
    if len(fields) != 3:
        return None
    name, mib, cc = fields
    if not name or not (re.fullmatch(r"[0-9]+", mib) or mib in _NOT_REPORTED):
        return None
    if not (re.fullmatch(r"[0-9]+\.[0-9]+", cc) or cc in _NOT_REPORTED):
        return None
    mem = int(mib) * 1024 * 1024 if mib not in _NOT_REPORTED else None  # nvidia-smi reports MiB
    return name, mem, (cc if cc not in _NOT_REPORTED else None)


def _gpu(root: Path) -> tuple[str | None, int | None, str | None, bool]:
    """(name, memory bytes, compute capability, integrated?) of the first NVIDIA GPU."""
    name, mem, cc = parse_nvidia_smi(_nvidia_smi(root)) or (None, None, None)
    if name is None:
        for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
            for line in (_read(info) or "").splitlines():
                if line.startswith("Model:"):
                    name = line.partition(":")[2].strip()
                    break
            if name:
                break
    compatible = _read(root / "proc/device-tree/compatible") or ""
    integrated = "nvidia,tegra" in compatible or (root / "etc/nv_tegra_release").exists()
    if integrated and name is None:
        name = "NVIDIA Tegra (integrated)"
    return name, mem, cc, integrated


def _npu(root: Path) -> tuple[str | None, str | None]:
    """(vendor, driver) of the first NPU that a driver or device node announces."""
    for uevent in sorted((root / "sys/class/accel").glob("accel[0-9]*/device/uevent")):
        for line in (_read(uevent) or "").splitlines():
            if line.startswith("DRIVER="):
                driver = line.partition("=")[2].strip()
                if driver in _ACCEL_DRIVER_VENDORS:
                    return _ACCEL_DRIVER_VENDORS[driver], driver
    if any((root / node).exists() for node in _FASTRPC_NODES):
        return "qualcomm", "fastrpc"
    return None, None


def _torch_amx(root: Path, arch: str) -> bool | None:
    """PyTorch's own check that AMX tiles are usable by this process (x86 only)."""
    if arch != "x86_64":
        return None
    if not _is_live(root):
        path = root / ".edgepath/torch_amx_tile_supported"
        recorded = _read(path)
        if recorded is None:
            return None
        if recorded.strip() not in ("true", "false"):
            raise EdgepathError(f"{path}: {recorded.strip()[:40]!r}, not true or false")
        return recorded.strip() == "true"
    try:
        import torch  # optional: the probe runs on devices without it
    except ImportError:
        return None
    return bool(torch.cpu._is_amx_tile_supported())


def probe(root: str | os.PathLike = "/", source: str | None = None) -> HardwareProfile:
    """Probe the device whose filesystem is mounted at ``root``; refused, naming the
    file, where ``root`` is not a device (see the module docstring)."""
    root = Path(root)
    try:
        is_directory = stat.S_ISDIR(os.stat(root).st_mode)
    except OSError as e:
        raise EdgepathError(f"{files.describe_os_error(e, root)} ({_ROOT_HINT})") from None
    if not is_directory:
        raise EdgepathError(f"{root}: not a directory ({_ROOT_HINT})")
    blocks = _processors(root)
    arch = _arch(root, blocks)
    raw_flags = (blocks[0].get("flags") or blocks[0].get("features") or "").split()
    flags = normalise_flags(arch, raw_flags)
    vendor, model = _cpu_identity(arch, blocks, root)
    n_physical, n_logical = _topology(root, blocks)
    ram_total, ram_available = _meminfo(root)
    gpu_name, gpu_mem, gpu_cc, integrated = _gpu(root)
    npu_vendor, npu_driver = _npu(root)
    if gpu_name is not None:
        accelerator = "cuda_unified" if integrated else "cuda_discrete"
        if integrated and gpu_mem is None:
            gpu_mem = ram_total  # an integrated GPU shares system memory
    elif npu_vendor is not None:
        accelerator = f"npu:{npu_vendor}"
    else:
        accelerator = "none"
    if accelerator.startswith("cuda"):
        supports_bf16 = gpu_cc is not None and float(gpu_cc) >= 8.0  # bf16 arrived with Ampere
    elif arch == "x86_64":
        supports_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    else:
        supports_bf16 = "bf16" in flags
    numa = len(list((root / "sys/devices/system/node").glob("node[0-9]*")))
    if source is None:
        source = "probe: live host" if _is_live(root) else f"snapshot: {Path(os.path.abspath(root)).name}"
    return HardwareProfile(
        arch=arch, cpu_vendor=vendor, cpu_model=model, cpu_flags=flags,
        n_physical=n_physical, n_logical=n_logical, numa_nodes=numa,
        ram_total_bytes=ram_total, ram_available_bytes=ram_available,
        kernel_release=(_read(root / "proc/sys/kernel/osrelease") or "").strip(),
        accelerator=accelerator, gpu_name=gpu_name, gpu_mem_bytes=gpu_mem,
        gpu_compute_capability=gpu_cc, npu_driver=npu_driver,
        supports_bf16=supports_bf16, torch_amx_tile_supported=_torch_amx(root, arch),
        source=source,
    )


def capture_snapshot(dest: str | os.PathLike, root: str | os.PathLike = "/") -> Path:
    """Copy what the probe reads from ``root`` into ``dest`` (plus the outputs of
    the commands it runs), so the device can be probed again anywhere. ``root`` must
    probe (it is refused as ``probe`` refuses it) and ``dest`` must be a place for a
    snapshot (``_snapshot_destination``) before anything is written; the snapshot is
    written whole or not at all."""
    root = Path(root)
    dest = _snapshot_destination(Path(dest), root)
    profile = probe(root)
    recorded = {"uname-m": profile.arch, "nvidia-smi.csv": _nvidia_smi(root)}
    if profile.torch_amx_tile_supported is not None:
        recorded["torch_amx_tile_supported"] = "true" if profile.torch_amx_tile_supported else "false"
    with atomic.directory(dest) as scratch:
        for pattern in SNAPSHOT_GLOBS:
            for src in sorted(root.glob(pattern)):
                if src.is_file():
                    target = scratch / src.relative_to(root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(files.read_bytes(src, PROC_FILE_LIMIT))
        for node in _FASTRPC_NODES:
            if (root / node).exists():
                (scratch / node).parent.mkdir(parents=True, exist_ok=True)
                (scratch / node).touch()
        (scratch / ".edgepath").mkdir()
        for name, text in recorded.items():
            if text and text.strip():
                (scratch / ".edgepath" / name).write_text(text.strip() + "\n")
    return dest


def _snapshot_destination(dest: Path, root: Path) -> Path:
    """``dest`` as an absolute path, where it may take a snapshot of ``root``: a new or
    empty directory, or an earlier snapshot (it holds ``.edgepath/uname-m``, which
    every capture writes), which is replaced. Refused, before anything is written: an
    existing file or symlink, a directory of other files, the current directory or
    one above it, and ``root`` itself or a directory holding it."""
    return files.check_replaceable_directory(
        dest, lambda place: (place / ".edgepath/uname-m").is_file(), "that are not a snapshot (no .edgepath/uname-m)",
        reads=[root], overlap="is or holds the root it would copy ({source}); write the snapshot elsewhere",
        may_lie_inside_reads=True)


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..core import records
    from ..rules import fleet

    root = files.path_of(args.root, "--root")
    if args.capture_snapshot is not None:
        dest = capture_snapshot(files.path_of(args.capture_snapshot, "--capture-snapshot"), root=root)
        print(f"probe: snapshot of {root} written to {dest}")
        return
    spec = args.profile
    if args.target is not None:
        spec = fleet.load(args.params).target(args.target).profile
    if spec == fleet.PROBE:
        profile = probe(root, source=args.source)
    else:
        profile = HardwareProfile.from_dict(records.read(files.path_of(spec, "--profile"), "profile"))
    emit(profile.to_json(), args.out, "profile", profile.to_dict())


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default="/", help="filesystem root to probe (default: this host)")
    p.add_argument("--source", help="how the profile was obtained (recorded in 'source')")
    p.add_argument("--profile", default="probe", help="'probe' or a profile JSON to load")
    p.add_argument("--target", help="take --profile from this target in the params file")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--capture-snapshot", metavar="DIR", help="copy what the probe reads into DIR")
    p.add_argument("--out", help="write the profile record here (default: print it)")


COMMAND = Command("probe", "probe this host, or load a captured profile", """\
    Probe a device into a hardware profile (JSON).

    With no options, probe this host: /proc/cpuinfo (ISA flags such as AMX),
    /proc/meminfo, the sysfs CPU topology (physical vs logical cores), NVIDIA
    GPUs and NPUs, and PyTorch's own AMX check where torch is installed.
    --root probes a captured snapshot instead; --capture-snapshot writes one
    of this host, to probe it elsewhere. --profile loads and validates a
    captured profile JSON (e.g. a phone's, from profiles/).

    examples: edgepath probe
              edgepath probe --capture-snapshot /tmp/myhost
              edgepath probe --target phone-npu --out build/profiles/phone-npu.json""", _arguments, _cmd)
