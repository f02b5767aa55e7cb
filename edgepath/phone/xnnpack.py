"""XNNPACK programs for a phone's CPU: GPTQ's 4-bit weights or 8-bit ones, with
ExecuTorch's LLM ops.

Weights, as torchao's ``IntxUnpackedToInt8Tensor``s, which XNNPACK's partitioner
turns into its dynamically quantized GEMMs; two recipes:

- ``quantize_8da4w`` (``w4a8-xnnpack``): the decoder's linears but the key and
  value projections (``EIGHT_BIT_LINEARS``) in symmetric int4, groups of 32 along
  the input, one scale per group (XNNPACK's qd8-f32-qb4w), made by GPTQ with the
  quantize stage's per-group scale search on that grid (``quant.sequential``):
  ``qdata = code - 8``, ``scale`` GPTQ's, zero point 0. XNNPACK stores group scales
  in bf16 (ExecuTorch's serializer casts them) and refuses scales that are not
  positive (the program fails to load: ``xnn_status_invalid_parameter``): GPTQ's
  scales are exact in bf16 (``quant.gptq.representable_scales``) and its sign search
  is off, which ``load_4bit`` asserts, so the program holds GPTQ's weights bit for
  bit. The key and value projections and the output head: int8 per output channel
  (qd8-f32-qc8w), rounded by torchao; XNNPACK has no grouped 8-bit kernel (its
  node visitor: "Only 4-bit per channel group quantization is supported"). The
  head at 4 bits cost the most of any single part: alone, top-1 against fp32 0.764
  at 4 bits (round to nearest), 0.932 at 8 (benchmarks/results/phone.md);
- ``quantize_8da8w`` (``w8a8-xnnpack``): every linear int8 per output channel,
  rounded by torchao (at 8 bits rounding to nearest needs no calibration);

and in both: the activations of every linear int8 per token, asymmetric, at run
time; the embedding table int8 per row (untied from the head); norms, rotary
embedding and attention in fp32.

Program (``CustomOpsDecoder``): ``forward(tokens [1, S] int64, input_pos [1] int64)
-> logits [1, 1, vocab]`` of the last of the S tokens, which sit at positions
``input_pos .. input_pos + S - 1``; S is dynamic (1 .. ``max_seq_len`` - 1), so a
prompt is prefilled in one call and decoding feeds S = 1. Per layer the KV cache is
two fp32 buffers ``[1, max_seq_len, kv_heads, head_dim]`` that ExecuTorch's
``llama::update_cache`` writes at ``input_pos``, and attention is
``llama::custom_sdpa`` over positions ``0 .. input_pos + S - 1`` only, causal, in
ExecuTorch's optimized CPU kernel (grouped-query heads natively): what
optimum-executorch's ``--use_custom_sdpa --use_custom_kv_cache`` do, in place of
attention over the whole static cache in portable kernels. The decoder is the Llama
family's (``quant.sequential.check_architecture``); the eager model the program is
checked against is the same quantized module run by transformers.

Lifecycle: quantize the fp32 model in place with one recipe; ``export`` it: the
decoder above, ``torch.export`` with the dynamic token dimension, every supported
partition lowered to XNNPACK, serialized as a ``.pte``. ``engines.executorch_runtime``
runs it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..quant.gptq import ZERO, QuantizedLayer
from ..rules.weight_paths import XNNPACK_GROUP_SIZE as GROUP_SIZE

EIGHT_BIT_LINEARS = ("self_attn.k_proj", "self_attn.v_proj")
"""The decoder linears ``quantize_8da4w`` keeps at 8 bits, as the GGUF path keeps them
at Q8_0: 6 % of SmolLM2-135M's decoder weights, they took that path's held-out
perplexity increase from +6.96 % to +3.96 % (benchmarks/results/gguf_mix.md)."""


def quantize_8bit(model, leave_for_4bit: bool) -> list[str]:
    """The embedding table int8 per row (untied from the head), and the linears int8
    per channel with int8 activations, in place: every linear, or with
    ``leave_for_4bit`` the head and ``EIGHT_BIT_LINEARS`` only. Returns the prefixes
    of the linears left unquantized."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:  # the table stays for lookups, int8 per row
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    head_name = next(name for name, m in model.named_modules() if m is head)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    eight_bit = {n for n in linears if not leave_for_4bit or n == head_name or n.endswith(EIGHT_BIT_LINEARS)}
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              lambda module, _: isinstance(module, torch.nn.Embedding))
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              lambda module, fqn: fqn in eight_bit)
    return sorted(set(linears) - eight_bit)


def quantize_8da8w(model) -> None:
    """The ``w8a8-xnnpack`` recipe (module docstring), in place."""
    quantize_8bit(model, leave_for_4bit=False)


def quantize_8da4w(model, hessian_of, search: str, damp: float, group_order: bool) -> dict[str, QuantizedLayer]:
    """The ``w4a8-xnnpack`` recipe (module docstring), in place: the 8-bit parts first,
    then GPTQ on the 4-bit linears from the calibrate stage's Hessians (``hessian_of``:
    ``quant.sequential.quantize_from_hessians``) with the quantize stage's ``search``,
    ``damp`` and ``group_order`` (``quantize.gptq``) on XNNPACK's positive-scale grid;
    then GPTQ's layers loaded (``load_4bit``). Returns GPTQ's layers by prefix."""
    import dataclasses

    from ..quant.gptq import grid
    from ..quant.sequential import GptqPlan, quantize_from_hessians

    four_bit = quantize_8bit(model, leave_for_4bit=True)
    positive = dataclasses.replace(grid(True, search), signed=False)  # XNNPACK takes positive scales only
    eight_bit = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in four_bit]
    layers = quantize_from_hessians(model, hessian_of, GptqPlan(GROUP_SIZE, positive, damp, group_order,
                                                                keep=eight_bit))
    load_4bit(model, layers)
    return layers


def load_4bit(model, layers: Mapping[str, QuantizedLayer]) -> None:
    """The linears of ``layers`` (prefix -> GPTQ's result on the symmetric grid at
    ``GROUP_SIZE``, scales positive) as torchao's 8da4w tensors holding GPTQ's codes
    and scales unchanged, in place."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    for prefix, q in layers.items():
        assert q.group_size == GROUP_SIZE and q.offsets is None, f"{prefix}: not the symmetric grid at {GROUP_SIZE}"
        assert bool((q.scales > 0).all()), f"{prefix}: a scale is not positive (XNNPACK refuses it)"
        assert torch.equal(q.scales.to(torch.bfloat16).float(), q.scales), f"{prefix}: a scale is not exact in bf16"
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                           weight_granularity=PerGroup(GROUP_SIZE)),
              lambda module, fqn: fqn in layers)
    for prefix, q in layers.items():
        weight = model.get_submodule(prefix).weight
        assert tuple(weight.qdata.shape) == tuple(q.codes.shape), (prefix, weight.qdata.shape, q.codes.shape)
        weight.qdata.copy_((q.codes - ZERO).to(torch.int8))
        weight.scale.copy_(q.scales)
        weight.zero_point.zero_()


class CustomOpsDecoder(torch.nn.Module):
    """The exported program's ``forward`` (module docstring) over a Llama-family
    ``model``'s own modules, with ``max_seq_len`` positions of KV cache."""

    def __init__(self, model, max_seq_len: int) -> None:
        super().__init__()
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers llama::*)

        from ..quant.sequential import check_architecture

        check_architecture(model)  # forward below is the Llama family's decoder layer
        self.model, self.max_seq_len = model, max_seq_len
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (1, max_seq_len, config.num_key_value_heads, self.head_dim)
        for i in range(config.num_hidden_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        decoder = self.model.model
        length = tokens.shape[1]
        start = input_pos[0].item()
        torch._check_is_size(start)
        torch._check(start + length <= self.max_seq_len)
        x = decoder.embed_tokens(tokens)
        cos, sin = decoder.rotary_emb(x, (torch.arange(length) + input_pos)[None])
        for i, layer in enumerate(decoder.layers):
            attention = layer.self_attn
            h = layer.input_layernorm(x)
            q = attention.q_proj(h).view(1, length, -1, self.head_dim)
            k = attention.k_proj(h).view(1, length, -1, self.head_dim)
            v = attention.v_proj(h).view(1, length, -1, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)  # [1, S, heads, head_dim] layout
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            torch.ops.llama.update_cache(k, k_cache, start)
            torch.ops.llama.update_cache(v, v_cache, start)
            o = torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, None, 0.0, True, attention.scaling)
            x = x + attention.o_proj(o.reshape(1, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(decoder.norm(x[:, -1:]))


@torch.no_grad()
def export(model, max_seq_len: int) -> bytes:
    """The ``.pte`` bytes of ``model`` (quantized by one recipe) as ``CustomOpsDecoder``."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            # padding_idx only shapes training gradients; left in, the lookup does not match
            # the quantized-embedding pattern quant fusion replaces (a torchao dequantize
            # then remains, which ExecuTorch has no kernel for)
            module.padding_idx = None
    decoder = CustomOpsDecoder(model, max_seq_len).eval()
    example = (torch.tensor([[0, 0]], dtype=torch.long), torch.tensor([0], dtype=torch.long))
    # the token dimension is bounded below the cache length, as ExecuTorch's own LLM export does
    tokens = torch.export.Dim("tokens", min=1, max=max_seq_len - 1)
    program = torch.export.export(decoder, example, dynamic_shapes=({1: tokens}, None), strict=True)
    program = program.run_decompositions({})  # decomposes torchao's tensor subclasses into quantize ops
    # IR validity is off as in ExecuTorch's own LLM export: torchao's quantize/dequantize
    # ops are not core ATen, and XNNPACK consumes them before serialization
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    # quant fusion turns the int8 table's dequantize + lookup into ExecuTorch's
    # quantized_decomposed::embedding_byte; the inputs are the caller's, not planned;
    # the dynamic token dimension is planned at its upper bound
    config = ExecutorchBackendConfig(extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
                                     memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
                                     sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass())
    return edge.to_executorch(config).buffer
