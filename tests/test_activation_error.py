"""Which down projections the W4A8 path keeps bf16 (edgepath.quant.activation_error)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from edgepath.quant.activation_error import rank_down_projections, rounded_per_token


def _llama(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         initializer_range=0.1)  # peaked enough next-token distributions to differ
    return LlamaForCausalLM(config).eval()


def test_rounding_per_token_has_256_levels_between_each_tokens_extremes():
    x = torch.randn(5, 300) * torch.tensor([1.0, 10.0, 0.1, 100.0, 3.0])[:, None]
    rounded = rounded_per_token(x)
    step = ((x.amax(-1) - x.amin(-1)) / 255)[:, None]
    error = (rounded - x).abs()
    assert (error <= step * 1.0001).all()  # half a step, but where the zero point's rounding clamps an extreme
    assert (error.mean(-1, keepdim=True) < step / 3).all()
    assert all(len(row.unique()) <= 256 for row in rounded)


@pytest.mark.parametrize("outlier_layer", [1, 2])
def test_the_layer_whose_down_projection_input_has_an_outlier_ranks_first(outlier_layer):
    """One channel of a layer's down-projection input made 1000x wider, its weight
    column 1000x narrower: the model computes the same function, but 8-bit rounding of
    that layer's inputs now leaves the other channels almost no levels."""
    model = _llama()
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=tokens).logits
    mlp = model.model.layers[outlier_layer].mlp
    with torch.no_grad():
        mlp.up_proj.weight[0] *= 1000
        mlp.down_proj.weight[:, 0] /= 1000
    assert torch.allclose(model(input_ids=tokens).logits, before, atol=1e-3)
    ranked = rank_down_projections(model, tokens, batch_size=2)
    assert [p for p, _ in ranked][0] == f"model.layers.{outlier_layer}.mlp.down_proj"
    assert sorted(p for p, _ in ranked) == sorted(f"model.layers.{i}.mlp.down_proj" for i in range(4))
    kl = [k for _, k in ranked]
    assert kl == sorted(kl, reverse=True) and kl[-1] >= 0
    assert kl[0] > 10 * kl[1]
