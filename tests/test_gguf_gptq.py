"""The GGUF Q4_0 writer for GPTQ weights, against llama.cpp itself (built by scripts/setup.sh).

The default model's decoder linears are put on the symmetric grid at group 32 by
rounding to nearest (GPTQ chooses other codes on the same grid; what is under test
here is the file and llama.cpp's reading of it, not GPTQ), but for those the default
tensor policy stores as Q8_0, written through the converter and the Q4_0 packer, and
scored by llama.cpp against PyTorch on the same weights. A copy with each block's
nibbles swapped must fail that check.
"""

import io

import numpy as np
import pytest
import sentencepiece
import torch

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.formats import gguf_file
from edgepath.paths import gguf as gguf_path
from edgepath.formats.gguf_q4_0_format import BLOCK, GgufQ4_0
from edgepath.quant.gptq import dequantize_codes, quantize_codes, representable_scales


def _on_grid(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to nearest on the symmetric grid, group 32, fp16-exact scales."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    scales = representable_scales(w.abs().amax(dim=-1) / 7.5)
    return dequantize_codes(quantize_codes(w, scales), scales).reshape(n, k)


@pytest.fixture(scope="module")
def on_grid(default_model, tmp_path_factory):
    """(reference model in PyTorch, the written GGUF, its tensor counts, held-out windows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgepath.text import calibration

    hf = default_model / "hf"
    work = tmp_path_factory.mktemp("gguf-gptq")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    _put_on_grid(model, gguf_path.DEFAULT_POLICY)
    counts = gguf_file.write(gguf_file.save_dequantized(model, hf, work / "hf"), work / "model.gguf",
                             gguf_path.DEFAULT_POLICY.type_of)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    windows = calibration.held_out_genres(tokenizer, calibration.load_corpus("mix", []), 1, 96)
    return model, work / "model.gguf", counts, {genre: w.tolist() for genre, w in windows.items()}


def test_the_policy_types_every_tensor_and_refuses_what_it_does_not_know():
    policy = gguf_path.TensorPolicy(q8_0=("attn_v", "ffn_down"), q8_0_layers="more-bits")
    assert policy.type_of("blk.0.attn_v.weight", (192, 576), 30) == "Q8_0"
    assert policy.type_of("blk.3.attn_v.weight", (192, 576), 30) == "Q4_0"  # not one of llama.cpp's more-bits
    assert policy.type_of("blk.0.attn_q.weight", (576, 576), 30) == "Q4_0"
    assert policy.type_of("token_embd.weight", (49152, 576), 30) == "Q8_0"
    assert policy.type_of("blk.0.attn_norm.weight", (576,), 30) == "F32"
    assert policy.type_of("output.weight", (151936, 1536), 28) == "Q8_0"  # a head of its own, as the table
    assert policy.type_of("blk.0.attn_q.bias", (1536,), 28) == "F32"
    with pytest.raises(EdgepathError, match=r"blk\.0\.ffn_gate_exps\.weight .*no type policy"):
        policy.type_of("blk.0.ffn_gate_exps.weight", (8, 1536, 576), 30)
    assert policy.kept_from_gptq(8) == ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj",
                                        "model.layers.3.self_attn.v_proj", "model.layers.3.mlp.down_proj",
                                        "model.layers.6.self_attn.v_proj", "model.layers.6.mlp.down_proj",
                                        "model.layers.7.self_attn.v_proj", "model.layers.7.mlp.down_proj"]
    everywhere = gguf_path.TensorPolicy(q8_0=("attn_k",), q8_0_layers="all")
    assert len(everywhere.kept_from_gptq(30)) == 30
    for wrong in ({"q8_0": ("attn_z",)}, {"q8_0_layers": "some"}, {"embedding": "Q4_0"}):
        with pytest.raises(EdgepathError):
            gguf_path.TensorPolicy(**wrong)


def _put_on_grid(model, policy) -> None:
    """``model``'s tensors as the quantize stage leaves them for the GGUF: rounded as the
    policy stores them, the other decoder linears on the 4-bit grid."""
    policy.round_to_stored(model)
    kept = set(policy.kept_from_gptq(model.config.num_hidden_layers))
    with torch.no_grad():
        for name, linear in model.model.layers.named_modules(prefix="model.layers"):
            if isinstance(linear, torch.nn.Linear) and name not in kept:
                linear.weight.copy_(_on_grid(linear.weight))


@pytest.fixture(scope="module")
def qwen2_on_grid(default_model, tmp_path_factory):
    """A Qwen2 model as Qwen2.5-1.5B is built (query, key and value biases, an output head
    of its own), small: the default model's first 4 layers in Qwen2's architecture, its
    biases and head random, on the grid. (reference, the written GGUF, its tensor
    counts, held-out windows)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from edgepath.text import calibration

    hf = default_model / "hf"
    work = tmp_path_factory.mktemp("gguf-qwen2")
    llama = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    c = llama.config
    config = Qwen2Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=4, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                         rope_parameters=c.rope_parameters, tie_word_embeddings=False,
                         bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    model = Qwen2ForCausalLM(config).eval()
    kept_layers = {k: v for k, v in llama.state_dict().items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4}
    missing, _ = model.load_state_dict(kept_layers, strict=False)
    assert {m.rsplit(".", 2)[-2] for m in missing} == {"q_proj", "k_proj", "v_proj"}  # their biases
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in [*missing, "lm_head.weight"]:  # the head: the table's copy, made its own
            p = model.get_parameter(name)
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    _put_on_grid(model, gguf_path.DEFAULT_POLICY)
    saved = gguf_file.save_dequantized(model, hf, work / "hf")
    # llama.cpp's converter reads a Qwen2 vocabulary from tokenizer.json only where it knows
    # the pre-tokenizer by its hash, which the default model's (converted from its GGUF) is
    # not; a tokenizer.model it reads first. A small SentencePiece model, padded by the
    # converter to the model's vocabulary: the windows below are token ids, scored as ids.
    text = calibration.load_corpus("mix", [])
    spm_model = io.BytesIO()
    lines = next(iter(text.calibration.values())).content.splitlines()[:200]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=spm_model, vocab_size=64,
                                             minloglevel=2)
    (saved / "tokenizer.model").write_bytes(spm_model.getvalue())
    counts = gguf_file.write(saved, work / "model.gguf", gguf_path.DEFAULT_POLICY.type_of)
    windows = calibration.held_out_genres(AutoTokenizer.from_pretrained(hf), text, 1, 96)
    return model, work / "model.gguf", counts, {genre: w.tolist() for genre, w in windows.items()}


def test_a_qwen2_file_stores_its_biases_and_own_head_and_llama_cpp_reproduces_it(qwen2_on_grid, tmp_path):
    model, path, counts, windows = qwen2_on_grid
    kept = gguf_path.DEFAULT_POLICY.kept_from_gptq(4)
    # 4 layers x 7 linears; the table and the head at Q8_0; 2 norms and 3 biases per layer, the final norm
    assert counts == {"Q4_0": 28 - len(kept), "Q8_0": 2 + len(kept), "F32": 4 * 5 + 1}
    reader = gguf_file.gguf_module().GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen2"
    read = gguf_file.read_back(path, path.parent / "hf")
    written = dict(model.named_parameters())
    assert set(dict(read.named_parameters())) == set(written)
    for name, param in read.named_parameters():  # biases, the head, the query and key rows as written
        assert torch.equal(param, written[name]), name
    check = gguf_path.check(path, model, "the same weights in PyTorch", windows, threads=2)
    assert check["passed"], check["against"]
    swapped = gguf_file.swap_nibbles(path, tmp_path / "swapped.gguf")
    assert gguf_path.agreement(swapped, model, windows, threads=2)[0] < 0.5


def test_a_rotated_build_s_file_is_read_back_with_its_own_head_and_llama_cpp_reproduces_it(default_model, tmp_path):
    """A rotated model (``quant.rotation``) unties its head from the table: the file
    stores both, and reading it back against the source model's directory, whose head is
    tied, takes the file's head, not the table."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgepath.quant.rotation import rotate
    from edgepath.text import calibration

    hf = default_model / "hf"
    source = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    source.model.layers = source.model.layers[:4]  # small: what is under test is the head and the norms
    source.config.num_hidden_layers = 4
    assert source.config.tie_word_embeddings
    source.save_pretrained(tmp_path / "source")
    AutoTokenizer.from_pretrained(hf).save_pretrained(tmp_path / "source")
    rotate(source, seed=0)
    _put_on_grid(source, gguf_path.DEFAULT_POLICY)
    counts = gguf_file.write(gguf_file.save_dequantized(source, tmp_path / "source", tmp_path / "hf"),
                             tmp_path / "model.gguf", gguf_path.DEFAULT_POLICY.type_of)
    assert counts["Q8_0"] == 2 + len(gguf_path.DEFAULT_POLICY.kept_from_gptq(4))  # the table and the head
    read = gguf_file.read_back(tmp_path / "model.gguf", tmp_path / "source")
    assert read.get_output_embeddings().weight is not read.get_input_embeddings().weight
    written = dict(source.named_parameters())
    assert set(dict(read.named_parameters())) == set(written)
    for name, param in read.named_parameters():
        assert torch.equal(param, written[name]), name
    windows = calibration.held_out_genres(AutoTokenizer.from_pretrained(hf), calibration.load_corpus("mix", []), 1, 96)
    check = gguf_path.check(tmp_path / "model.gguf", source, "the same weights in PyTorch",
                            {genre: w.tolist() for genre, w in windows.items()}, threads=2)
    assert check["passed"], check["against"]


def test_decoder_matrices_are_q4_0_but_the_policy_s_q8_0_and_the_tied_embedding_q8_0(on_grid):
    model, path, counts, _ = on_grid
    kept = gguf_path.DEFAULT_POLICY.kept_from_gptq(model.config.num_hidden_layers)
    assert kept, "the default policy keeps some matrices at Q8_0"
    # 30 layers x 7 linears; 2 norms per layer and the final one
    assert counts == {"Q4_0": 210 - len(kept), "Q8_0": 1 + len(kept), "F32": 61}
    gguf = gguf_file.gguf_module()
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "Q8_0"
    for layer in range(model.config.num_hidden_layers):
        for matrix, module in gguf_path.MATRICES.items():
            stored = "Q8_0" if f"model.layers.{layer}.{module}" in kept else "Q4_0"
            assert types[f"blk.{layer}.{matrix}.weight"] == stored
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    # the converter's metadata survives: the tokenizer and chat template llama.cpp needs
    assert "tokenizer.chat_template" in reader.fields and "tokenizer.ggml.tokens" in reader.fields


def test_reading_the_file_back_gives_every_weight_it_was_written_from(on_grid, default_model):
    reference, path, _, _ = on_grid
    read = gguf_file.read_back(path, default_model / "hf")
    written = dict(reference.named_parameters())
    for name, param in read.named_parameters():  # the query and key rows too, unpermuted
        assert torch.equal(param, written[name]), name


def test_llama_cpp_reproduces_pytorch_and_a_swapped_nibble_order_fails(on_grid, tmp_path):
    reference, path, _, windows = on_grid
    check = gguf_path.check(path, reference, "the same weights in PyTorch", windows, threads=2)
    records.validate("gguf_check", check)
    assert check["passed"], check["against"]
    assert check["file"]["tensor_types"] == dict(sorted(on_grid[2].items()))
    assert set(check["against"]["reference"]["teacher_forced_top1_by_genre"]) == set(windows)

    swapped = gguf_file.swap_nibbles(path, tmp_path / "swapped.gguf")
    wrong, _ = gguf_path.agreement(swapped, reference, windows, threads=2)
    assert wrong < 0.5, wrong


def test_weights_off_the_grid_are_refused_with_the_tensor_named(default_model, tmp_path):
    hf = default_model / "hf"
    with pytest.raises(EdgepathError, match=r"blk\.\d+\.\w+\.weight: .* not on a 4-bit grid"):
        gguf_file.write(hf, tmp_path / "model.gguf", gguf_path.DEFAULT_POLICY.type_of)
    assert not list(tmp_path.iterdir()), "nothing half-written is left"


def test_pack_and_from_values_agree_with_gguf_py():
    gguf = gguf_file.gguf_module()
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(8, 64))
    scales = rng.uniform(0.001, 0.1, size=(8, 2)).astype(np.float16).astype(np.float32)
    scales[0, 0] *= -1  # llama.cpp's own quantizer writes negative scales too
    packed = GgufQ4_0.pack(codes, scales)
    values = (codes - 8) * np.repeat(scales, BLOCK, axis=1)
    assert np.array_equal(gguf.quants.dequantize(packed.blocks, gguf.GGMLQuantizationType.Q4_0), values)
    assert np.array_equal(GgufQ4_0.from_values(values).dequantize(), values)
