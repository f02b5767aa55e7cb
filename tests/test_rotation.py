"""The rotations folded before GPTQ: exact on the model's outputs and on its Hessians."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from edgepath.core.errors import EdgepathError
from edgepath.quant.rotation import hadamard, rotate
from edgepath.quant.sequential import input_hessians


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 36, 64, 140, 576, 1536])
def test_hadamard_matrices_of_the_orders_models_have(n):
    h = hadamard(n)
    assert h.shape == (n, n) and bool(((h == 1) | (h == -1)).all())
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))


def test_an_order_without_a_construction_is_refused():
    with pytest.raises(EdgepathError, match="no Hadamard matrix of order 6"):
        hadamard(6)


def _model(kind: str, tied: bool):
    torch.manual_seed(0)
    shape = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=tied)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if kind == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**shape))).eval()  # Qwen2: biases on q, k and v
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # gains far from 1, as trained models have
                p.copy_(torch.rand_like(p) * 2 + 0.1)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p))
        model.model.embed_tokens.weight[:, 5] *= 40  # an outlier channel of the residual stream
    return model


@pytest.mark.parametrize("kind, tied", [("llama", True), ("qwen2", False)])
def test_a_rotated_model_computes_the_same_logits_with_its_outliers_spread(kind, tied):
    model = _model(kind, tied)
    tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens).logits
    rotated = copy.deepcopy(model)
    rotation = rotate(rotated, seed=3)
    with torch.no_grad():
        after = rotated(tokens).logits
    assert rotation.record() == {"rotations": ["R1", "R2"], "kind": "random Hadamard", "seed": 3}
    assert not rotated.config.tie_word_embeddings
    assert torch.allclose(after, before, atol=2e-4 * before.abs().max())
    assert not torch.allclose(rotated.model.layers[0].self_attn.v_proj.weight,
                              model.model.layers[0].self_attn.v_proj.weight)
    assert all(bool((p == 1).all()) for n, p in rotated.named_parameters() if "norm" in n)

    def peak_to_rms(t):  # an outlier channel stands out of a row; rotated, it is spread over all
        return (t.abs().amax(-1) / t.pow(2).mean(-1).sqrt()).mean()

    assert peak_to_rms(rotated.model.embed_tokens.weight) < 0.5 * peak_to_rms(model.model.embed_tokens.weight)


def test_the_unrotated_models_hessians_become_the_rotated_ones():
    model = _model("qwen2", tied=True)
    rotated = copy.deepcopy(model)
    rotation = rotate(rotated, seed=0)
    tokens = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(2))
    original = list(input_hessians(model, tokens))
    transformed = rotation.hessians(lambda layer: original[-1 if layer is None else layer])
    for layer, expected in enumerate(input_hessians(rotated, tokens)):
        got = transformed(None if layer == len(original) - 1 else layer)
        assert got.keys() == expected.keys()
        for key, h in expected.items():
            assert torch.allclose(got[key], h, atol=1e-4 * h.abs().max()), key


def test_a_norm_gain_of_zero_is_refused():
    model = _model("llama", tied=True)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[7] = 0
    with pytest.raises(EdgepathError, match="layer 1: a norm gain of 0"):
        rotate(model, seed=0)
