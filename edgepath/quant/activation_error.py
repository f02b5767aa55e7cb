"""Which down projections a W4A8 checkpoint keeps in bf16: those whose int8 inputs cost most.

vLLM's W4A8 kernel (``_C::int4_scaled_mm_cpu``) rounds each token's activations
to 8 bits before the GEMM. Where one token's inputs span a wide range (a few
outlier channels), every other channel of that token gets few levels. In a Llama
the down projection's input (``act(gate) * up``) has the widest spans. Measured
on SmolLM2-135M in fp32 with bf16 weights (4 x 512 held-out tokens per genre,
asymmetric 8-bit rounding per token): int8 inputs on every linear cost +0.92 %
mean perplexity, +0.72 of it on the down projections (q/k/v +0.13, o +0.03,
gate/up +0.19), and among the 30 down projections layers 0 and 2 alone +0.23 and
+0.19. A down projection kept in bf16 runs vLLM's unquantized GEMM (the
checkpoint's ``quantization_config.dynamic`` skips it), which removes both its
int8-input and its 4-bit weight error.

How a layer is ranked: by what its int8 inputs do to the model's output, not to the
layer's own. The layer's relative output error ranked SmolLM2's down projections
almost in reverse (layers 25, 26, 9 first; 0 and 2 nowhere near): an early
layer's error travels through every later one.

Lifecycle: ``rank_down_projections(model, tokens)`` runs the unquantized model over
calibration tokens once for its next-token distributions, keeping every decoder
layer's input; then, per decoder layer, from that layer's kept input to the end
with only its down-projection input rounded to 8 bits per token; it returns the
prefixes with the mean KL divergence from the unquantized distributions, largest
first. The quantize stage keeps the first few
(``quantize.w4a8_bf16_down_proj``) out of GPTQ and stores them bf16.
"""

from __future__ import annotations

import torch

from .sequential import decoder_inputs, forward_layer

DOWN_PROJ = "mlp.down_proj"


def rounded_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., features] rounded to 8 bits per token: 256 levels from its minimum to
    its maximum (asymmetric, the rounding this module's figures were measured with)."""
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / 255).clamp(min=torch.finfo(x.dtype).tiny)
    zero = torch.round(-low / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale


@torch.no_grad()
def rank_down_projections(model, tokens: torch.Tensor, batch_size: int = 8) -> list[tuple[str, float]]:
    """``[(prefix, mean KL divergence in nats per token), ...]`` of every decoder layer's
    down projection, largest first (module docstring); ``tokens`` [samples, length]."""
    layers = model.model.layers

    def log_probs(h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(model.get_output_embeddings()(model.model.norm(h)).float(), -1)

    hidden, kwargs = decoder_inputs(model, tokens, batch_size)
    layer_inputs = []
    for layer in layers:
        layer_inputs.append(hidden)
        hidden = forward_layer(layer, hidden, kwargs)
    # fp32: a bf16 copy put a floor of 1e-4 nats per token under every layer's figure
    # (16 x 256 tokens of a 49k vocabulary are 0.8 GB, of Qwen2.5's 152k 2.5 GB)
    reference = [log_probs(h) for h in hidden]
    ranked = []
    for i, layer in enumerate(layers):
        hook = layer.get_submodule(DOWN_PROJ).register_forward_pre_hook(
            lambda _module, args: (rounded_per_token(args[0]), *args[1:]))
        try:
            hidden = layer_inputs[i]
            for later in layers[i:]:
                hidden = forward_layer(later, hidden, kwargs)
        finally:
            hook.remove()
        # one batch's distributions at a time: a second full set beside the reference
        # made this the calibrate stage's peak at 1.5B (16.6 GiB)
        kl = sum(torch.nn.functional.kl_div(log_probs(h), ref, log_target=True, reduction="sum").item()
                 for h, ref in zip(hidden, reference))
        ranked.append((f"model.layers.{i}.{DOWN_PROJ}", kl / tokens.numel()))
    return sorted(ranked, key=lambda item: -item[1])
