"""Probe a device: read what the hardware really is into a HardwareProfile.

Every read goes through a filesystem ``root``: ``/`` on the live host, or a
captured snapshot directory with the same layout (``proc/cpuinfo``,
``proc/meminfo``, ``sys/devices/system/cpu/...``). What cannot be read from
files -- ``uname -m``, ``nvidia-smi``, PyTorch's AMX check -- is run on the
live host and, in a snapshot, read from ``.edgepath/<name>`` files that
``capture_snapshot`` writes. So a snapshot taken on a device with
``edgepath probe --capture-snapshot DIR`` probes exactly as the device did.

Standard library only: the probe must run on a bare device.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from .command import Command, emit
from .profile import HardwareProfile

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


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
        return None


def _is_live(root: Path) -> bool:
    return root.resolve() == Path("/")


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


def _cpu_list_len(spec: str) -> int:
    """Number of CPUs in a sysfs list such as ``0-3,8-11``."""
    count = 0
    for part in spec.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def _arch(root: Path, blocks: list[dict[str, str]]) -> str:
    if _is_live(root):
        return platform.machine()
    recorded = _read(root, ".edgepath/uname-m")
    if recorded:
        return recorded.strip()
    if any("flags" in b for b in blocks):
        return "x86_64"
    if any("features" in b for b in blocks):
        return "aarch64"
    return "unknown"


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
    board = (_read(root, "proc/device-tree/model") or "").strip("\x00\n ")
    return vendor, f"{board} ({model})" if board and model else (board or model)


def _topology(root: Path, blocks: list[dict[str, str]]) -> tuple[int, int]:
    """(physical cores, logical CPUs). Physical = distinct (package, core) pairs."""
    online = _read(root, "sys/devices/system/cpu/online")
    n_logical = _cpu_list_len(online) if online else len(blocks)
    cores = set()
    for topo in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/topology")):
        core, package = _read(topo, "core_id"), _read(topo, "physical_package_id")
        if core is not None and package is not None:
            cores.add((package.strip(), core.strip()))
    if not cores:
        cores = {(b["physical id"], b["core id"]) for b in blocks if "physical id" in b and "core id" in b}
    return (len(cores) if cores else n_logical), n_logical


def _meminfo(root: Path) -> tuple[int, int]:
    fields = {}
    for line in (_read(root, "proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        number = value.strip().split()
        if number and number[0].isdigit():
            fields[key.strip()] = int(number[0]) * 1024  # meminfo counts kB
    return fields.get("MemTotal", 0), fields.get("MemAvailable", fields.get("MemFree", 0))


def _nvidia_smi(root: Path) -> str | None:
    if not _is_live(root):
        return _read(root, ".edgepath/nvidia-smi.csv")
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, _NVIDIA_SMI_QUERY, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    return done.stdout


def _gpu(root: Path) -> tuple[str | None, int | None, str | None, bool]:
    """(name, memory bytes, compute capability, integrated?) of the first NVIDIA GPU."""
    name = mem = cc = None
    smi = _nvidia_smi(root)
    if smi and smi.strip():
        fields = [f.strip() for f in smi.strip().splitlines()[0].split(",")]
        name = fields[0]
        if len(fields) > 1 and fields[1].isdigit():
            mem = int(fields[1]) * 1024 * 1024  # nvidia-smi reports MiB
        if len(fields) > 2 and re.fullmatch(r"\d+\.\d+", fields[2]):
            cc = fields[2]
    if name is None:
        for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
            for line in info.read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    name = line.partition(":")[2].strip()
                    break
            if name:
                break
    compatible = _read(root, "proc/device-tree/compatible") or ""
    integrated = "nvidia,tegra" in compatible or (root / "etc/nv_tegra_release").exists()
    if integrated and name is None:
        name = "NVIDIA Tegra (integrated)"
    return name, mem, cc, integrated


def _npu(root: Path) -> tuple[str | None, str | None]:
    """(vendor, driver) of the first NPU that a driver or device node announces."""
    for uevent in sorted((root / "sys/class/accel").glob("accel[0-9]*/device/uevent")):
        for line in uevent.read_text(errors="replace").splitlines():
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
        recorded = _read(root, ".edgepath/torch_amx_tile_supported")
        return None if recorded is None else recorded.strip() == "true"
    try:
        import torch  # optional: the probe runs on devices without it
    except ImportError:
        return None
    return bool(torch.cpu._is_amx_tile_supported())


def probe(root: str | os.PathLike = "/", source: str | None = None) -> HardwareProfile:
    """Probe the device whose filesystem is mounted at ``root``."""
    root = Path(root)
    blocks = parse_cpuinfo(_read(root, "proc/cpuinfo") or "")
    arch = _arch(root, blocks)
    raw_flags = (blocks[0].get("flags") or blocks[0].get("features") or "").split() if blocks else []
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
        source = "probe: live host" if _is_live(root) else f"snapshot: {root.name}"
    return HardwareProfile(
        arch=arch, cpu_vendor=vendor, cpu_model=model, cpu_flags=flags,
        n_physical=n_physical, n_logical=n_logical, numa_nodes=numa,
        ram_total_bytes=ram_total, ram_available_bytes=ram_available,
        kernel_release=(_read(root, "proc/sys/kernel/osrelease") or "").strip(),
        accelerator=accelerator, gpu_name=gpu_name, gpu_mem_bytes=gpu_mem,
        gpu_compute_capability=gpu_cc, npu_driver=npu_driver,
        supports_bf16=supports_bf16, torch_amx_tile_supported=_torch_amx(root, arch),
        source=source,
    )


def capture_snapshot(dest: str | os.PathLike, root: str | os.PathLike = "/") -> Path:
    """Copy what the probe reads from ``root`` into ``dest`` (plus the outputs of
    the commands it runs), so the device can be probed again anywhere."""
    root, dest = Path(root), Path(dest)
    for pattern in SNAPSHOT_GLOBS:
        for src in sorted(root.glob(pattern)):
            if src.is_file():
                target = dest / src.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(src.read_bytes())
    for node in _FASTRPC_NODES:
        if (root / node).exists():
            (dest / node).parent.mkdir(parents=True, exist_ok=True)
            (dest / node).touch()
    blocks = parse_cpuinfo(_read(root, "proc/cpuinfo") or "")
    arch = _arch(root, blocks)
    recorded = {"uname-m": arch, "nvidia-smi.csv": _nvidia_smi(root)}
    amx = _torch_amx(root, arch)
    if amx is not None:
        recorded["torch_amx_tile_supported"] = "true" if amx else "false"
    (dest / ".edgepath").mkdir(parents=True, exist_ok=True)
    for name, text in recorded.items():
        if text:
            (dest / ".edgepath" / name).write_text(text.strip() + "\n")
    return dest


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from . import fleet, records

    if args.capture_snapshot:
        dest = capture_snapshot(args.capture_snapshot, root=args.root)
        print(f"probe: snapshot of {args.root} written to {dest}")
        return
    spec = args.profile
    if args.target:
        spec = fleet.load(args.params).target(args.target).profile
    if spec == fleet.PROBE:
        profile = probe(args.root, source=args.source)
    else:
        profile = HardwareProfile.from_dict(records.read(spec, "profile"))
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
