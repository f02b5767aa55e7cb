"""The plugin's custom operators, opaque to vLLM's compiler (PyTorch only; no vLLM import).

``edgepath::int4_mm``: ``x [M, K] bf16 @ W.T`` for a cpu_int4 layer held as
tinygemm operands (``CpuInt4.tinygemm_operands``), through
``aten._weight_int4pack_mm_for_cpu`` at every M. Measured here
(``benchmarks/plugin.py --only gemm``, ``benchmarks/results/plugin.md``):
from 4 rows up to a 512-token prefill, tinygemm beat even a bf16 GEMM on a
weight dequantized for free on this host, so there is no prefill branch. Registered as one custom op so that Dynamo sees a single call
with a fixed output shape, never the kernel's insides or a guard on M.

``edgepath::head_gate``: ``x [M, K] @ W.T`` for a tiny per-head gate
projection (``W [n_heads, K]``, n_heads of 8-64): an eager multiply-and-sum
for decode-sized M, which skips the GEMM's thread fan-out (reported elsewhere,
not measured here: 2.6x cheaper than vLLM's oneDNN GEMM for an 8 x 2048 gate on
an AMX Xeon); ``F.linear`` above
``HEAD_GATE_MAX_ROWS``. Opaque so the compiler cannot inline it back into a
GEMM (inlined, it made the step 1.8x slower in the reported build).
"""

from __future__ import annotations

import torch

# Decode-sized batches, where the reported gain was measured. Above it the reduction's
# [M, heads, K] intermediate grows with M (measured here, benchmarks/plugin.py --only
# head-gate: 21x slower than F.linear at 64 rows of a 32 x 4096 gate).
HEAD_GATE_MAX_ROWS = 4


@torch.library.custom_op("edgepath::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zero)


@int4_mm.register_fake
def _int4_mm_shape(x, packed, group_size, scale_and_zero):
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.custom_op("edgepath::head_gate", mutates_args=())
def head_gate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.shape[0] > HEAD_GATE_MAX_ROWS:
        return torch.nn.functional.linear(x, weight)
    return (x.unsqueeze(1) * weight.unsqueeze(0)).sum(dim=-1, dtype=torch.float32).to(x.dtype)


@head_gate.register_fake
def _head_gate_shape(x, weight):
    return x.new_empty(x.shape[0], weight.shape[0])
