"""Select the weight path a device's fastest faithful kernel needs.

``select_weight_path(profile, priority)`` is the whole decision, in the order
that matters (``coverage.device_class``): an accelerator decides first (a GPU
runs bf16; a phone gets an exported ExecuTorch program: QNN for a Qualcomm NPU,
XNNPACK for any other phone), then the CPU's ISA (AMX tiles take the W4A8
kernel). The paths themselves are the registry's (``weight_paths``); this
module adds what depends on the device: the group size for the model's shapes
and the rationale, a sentence about this device. Whether a path is verified
is not the selector's to say: the manifest takes it from records.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from . import coverage, weight_paths
from .command import Command
from .coverage import DeviceClass
from .errors import EdgepathError
from .profile import HardwareProfile
from .weight_paths import Engine, WeightPathSpec

PRIORITIES = ("speed", "fidelity")


@dataclasses.dataclass(frozen=True)
class WeightPath:
    """A registry path (``spec``) as selected for one device: its group size for the
    model's shapes, and why this device gets it."""

    spec: WeightPathSpec
    group_size: int | None
    rationale: str
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def bits_per_weight(self) -> float:
        return self.spec.bits_per_weight(self.group_size)

    def as_engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM(...)``; ``{}`` where the path is not vLLM."""
        return dict(self.spec.engine_kwargs) if self.spec.engine is Engine.VLLM else {}

    def as_engine_env(self) -> dict[str, str]:
        return dict(self.spec.engine_env)

    def to_dict(self) -> dict[str, Any]:
        """The selection record's ``path``."""
        s = self.spec
        return {
            "name": s.name, "engine": s.engine.value, "built_by": s.built_by.value,
            "quantization": s.quantization, "group_size": self.group_size,
            "bits_per_weight": self.bits_per_weight, "runs_in_vllm": s.engine is Engine.VLLM,
            "fused_cpu_norms": s.fused_cpu_norms, "rationale": self.rationale,
            "build_with": f"{s.built_by.value} ({s.summary})", "notes": list(self.notes),
            "engine_kwargs": self.as_engine_kwargs(), "engine_env": self.as_engine_env(),
            "activations": s.activations, "dtype": s.dtype, "fallback": s.fallback,
            "evidence": [str(e) for e in s.evidence],
        }


def _selected(name: str, rationale: str, linears: Mapping[str, tuple[int, int]] | None,
              notes: tuple[str, ...] = ()) -> WeightPath:
    spec = weight_paths.get(name)
    group, group_why = spec.group_size(linears)
    return WeightPath(spec, group, rationale, tuple(n for n in (group_why, *spec.notes, *notes) if n))


def _cpu_desc(p: HardwareProfile) -> str:
    return f"{p.arch} CPU {p.cpu_model!r}" if p.cpu_model else f"{p.arch} CPU"


def _gpu_path(p: HardwareProfile) -> WeightPath:
    name = "bf16" if p.supports_bf16 else "fp16"
    why_dtype = (
        "it computes bf16 natively" if p.supports_bf16
        else "it lacks native bf16 (compute capability below 8.0), so fp16 keeps the tensor cores"
    )
    return _selected(name, (
        f"The device has a CUDA GPU ({p.gpu_name or 'unnamed'}, {p.accelerator}), and edgepath's "
        f"4-bit weight paths target CPU kernels, so it runs the unquantized model in {name}: {why_dtype}."
    ), None)


def _phone_path(p: HardwareProfile) -> WeightPath:
    if coverage.qnn_npu_usable(p):
        driver = f"driver {p.npu_driver}" if p.npu_driver else "no driver information in its profile"
        return _selected("w8a16-qnn", (
            f"The device's accelerator is an NPU ({p.accelerator.partition(':')[2]}, {driver}) that vLLM has "
            f"no backend for and Qualcomm's QNN can target, so it gets an ExecuTorch program for QNN with "
            f"8-bit per-channel weights and 16-bit integer activations (w8a16), the precision that stayed "
            f"faithful on a phone NPU."
        ), None)
    notes: tuple[str, ...] = ()
    if p.accelerator == coverage.QNN_NPU:
        why = "the probe found no driver for its Qualcomm NPU, so edgepath's QNN program could not run there"
        notes = ("a QNN program would need the NPU's FastRPC driver, which the probe did not find; "
                 "with it the device gets the calibrated w8a16-qnn export",)
    elif p.accelerator.startswith("npu:"):
        why = (f"its NPU ({p.accelerator}, driver {p.npu_driver or 'none'}) is not one edgepath's QNN "
               f"export can be lowered for")
    else:
        why = "it has no NPU"
    return _selected("w4a8-xnnpack", (
        f"The device is a phone ({_cpu_desc(p)}, kernel {p.kernel_release}) that vLLM does not run on, "
        f"and {why}, so it gets an ExecuTorch program for its CPU: XNNPACK with 4-bit weights, 8-bit "
        f"dynamic activations and an 8-bit embedding, with a KV cache."
    ), None, notes)


def _w4a8_path(p: HardwareProfile, linears) -> WeightPath:
    amx = [f for f in ("amx_tile", "amx_bf16", "amx_int8") if p.has_flag(f)]
    return _selected("w4a8-amx", (
        f"The {_cpu_desc(p)} has AMX tiles ({', '.join(amx)}) and the priority is speed, so it gets a "
        f"symmetric 4-bit GPTQ checkpoint that vLLM runs through its int4 x int8 AMX kernel "
        f"(int4_scaled_mm_cpu): 4-bit weights with 8-bit activations, the fastest CPU decode measured "
        f"(59-64 tok/s against 31 for bf16 on 2 cores)."
    ), linears)


def _w4a16_path(p: HardwareProfile, priority: str, linears) -> WeightPath:
    if p.arch == "aarch64":
        why = (f"The {_cpu_desc(p)} is an Arm CPU, so it gets 4-bit weights with bf16 activations; the "
               f"4-bit CPU GEMM takes a different kernel on Arm than the one measured on x86.")
    elif priority == "fidelity":
        why = (f"The priority for the {_cpu_desc(p)} is fidelity, so it gets 4-bit weights with bf16 "
               f"activations, which adds no 8-bit activation error at some cost in speed.")
    else:
        why = (f"The {_cpu_desc(p)} has no AMX tiles for the int4 x int8 kernel, so it gets 4-bit weights "
               f"with bf16 activations through tinygemm (_weight_int4pack_mm_for_cpu).")
    return _selected("w4a16-tinygemm", why, linears)


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
    device = coverage.device_class(profile)
    if device is DeviceClass.GPU:
        return _gpu_path(profile)
    if device is DeviceClass.PHONE:
        return _phone_path(profile)
    if device is DeviceClass.X86_CPU and priority == "speed" and coverage.has_amx(profile):
        return _w4a8_path(profile, linears)
    return _w4a16_path(profile, priority, linears)


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


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from . import files, fleet, records, shapes

    tag, priority, platform = args.tag, args.priority, args.platform
    if args.target:
        target = fleet.load(args.params).target(args.target)
        tag, priority, platform = target.tag, target.priority, target.platform
    profile = HardwareProfile.from_dict(records.read(files.path_of(args.profile, "--profile"), "profile"))
    linears, fingerprint = None, None
    if args.model is not None:
        model_record = records.read(files.path_of(args.model, "--model"), "model")
        linears = shapes.block_linears({n: t["shape"] for n, t in model_record["tensors"].items()})
        fingerprint = model_record["fingerprint"]
    path = select_weight_path(profile, priority, linears=linears)
    chosen = path.to_dict()
    platform = fleet.Target(tag, "", priority, platform).resolve_platform(profile)
    fleet.check_platform(tag, platform, chosen, profile)
    if args.out is not None and fingerprint is None:
        raise EdgepathError("select --out writes a selection record, which needs --model")
    if args.out is not None:
        record = selection_record(tag, priority, platform, profile, fingerprint, path)
        records.write(args.out, "selection", record)
        print(f"select@{tag}: {path.name} ({chosen['quantization'] or 'no vLLM quantization'}"
              f"{f', group {path.group_size}' if path.group_size else ''}) -> {args.out}")
    else:
        sys.stdout.write(records.dumps(chosen))


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="profile record (from `edgepath probe`)")
    p.add_argument("--priority", default="speed", help="speed (default) or fidelity")
    p.add_argument("--platform", default="auto", help="container platform (default: from the profile)")
    p.add_argument("--tag", default="device", help="device tag recorded in the selection")
    p.add_argument("--target", help="take tag, priority and platform from this target in the params file")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--model", help="model record (from `edgepath model`)")
    p.add_argument("--out", help="write the selection record here (default: print the path)")


COMMAND = Command("select", "choose a device's weight path", """\
    Choose the weight path for a device profile, with the reason.

    AMX x86 CPUs get w4a8-amx (GPTQ, vLLM's int4 x int8 kernel) for speed;
    other x86 CPUs, priority 'fidelity' and Arm CPUs get w4a16-tinygemm
    (Arm flagged unverified); a phone gets an ExecuTorch export (w8a16-qnn with
    a Qualcomm NPU, w4a8-xnnpack otherwise); CUDA GPUs
    run bf16 (fp16 without bf16). --model fixes the group size from the
    model's layer shapes; --out writes the selection record the manifest reads.

    examples: edgepath select --profile profiles/x86-avx2.json
              edgepath select --target host --profile build/profiles/host.json \\
                  --model build/model/model.json --out build/selections/host.json""", _arguments, _cmd)
