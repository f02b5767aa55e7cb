"""Select the weight path a device's fastest faithful kernel needs.

``select_weight_path(profile, priority, engine=...)`` is the whole decision, in
the order that matters (``coverage.device_class``): an accelerator decides first
(a GPU runs bf16 in vLLM; a phone gets an exported ExecuTorch program: QNN for a
Qualcomm NPU, XNNPACK for any other phone, its 4-bit or 8-bit program by the
priority and the programs' measured fidelity, ``PHONE_MIN_TOP1``), then the CPU's
ISA (AMX tiles, or AVX512-VNNI with vLLM's AVX512-BF16 kernel build, take vLLM's
W4A8 kernel, other CPUs its tinygemm W4A16), then the engine:

- ``engine`` is the target's wish (``ENGINES``): ``vllm``, ``llama.cpp`` (the
  ``q4_0-gguf`` build: a CPU's or a phone's CPU), ``executorch`` (a phone), or
  ``auto``, the default. An engine the device cannot run is refused.
- ``auto`` on a CPU compares vLLM's path with ``q4_0-gguf`` by what was measured
  (``weight_paths.TierDecode``, ``HeldOut``): for speed, the faster decode on the
  CPU's kernel ISA tier, as a ratio to llama.cpp Q4_K_M in the same run; for
  fidelity, the lower held-out perplexity increase. Where either was not measured
  it keeps vLLM's path and says so. A phone keeps its ExecuTorch program (no
  llama.cpp build was measured on a phone's CPU), a GPU vLLM.

Given the model (``memory.ModelShape``), the path must also fit: its resident need at
the target's context (weights, KV cache, the engine's own memory: ``rules.memory``)
against the device's RAM (a GPU's memory for a GPU build). A path that does not fit
gives way to the next of ``SMALLER`` that does, the first one's need cited; where none
fits the target is refused with every candidate's need and what the device has.

The paths themselves are the registry's (``weight_paths``); this module adds
what depends on the device: the group size for the model's shapes and the
rationale, a sentence about this device that cites the figures it was chosen by.
Whether a path is verified is not the selector's to say: the manifest takes it
from records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..core.errors import EdgepathError
from . import coverage, measurements, memory, weight_paths
from .coverage import DeviceClass
from .profile import HardwareProfile
from .weight_paths import Engine, HeldOut, TierDecode, WeightPathSpec

PRIORITIES = ("speed", "fidelity")
AUTO = "auto"
ENGINES = (AUTO, *(e.value for e in Engine))
# The engines edgepath builds for each kind of device, the one ``auto`` keeps first.
ENGINES_OF_DEVICE = {DeviceClass.GPU: (Engine.VLLM,), DeviceClass.PHONE: (Engine.EXECUTORCH, Engine.LLAMA_CPP),
                     DeviceClass.X86_CPU: (Engine.VLLM, Engine.LLAMA_CPP),
                     DeviceClass.ARM_CPU: (Engine.VLLM, Engine.LLAMA_CPP)}
GGUF_PATH = "q4_0-gguf"
# The run the W4A8 rationale cites: W4A8, tinygemm W4A16 and bf16 side by side on one host.
W4A8_RUN = "w4a8_vnni.json"
"""The build llama.cpp runs: a device that asks for llama.cpp, or that ``auto`` finds faster."""


@dataclasses.dataclass(frozen=True)
class WeightPath:
    """A registry path (``spec``) as selected for one device: its group size for the
    model's shapes, and why this device gets it."""

    spec: WeightPathSpec
    group_size: int | None
    rationale: str
    notes: tuple[str, ...] = ()
    memory: Mapping[str, Any] | None = None
    """Its resident need on the device against what the device has (``memory.record``);
    None where the model was not given."""

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
            "memory": dict(self.memory) if self.memory is not None else None,
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


def _phone_path(p: HardwareProfile, priority: str) -> WeightPath:
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
    name, how = _phone_cpu_program(priority)
    return _selected(name, (
        f"The device is a phone ({_cpu_desc(p)}, kernel {p.kernel_release}) that vLLM does not run on, "
        f"and {why}, so it gets an ExecuTorch program for its CPU (XNNPACK, int8 dynamic activations, a KV "
        f"cache and attention in ExecuTorch's LLM ops). {how}"
    ), None, notes)


PHONE_CPU_PROGRAMS = ("w4a8-xnnpack", "w8a8-xnnpack")
PHONE_MIN_TOP1 = 0.80
"""The fidelity floor of a phone CPU program chosen for speed: teacher-forced top-1
agreement with fp32 over the held-out genres (``weight_paths.ProgramFidelity``). The
goal the 4-bit program's GPTQ rebuild was set; the run that measured it beside the
program with round-to-nearest weights before it is ``measured/phone_xnnpack.json``
(its ``w4a8-xnnpack`` and ``baseline`` programs; benchmarks/results/phone.md)."""

RULES = f"""\
    In vLLM, x86 CPUs with AMX, or with AVX512-VNNI and AVX512-BF16, get
    w4a8-gptq (GPTQ, vLLM's int4 x int8 kernel) for speed; other x86 CPUs,
    priority 'fidelity' and Arm CPUs get w4a16-tinygemm; a phone gets an
    ExecuTorch export (w8a16-qnn with a Qualcomm NPU, otherwise w4a8-xnnpack
    for speed where its measured top-1 against fp32 reaches {PHONE_MIN_TOP1:.2f},
    w8a8-xnnpack for fidelity); CUDA GPUs run bf16 (fp16 without bf16). With
    --engine llama.cpp a CPU or a phone gets q4_0-gguf; with --engine auto (the
    default) a CPU gets whichever of its vLLM path and q4_0-gguf measured better
    for the priority on its CPU tier, the figures cited in the rationale."""
"""The rules above in a paragraph, for the select command's help."""


def _phone_cpu_program(priority: str) -> tuple[str, str]:
    """(path, the sentence that says why) of a phone CPU's program for ``priority``:
    for speed, the fastest measured program that passes ``PHONE_MIN_TOP1``, or the most
    faithful where none does; for fidelity, the most faithful."""
    measured = {name: weight_paths.get(name).program for name in PHONE_CPU_PROGRAMS}
    figures = "; ".join(f"{name}: {m}" for name, m in measured.items())
    faithful = max(measured, key=lambda n: measured[n].top1_vs_fp32)
    if priority == "fidelity":
        return faithful, f"For fidelity it gets the program that agreed most with fp32, as measured: {figures}."
    passing = [n for n, m in measured.items() if m.top1_vs_fp32 >= PHONE_MIN_TOP1]
    if not passing:
        return faithful, (f"No program reached top-1 {PHONE_MIN_TOP1:.2f} against fp32, so it gets the most "
                          f"faithful one, as measured: {figures}.")
    fastest = max(passing, key=lambda n: measured[n].decode_tok_s)
    return fastest, (f"For speed it gets the fastest program whose top-1 against fp32 reached "
                     f"{PHONE_MIN_TOP1:.2f}, as measured off-device: {figures}.")


def _w4a8_path(p: HardwareProfile, linears) -> WeightPath:
    amx = [f for f in ("amx_tile", "amx_bf16", "amx_int8") if p.has_flag(f)]
    if amx:
        how = (f"has AMX tiles ({', '.join(amx)}), which vLLM's int4 x int8 kernel (int4_scaled_mm_cpu) "
               f"computes on")
    else:
        how = ("has AVX512-VNNI and vLLM's AVX512-BF16 kernel build, whose int4 x int8 kernel "
               "(int4_scaled_mm_cpu) runs on VNNI once edgepath's vLLM plugin lifts vLLM's AMX gate (w4a8_vnni)")
    run = W4A8_RUN
    w4a8, w4a16, bf16 = (measurements.arm(run, name) for name in ("w4a8-gptq", "w4a16-tinygemm", "vllm bf16"))
    return _selected("w4a8-gptq", (
        f"The {_cpu_desc(p)} {how}, and the priority is speed, so it gets a symmetric 4-bit GPTQ checkpoint "
        f"that vLLM runs with 8-bit activations: on an AVX512-VNNI host it decoded "
        f"{w4a8['decode_tok_s']['median']:.1f} tok/s against tinygemm W4A16's {w4a16['decode_tok_s']['median']:.1f} "
        f"and bf16's {bf16['decode_tok_s']['median']:.1f}, and prefilled {w4a8['prefill_tok_s']['median']:.0f} "
        f"tok/s against tinygemm's {w4a16['prefill_tok_s']['median']:.0f} ({measurements.where(run)})"
        + ("; no AMX host's run is recorded yet." if amx else ".")
    ), linears)


def _w4a16_path(p: HardwareProfile, priority: str, linears) -> WeightPath:
    if p.arch == "aarch64":
        why = (f"The {_cpu_desc(p)} is an Arm CPU, so it gets 4-bit weights with bf16 activations; the "
               f"4-bit CPU GEMM takes a different kernel on Arm than the one measured on x86.")
    elif priority == "fidelity":
        why = (f"The priority for the {_cpu_desc(p)} is fidelity, so it gets 4-bit weights with bf16 "
               f"activations, which adds no 8-bit activation error at some cost in speed.")
    else:
        why = (f"The {_cpu_desc(p)} cannot run vLLM's int4 x int8 kernel ({coverage.w4a8_unsupported(p)}), so "
               f"it gets 4-bit weights with bf16 activations through tinygemm (_weight_int4pack_mm_for_cpu).")
    return _selected("w4a16-tinygemm", why, linears)


def _vllm_cpu_path(p: HardwareProfile, priority: str, linears) -> WeightPath:
    if coverage.device_class(p) is DeviceClass.X86_CPU and priority == "speed" and not coverage.w4a8_unsupported(p):
        return _w4a8_path(p, linears)
    return _w4a16_path(p, priority, linears)


def _gguf_path(p: HardwareProfile, linears, why: str) -> WeightPath:
    """``q4_0-gguf`` for ``p``, ``why`` being the reason its engine is llama.cpp."""
    return _selected(GGUF_PATH, (
        f"{why}, so the {_cpu_desc(p)} gets symmetric GPTQ at group 32 in llama.cpp's Q4_0 blocks (the key and "
        f"value projections and the embedding at Q8_0), run by llama.cpp's CPU kernels."
    ), linears)


def _with_note(path: WeightPath, note: str) -> WeightPath:
    return dataclasses.replace(path, notes=(*path.notes, note))


def _merit(figure: TierDecode | HeldOut) -> float:
    """Higher is better: decode as a ratio to llama.cpp Q4_K_M, or less perplexity lost."""
    return figure.vs_q4_k_m if isinstance(figure, TierDecode) else -figure.mean_increase_pct


def _measured_choice(p: HardwareProfile, priority: str, linears, vllm: WeightPath) -> WeightPath:
    """``engine: auto`` on a CPU: vLLM's path (``vllm``) or the GGUF, whichever measured
    better for ``priority`` (module docstring); vLLM's where either was not measured."""
    tier = p.kernel_isa()
    specs = (vllm.spec, weight_paths.get(GGUF_PATH))
    if priority == "speed":
        figures = {s.name: s.decode_on(tier) for s in specs}
        measure, where = f"decoded faster on its CPU tier ({tier})", f"on this CPU tier ({tier})"
    else:
        figures = {s.name: s.held_out for s in specs}
        measure, where = "lost less perplexity on the held-out genres", "on the held-out genres"
    missing = [name for name, figure in figures.items() if figure is None]
    if missing:
        return _with_note(vllm, (
            f"engine auto: {' and '.join(missing)} {'was' if len(missing) == 1 else 'were'} not measured {where}, "
            f"so it keeps vLLM's path; `engine: llama.cpp` in params.yaml gives it {GGUF_PATH}"))
    compared = f"{GGUF_PATH} {figures[GGUF_PATH]} against {vllm.name} {figures[vllm.name]}"
    if _merit(figures[vllm.name]) >= _merit(figures[GGUF_PATH]):
        return _with_note(vllm, f"engine auto: of the two engines' builds, {vllm.name} {measure}: {compared}")
    return _gguf_path(p, linears, (
        f"The target's engine is auto and its priority {priority}, and of the two engines' builds for its CPU, "
        f"llama.cpp's {measure}: {compared}"))


# What a device gets instead where its path does not fit, in order: the same engine's
# smaller build (the 4-bit phone program), else, where the target's engine is auto,
# llama.cpp's: its own memory beside the weights is a fraction of vLLM's
# (``memory.runtime_memory``), and it maps its weights instead of copying them.
SMALLER = {"w8a16-qnn": ("w4a8-xnnpack",), "w8a8-xnnpack": ("w4a8-xnnpack",),
           "w4a8-gptq": (GGUF_PATH,), "w4a16-tinygemm": (GGUF_PATH,)}


def _fitting(p: HardwareProfile, path: WeightPath, linears, engine: str, model: memory.ModelShape,
             context: int) -> WeightPath:
    """``path`` where it fits ``p``'s memory at ``context`` tokens, else the first of
    ``SMALLER`` that does (its rationale citing both needs); refused where none does."""
    have = memory.capacity(p)

    def need_of(candidate: WeightPath) -> memory.MemoryNeed:
        return memory.need(candidate.spec, candidate.group_size, model, context, p)

    first = need_of(path)
    if first.total <= have.bytes:
        return dataclasses.replace(path, memory=memory.record(first, have))
    tried = [f"{path.name} needs {first}"]
    for name in SMALLER.get(path.name, ()):
        if name == GGUF_PATH and engine != AUTO:
            tried.append(f"{GGUF_PATH} runs in llama.cpp, which the target's engine ({engine}) rules out")
            continue
        why = (f"{path.name}, its first choice, needs {first}, more than {have}, so it gets {name}, the next build "
               f"that fits")
        smaller = (_gguf_path(p, linears, f"{why}; its engine is auto") if name == GGUF_PATH
                   else _selected(name, f"{path.rationale} But {why}.", linears))
        found = need_of(smaller)
        if found.total <= have.bytes:
            return dataclasses.replace(smaller, memory=memory.record(found, have))
        tried.append(f"{name} needs {found}")
    raise EdgepathError(f"no build fits {have} at {context} tokens of context: {'; '.join(tried)}. A device with "
                        f"more memory, a shorter context (the target's context in params.yaml) or a smaller model "
                        f"would")


def engines_for(profile: HardwareProfile) -> tuple[str, ...]:
    """The ``engine`` settings a target on ``profile``'s device may have: ``auto`` and the
    engines edgepath builds for its kind of device."""
    return (AUTO, *(e.value for e in ENGINES_OF_DEVICE[coverage.device_class(profile)]))


def select_weight_path(
    profile: HardwareProfile,
    priority: str = "speed",
    linears: Mapping[str, tuple[int, int]] | None = None,
    engine: str = AUTO,
    model: memory.ModelShape | None = None,
    context: int = memory.DEFAULT_CONTEXT,
) -> WeightPath:
    """The weight path for ``profile``. ``linears`` (``{name: (out, in)}`` of the
    layers to quantize, see ``shapes.block_linears``) fixes the group size from
    the model's shapes; without it the kernel's preferred group size is used.
    ``engine``: one of ``ENGINES`` (module docstring). ``model``: the path must fit the
    device's memory at ``context`` tokens (module docstring); unchecked without it."""
    path = _preferred(profile, priority, linears, engine)
    return path if model is None else _fitting(profile, path, linears, engine, model, context)


def _preferred(profile: HardwareProfile, priority: str, linears, engine: str) -> WeightPath:
    """The path ``select_weight_path`` gives before memory is counted."""
    if priority not in PRIORITIES:
        raise EdgepathError(f"unknown priority {priority!r}; choose one of {', '.join(PRIORITIES)}")
    if engine not in ENGINES:
        raise EdgepathError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    device = coverage.device_class(profile)
    if engine not in engines_for(profile):
        raise EdgepathError(f"engine {engine!r}: edgepath builds nothing in it for a {device.value} device "
                            f"({_cpu_desc(profile)}); it can have {', '.join(engines_for(profile))}")
    if engine == Engine.LLAMA_CPP.value:
        tier = profile.kernel_isa()
        measured = weight_paths.get(GGUF_PATH).decode_on(tier)
        return _gguf_path(profile, linears, (
            f"The target asks for llama.cpp (engine: llama.cpp); on its CPU tier ({tier}) "
            + (f"this build decoded {measured}" if measured else "no build of it was measured yet")))
    if device is DeviceClass.GPU:
        return _gpu_path(profile)
    if device is DeviceClass.PHONE:
        phone = _phone_path(profile, priority)
        return phone if engine != AUTO else _with_note(phone, (
            f"engine auto: no llama.cpp build was measured on a phone's CPU, so it keeps the ExecuTorch program; "
            f"`engine: llama.cpp` in params.yaml gives it {GGUF_PATH}"))
    vllm = _vllm_cpu_path(profile, priority, linears)
    return vllm if engine != AUTO else _measured_choice(profile, priority, linears, vllm)
