"""XNNPACK 8da4w: a phone CPU's program, with a KV cache.

Layout the program computes (torchao's configs, as optimum-executorch's
``--qlinear 8da4w --qembedding 8w`` recipe applies them):

- every linear, the output head included: symmetric int4 weights in groups of
  ``group_size`` along the input dimension with one bf16 scale per group, and
  int8 activations quantized per token at run time, asymmetric
  (``Int8DynamicActivationIntxWeightConfig``); XNNPACK packs the nibbles and runs
  its qd8-f32-qb4w GEMM, which takes its group scales in bf16 (ExecuTorch's
  serializer casts them), so ``quantize`` rounds them to bf16 too and the eager
  model holds the weights the kernel holds;
- the embedding table: int8 per row with one scale per row (``IntxWeightOnlyConfig``);
  a tied table is untied (the head takes its own 4-bit copy);
- norms, rotary embedding and attention in fp32.

Lifecycle: ``quantize`` the fp32 model in place (the same module is the eager
reference the program is checked against); ``export`` it through transformers'
static-cache wrapper (``forward(input_ids [1, 1], cache_position [1])``, the KV
cache a mutable buffer of ``max_seq_len`` positions), lower every supported
partition to XNNPACK and serialize the ``.pte``. ``engines.executorch_runtime``
runs it.
"""

from __future__ import annotations

import torch


def quantize(model, group_size: int) -> None:
    """Quantize ``model`` in place (module docstring); the hidden and MLP widths must be
    multiples of ``group_size``."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    widths = {m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert all(w % group_size == 0 for w in widths), (widths, group_size)
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              lambda module, _: isinstance(module, torch.nn.Embedding))
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                           weight_granularity=PerGroup(group_size)))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            scale = module.weight.scale
            scale.copy_(scale.to(torch.bfloat16).to(scale.dtype))


@torch.no_grad()
def export(model, max_seq_len: int) -> bytes:
    """The ``.pte`` bytes of ``model`` (already ``quantize``d) with a ``max_seq_len`` KV cache."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            # padding_idx only shapes training gradients; left in, the lookup does not match
            # the quantized-embedding pattern quant fusion replaces (a torchao dequantize
            # then remains, which ExecuTorch has no kernel for)
            module.padding_idx = None
    model.generation_config = GenerationConfig(
        use_cache=True, cache_implementation="static", max_length=max_seq_len,
        cache_config={"batch_size": 1, "max_cache_len": max_seq_len})
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_seq_len)
    program = wrapper.export(input_ids=torch.tensor([[0]], dtype=torch.long),
                             cache_position=torch.tensor([0], dtype=torch.long))
    # IR validity is off as in ExecuTorch's own LLM export: torchao's quantize/dequantize
    # ops are not core ATen, and XNNPACK consumes them before serialization
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    # quant fusion turns the int8 table's dequantize + lookup into ExecuTorch's
    # quantized_decomposed::embedding_byte; the inputs are the caller's, not planned
    config = ExecutorchBackendConfig(extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
                                     memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
    return edge.to_executorch(config).buffer
