"""Check a 4-bit checkpoint in the real engine against two references.

A checkpoint written in the wrong convention still loads and still writes
fluent text; only a comparison with the same weights computed another way
catches it. ``check`` loads the checkpoint in vLLM (``engines.vllm_cpu``),
records which kernel the quantized layers ran (the layers' ``use_w4a8`` and
the profiler's operator names), and compares the engine's next-token
predictions, teacher-forced on held-out text, with

(a) ``reference``: PyTorch with the checkpoint's weights dequantized from the
    file by ``GptqV1Int4`` (same weights, exact arithmetic), and
(b) ``bf16``: the unquantized model,

plus greedy continuations of the fixed prompts against both.

Pass criterion: top-1 agreement with (a) at or above ``TOP1_THRESHOLD`` of the
activation mode. The W4A8 kernel quantizes activations to int8 per token, so
bit equality is not expected: with its own dequantized weights it agrees on
82-86 % of positions (BRIEF §7), W4A16 at the bf16 noise floor (96-97 %). A
convention mistake (nibble order, zero point, scale layout) leaves the engine
computing other weights and agreement falls far below either (measured by
tests/test_quantize_e2e.py on a checkpoint with its nibbles reordered).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

from .errors import EdgepathError

CHECK_NAME = "engine_check.json"
# Teacher-forced text: 8 x 128 held-out tokens (1016 scored positions) put the W4A8
# agreement at 0.86 on SmolLM2 (measured here), well clear of the threshold.
CHECK_WINDOWS, CHECK_LENGTH = 8, 128
# Thresholds sit below the measured ranges with margin for the text used.
TOP1_THRESHOLD = {"w4a8": 0.75, "w4a16": 0.90}
W4A8_OP = "_C::int4_scaled_mm_cpu"
W4A16_OP = "_C::cpu_gemm_wna16"


def check_sequences(tokenizer, corpus) -> list[list[int]]:
    """The held-out token windows the check is teacher-forced on."""
    from .quant.calibration import evaluation_set

    return evaluation_set(tokenizer, corpus, CHECK_WINDOWS, CHECK_LENGTH).tolist()


def dequantized_reference(checkpoint: Path, base_model: Path):
    """The base model (fp32) with every quantized layer replaced by the checkpoint's
    dequantized weights, read from the checkpoint's own tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from .quant.gptq_format import GptqV1Int4

    tensors = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(f))
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32, local_files_only=True).eval()
    prefixes = sorted({n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")})
    if not prefixes:
        raise EdgepathError(f"{checkpoint}: no GPTQ layers (qweight tensors) in the checkpoint")
    for prefix in prefixes:
        module = model.get_submodule(prefix)
        weight = GptqV1Int4.from_tensors(tensors, prefix).dequantize()
        if module.weight.shape != weight.shape:
            raise EdgepathError(f"{checkpoint}: {prefix} is {tuple(weight.shape)}, the model's is "
                                f"{tuple(module.weight.shape)}")
        if prefix == "lm_head" and module.weight is model.get_input_embeddings().weight:
            module.weight = torch.nn.Parameter(weight)
        else:
            module.weight.data = weight
    return model


def _agreement(engine: list[list[int]], reference: list[list[int]]) -> float:
    pairs = [(a, b) for e, r in zip(engine, reference) for a, b in zip(e, r)]
    return sum(a == b for a, b in pairs) / len(pairs)


def _greedy_summary(engine: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    from .quant.evaluate import common_prefix

    prefixes = [common_prefix(e, r) for e, r in zip(engine, reference)]
    return {"identical": sum(p == len(r) for p, r in zip(prefixes, reference)),
            "prompts": len(reference), "mean_identical_leading_tokens": sum(prefixes) / len(prefixes)}


def check(checkpoint: str | Path, base_model: str | Path, sequences: list[list[int]], w4a8: bool,
          new_tokens: int = 64, reference_checkpoint: str | Path | None = None) -> dict[str, Any]:
    """The engine check record (module docstring); ``passed`` says whether (a) holds.
    ``reference_checkpoint``: take (a)'s weights from another file than the one the
    engine loads (how a test poses as a writer whose convention the kernel does not share)."""
    import torch

    from .engines.vllm_cpu import VllmCpu
    from .prompts import fixed_prompt_ids
    from .quant.evaluate import greedy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, base_model = Path(checkpoint), Path(base_model)
    method = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["quant_method"]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    prompts = fixed_prompt_ids(tokenizer)

    engine = VllmCpu(str(checkpoint), quantization=method, w4a8=w4a8)
    gate_lifted = engine.w4a8_gate_lifted
    modes = engine.layer_modes()
    ops = engine.profiled_ops(prompts[:1], 4)
    engine_top1 = engine.teacher_forced_top1(sequences)
    engine_greedy = engine.greedy(prompts, new_tokens)
    del engine

    with torch.no_grad():
        references = {"dequantized": dequantized_reference(Path(reference_checkpoint or checkpoint), base_model),
                      "bf16": AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.bfloat16,
                                                                   local_files_only=True).eval()}
        comparisons = {}
        for name, model in references.items():
            top1 = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0, :-1].argmax(-1).tolist()
                    for s in sequences]
            comparisons[name] = {
                "teacher_forced_top1_agreement": round(_agreement(engine_top1, top1), 4),
                "greedy": _greedy_summary(engine_greedy, [greedy(model, p, new_tokens) for p in prompts]),
            }
    mode = "w4a8" if w4a8 else "w4a16"
    kernel_op = W4A8_OP if w4a8 else W4A16_OP
    ran_kernel = kernel_op in ops and all(m["use_w4a8"] == w4a8 for m in modes)
    agreement = comparisons["dequantized"]["teacher_forced_top1_agreement"]
    return {
        "engine": f"vllm-cpu {importlib.metadata.version('vllm-cpu')}",
        "activation_mode": mode,
        "env": {"VLLM_CPU_INT4_W4A8": "1" if w4a8 else "0"},
        "w4a8_gate_lifted": engine_gate_note(gate_lifted),
        "layer_modes": modes,
        "kernel_op": kernel_op,
        "ops_seen": sorted(op for op in ops if op.startswith("_C::")),
        "ran_kernel": ran_kernel,
        "teacher_forced_positions": sum(len(s) - 1 for s in sequences),
        "greedy_new_tokens": new_tokens,
        "against": comparisons,
        "threshold": {"teacher_forced_top1_vs_dequantized": TOP1_THRESHOLD[mode]},
        "passed": ran_kernel and agreement >= TOP1_THRESHOLD[mode],
    }


def engine_gate_note(lifted: bool) -> str | None:
    if not lifted:
        return None
    return ("this host has no AMX: vLLM's W4A8 gate was lifted for the GPTQ layers only, and "
            "_C::int4_scaled_mm_cpu ran on AVX512-VNNI (edgepath.engines.vllm_cpu)")
