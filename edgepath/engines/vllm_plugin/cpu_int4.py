"""vLLM quantization method ``cpu_int4``: 4-bit weights, bf16 activations, tinygemm.

Lifecycle, per linear layer (and the output head when ``lm_head: true``):

1. ``CpuInt4Config.from_config`` reads ``quantization_config`` from the
   checkpoint's ``config.json`` (``edgepath.formats.cpu_int4_format`` documents the
   format) and refuses a format version, bit width or group size it cannot run.
2. ``CpuInt4LinearMethod.create_weights`` checks the layer's shape against
   tinygemm's rules (output size a multiple of 16, input size a multiple of the
   group, a group of 32/64/128/256), naming the layer when it does not fit, and
   declares ``qweight`` / ``scales`` / ``offsets`` in the file's own layout, so
   vLLM's loaders fill fused layers (qkv, gate/up) shard by shard.
3. ``process_weights_after_loading`` repacks them once into tinygemm's CPU tiles
   and its ``[K/g, N, 2]`` scale-and-zero tensor.
4. ``apply`` runs ``edgepath::int4_mm`` (``ops.py``) on bf16 activations.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from ...formats import cpu_int4_format as fmt
from . import ops  # noqa: F401  registers edgepath::int4_mm

KERNEL_OP = "edgepath::int4_mm"


@register_quantization_config(fmt.QUANT_METHOD)
class CpuInt4Config(QuantizationConfig):
    """``quantization_config`` of a cpu_int4 checkpoint."""

    def __init__(self, group_size: int, lm_head: bool) -> None:
        super().__init__()
        self.group_size = group_size
        self.lm_head = lm_head

    def __repr__(self) -> str:
        return f"CpuInt4Config(group_size={self.group_size}, lm_head={self.lm_head})"

    def get_name(self) -> str:
        return fmt.QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # a CPU kernel: no GPU capability applies

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # read from config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CpuInt4Config":
        method, bits = config.get("quant_method"), config.get("bits")
        version, group = config.get("format_version"), config.get("group_size")
        if method != fmt.QUANT_METHOD or bits != fmt.BITS:
            raise ValueError(f"cpu_int4: quantization_config has quant_method {method!r}, bits {bits!r}; "
                             f"expected {fmt.QUANT_METHOD!r}, {fmt.BITS}")
        if version != fmt.FORMAT_VERSION:
            raise ValueError(f"cpu_int4: format_version {version!r}; this edgepath reads version "
                             f"{fmt.FORMAT_VERSION} (re-run edgepath quantize)")
        if group not in fmt.GROUP_SIZES:
            raise ValueError(f"cpu_int4: group_size {group!r}; tinygemm takes {list(fmt.GROUP_SIZES)}")
        return cls(group, bool(config.get("lm_head", False)))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, ParallelLMHead):
            return CpuInt4LinearMethod(self) if self.lm_head else UnquantizedEmbeddingMethod()
        if isinstance(layer, LinearBase):
            return CpuInt4LinearMethod(self)
        return None


class CpuInt4LinearMethod(LinearMethodBase):
    """One cpu_int4 layer on tinygemm. After loading, the layer holds ``qweight``
    (uint8 ``[N, K/2]`` in tinygemm's CPU tile order) and ``scale_and_zero``
    (bf16 ``[K/g, N, 2]``)."""

    kernel_op = KERNEL_OP
    """What ``engine_check`` reads off a layer: the operator its GEMM runs."""

    def __init__(self, config: CpuInt4Config) -> None:
        self.config = config

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        n, k, g = sum(output_partition_sizes), input_size_per_partition, self.config.group_size
        name = getattr(layer, "prefix", "") or type(layer).__name__
        if k % g or n % fmt.N_MULTIPLE or any(p % fmt.N_MULTIPLE for p in output_partition_sizes):
            raise ValueError(
                f"cpu_int4: layer {name} has shape [out {output_partition_sizes}, in {k}]; tinygemm needs "
                f"every output size a multiple of {fmt.N_MULTIPLE} and the input size a multiple of the "
                f"group size {g}")
        weight_loader = extra_weight_attrs.get("weight_loader")
        qweight = PackedvLLMParameter(data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
                                      packed_dim=1, packed_factor=2, weight_loader=weight_loader)
        layer.register_parameter("qweight", qweight)
        for tensor in ("scales", "offsets"):
            param = GroupQuantScaleParameter(data=torch.empty(n, k // g, dtype=torch.bfloat16), input_dim=1,
                                             output_dim=0, weight_loader=weight_loader)
            layer.register_parameter(tensor, param)
        layer.cpu_int4_group_size = g
        layer.cpu_int4_out_features = n

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        stored = fmt.CpuInt4(layer.qweight.data, layer.scales.data, layer.offsets.data)
        stored.check(getattr(layer, "prefix", "") or type(layer).__name__)
        packed, scale_and_zero = stored.tinygemm_operands()
        layer.qweight = torch.nn.Parameter(packed, requires_grad=False)
        layer.scale_and_zero = torch.nn.Parameter(scale_and_zero, requires_grad=False)
        del layer.scales, layer.offsets

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.edgepath.int4_mm(rows, layer.qweight, layer.cpu_int4_group_size, layer.scale_and_zero)
        out = out.reshape(*x.shape[:-1], layer.cpu_int4_out_features)
        return out if bias is None else out + bias
