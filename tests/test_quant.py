"""The quantizer's parts on small tensors: the GPTQ v1 layout, GPTQ with its scale
search, the Hessian, calibration sets, settings and up-front refusals."""

import dataclasses
import shutil

import pytest
import torch

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.formats.cpu_int4_format import CpuInt4
from edgepath.formats.gptq_format import GptqV1Int4
from edgepath.quant.gptq import (MINMAX, SEARCHES, HessianAccumulator, group_aware_order, quantize_layer,
                                 representable_scales)
from edgepath.stages import quantize
from edgepath.text import calibration

from .conftest import write_tiny_llama


def _codes_and_scales(n=16, k=64, groups=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = representable_scales(torch.rand(n, groups, generator=g) * 0.1 + 0.01)
    return codes, scales


def test_layout_round_trips_codes_scales_and_dequantizes_with_zero_8():
    codes, scales = _codes_and_scales()
    layer = GptqV1Int4.pack(codes, scales)
    assert layer.qweight.shape == (64 // 8, 16) and layer.qweight.dtype == torch.int32
    assert layer.scales.shape == (2, 16) and layer.scales.dtype == torch.float16
    assert layer.qzeros.shape == (2, 16 // 8)
    assert torch.equal(layer.g_idx, torch.arange(64, dtype=torch.int32) // 32)
    assert torch.equal(layer.codes(), codes)
    want = (codes.float() - 8) * scales.repeat_interleave(32, dim=1)
    assert torch.equal(layer.dequantize(), want)


def test_layout_puts_row_8r_plus_i_in_nibble_i_and_stores_zero_minus_one():
    codes = torch.zeros(8, 16, dtype=torch.int32)
    codes[0, 3] = 0xF  # weight [out 0, in 3]: qweight row 0, nibble 3
    codes[0, 15] = 0x9  # in 15 = 8*1 + 7: qweight row 1, nibble 7 (sets the sign bit)
    layer = GptqV1Int4.pack(codes, torch.ones(8, 1))
    assert layer.qweight[0, 0].item() == 0xF << 12
    assert layer.qweight[1, 0].item() == (0x9 << 28) - 2**32  # two's complement int32
    assert (layer.qzeros == 0x77777777).all()  # v1: zero 8 stored as 7 in every nibble
    assert (layer.zeros() == 8).all()


def test_layout_refuses_what_it_cannot_store_exactly():
    codes, scales = _codes_and_scales()
    with pytest.raises(AssertionError, match="fp16"):
        GptqV1Int4.pack(codes, scales + 1e-7)
    with pytest.raises(AssertionError, match="0..15"):
        GptqV1Int4.pack(codes + 1, scales)
    layer = GptqV1Int4.pack(codes, scales)
    tensors = layer.tensors("x")
    tensors["x.g_idx"] = tensors["x.g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order"):
        GptqV1Int4.from_tensors(tensors, "x")


def test_hessian_accumulates_batches_like_one_pass():
    x = torch.randn(3, 50, 16, dtype=torch.float64)
    acc = HessianAccumulator(16)
    for batch in x:
        acc.add(batch)
    flat = x.reshape(-1, 16)
    # each batch's product is fp32 (2^-24 relative), the running sum fp64
    assert torch.allclose(acc.h, 2 / flat.shape[0] * flat.t() @ flat, rtol=1e-6, atol=1e-6)


def test_hessian_is_symmetric_and_close_to_fp64_across_folds_blocks_and_outlier_channels(monkeypatch):
    # small blocks and folds so that one test crosses both: a width that is no multiple
    # of the block, batches that straddle a fold
    monkeypatch.setattr(HessianAccumulator, "BLOCK", 8)
    monkeypatch.setattr(HessianAccumulator, "FOLD_ROWS", 100)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 60, 37, generator=g, dtype=torch.float64)
    x[..., :3] *= 300  # outlier channels, as real residual streams have
    acc = HessianAccumulator(37)
    for batch in x:
        acc.add(batch)
    flat = x.reshape(-1, 37)
    reference = 2 / flat.shape[0] * flat.t() @ flat
    h = acc.h
    assert h.dtype == torch.float64 and torch.equal(h, h.t())
    d = reference.diagonal().sqrt()
    assert ((h - reference).abs() / (d[:, None] * d[None, :])).max() < 1e-6
    assert acc.rows == 7 * 60
    assert torch.equal(acc.h, h)  # reading folds, never double-counts


def test_group_aware_order_keeps_groups_whole_and_puts_important_ones_first():
    diag = torch.tensor([1.0, 2, 9, 8, 0.5, 0.1, 3, 4])
    perm = group_aware_order(diag, 2)
    assert sorted(perm.tolist()) == list(range(8))
    groups = perm.view(4, 2) // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # each group stays contiguous
    assert groups[:, 0].tolist() == [1, 3, 0, 2]  # by total importance 17, 7, 3, 0.6
    assert perm[:2].tolist() == [2, 3]  # and by importance inside a group


def _correlated_layer(n=64, k=128, rows=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.logspace(-1, 1, k)  # a few input channels dominate, as in real activations
    x = (torch.randn(rows, k, generator=g) @ mix) * scale
    w = torch.randn(n, k, generator=g) * 0.05
    acc = HessianAccumulator(k)
    acc.add(x)
    return w, x, acc.h


def _output_error(w, q, x):
    return ((x @ (w - q).t()) ** 2).mean().item()


def test_gptq_and_the_output_error_search_each_lower_the_output_error():
    w, x, h = _correlated_layer()
    group = 32
    absmax = w.view(64, -1, group).abs().amax(-1, keepdim=True)
    s = representable_scales(absmax / 7.5)
    rtn = ((torch.clamp(torch.round(w.view(64, -1, group) / s) + 8, 0, 15) - 8) * s).view(64, -1)
    plain = quantize_layer(w, h, group, SEARCHES[True]["none"]).dequantize()
    searched = quantize_layer(w, h, group, SEARCHES[True]["output-error"]).dequantize()
    e_rtn, e_plain, e_search = (_output_error(w, q, x) for q in (rtn, plain, searched))
    assert e_plain < 0.8 * e_rtn
    assert e_search < e_plain


def test_gptq_on_the_asymmetric_minmax_grid_lowers_the_output_error():
    w, x, h = _correlated_layer()
    group = 32
    blocks = w.view(64, -1, group)
    s = representable_scales((blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15)
    o = (blocks.amin(-1, keepdim=True) + 8 * s).to(torch.bfloat16).float()
    rtn = ((torch.clamp(torch.round((blocks - o) / s) + 8, 0, 15) - 8) * s + o).view(64, -1)
    q = quantize_layer(w, h, group, MINMAX)
    assert q.offsets is not None and torch.equal(q.ratios, torch.ones_like(q.ratios))
    assert torch.equal(q.offsets.to(torch.bfloat16).float(), q.offsets)
    CpuInt4.pack(q.codes, q.scales, q.offsets)  # packs without loss
    assert _output_error(w, q.dequantize(), x) < 0.8 * _output_error(w, rtn, x)


def test_the_output_error_search_on_the_asymmetric_grid_clips_and_lowers_the_output_error():
    w, x, h = _correlated_layer()
    plain = quantize_layer(w, h, 32, SEARCHES[False]["none"])
    searched = quantize_layer(w, h, 32, SEARCHES[False]["output-error"])
    assert searched.ratios.min() >= 0.80 and searched.ratios.max() <= 1.0
    assert (searched.ratios < 1.0).any()  # some ranges were clipped
    assert torch.equal(searched.offsets.to(torch.bfloat16).float(), searched.offsets)
    CpuInt4.pack(searched.codes, searched.scales, searched.offsets)  # packs without loss
    assert _output_error(w, searched.dequantize(), x) < _output_error(w, plain.dequantize(), x)


def test_quantized_layer_is_on_the_grid_with_exact_scales_and_recorded_ratios():
    w, _, h = _correlated_layer()
    q = quantize_layer(w, h, 32, SEARCHES[True]["output-error"])
    assert q.codes.shape == w.shape and int(q.codes.min()) >= 0 and int(q.codes.max()) <= 15
    assert torch.equal(q.scales.to(torch.float16).float(), q.scales)
    assert torch.equal(q.scales.to(torch.bfloat16).float(), q.scales)
    assert q.ratios.min() >= 0.80 and q.ratios.max() <= 1.10
    assert (q.ratios != 1.0).any()  # the search moved some scales
    GptqV1Int4.pack(q.codes, q.scales)  # packs without loss


def test_the_signed_search_puts_code_minus_8_on_either_side_and_lowers_the_output_error():
    w, x, h = _correlated_layer()
    signed = quantize_layer(w, h, 32, SEARCHES[True]["output-error"])
    unsigned = quantize_layer(w, h, 32, dataclasses.replace(SEARCHES[True]["output-error"], signed=False))
    assert (signed.scales < 0).any() and (signed.scales > 0).any()
    assert (unsigned.scales > 0).all()
    assert signed.ratios.min() >= 0.80 and signed.ratios.max() <= 1.10  # a ratio is the scale's magnitude
    assert _output_error(w, signed.dequantize(), x) < _output_error(w, unsigned.dequantize(), x)
    layer = GptqV1Int4.pack(signed.codes, signed.scales)  # fp16 keeps the sign: packs without loss
    assert torch.equal(layer.dequantize(), signed.dequantize())


def test_sequential_gptq_leaves_the_linears_it_is_told_to_keep(default_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from edgepath.quant.sequential import GptqPlan, quantize_model

    tiny = write_tiny_llama(tmp_path / "tiny", default_model / "hf")
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    keep = {"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj"}
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    quantized = quantize_model(model, tokens, GptqPlan(32, SEARCHES[True]["output-error"], 0.01, True, keep=keep))
    linears = {n.removesuffix(".weight") for n in before if n.startswith("model.layers.0.") and "proj" in n}
    assert set(quantized) == linears - keep
    for name, param in model.named_parameters():
        unchanged = torch.equal(param, before[name])
        assert unchanged == (name.removesuffix(".weight") not in quantized), name


def _tiny_model(default_model, tmp_path):
    from transformers import AutoModelForCausalLM

    tiny = write_tiny_llama(tmp_path / "tiny", default_model / "hf")
    return lambda: AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def test_shared_hessians_are_the_unquantized_models_inputs(default_model, tmp_path):
    from edgepath.quant.sequential import HEAD, SEQUENTIAL_GROUPS, input_hessians

    model = _tiny_model(default_model, tmp_path)()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    layers = list(input_hessians(model, tokens, batch_size=3))  # batches of 3 and 1 rows
    assert len(layers) == 2 and set(layers[1]) == {HEAD}
    assert set(layers[0]) == {f"model.layers.0.{group[0]}" for group in SEQUENTIAL_GROUPS}
    captured = {}
    hooks = [model.get_submodule(key).register_forward_pre_hook(
        lambda _m, args, key=key: captured.setdefault(key, args[0])) for key in layers[0]]
    with torch.no_grad():
        hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states[-1]
    for hook in hooks:
        hook.remove()
    # the last hidden state is already normed by the model; the head reads exactly that
    captured[HEAD] = hidden
    for key, h in {**layers[0], **layers[1]}.items():
        x = captured[key].reshape(-1, captured[key].shape[-1]).double()
        expected = 2 / x.shape[0] * x.t() @ x
        # fp32 products: errors relative to the matrix's scale, not to each entry
        assert (h - expected).abs().max() <= 1e-5 * expected.abs().max(), key


def test_gptq_from_shared_hessians_quantizes_each_linear_from_its_groups_hessian_on_any_thread_count(
        default_model, tmp_path):
    from edgepath.quant.sequential import HEAD, GptqPlan, input_hessians, quantize_from_hessians, shared_input

    load = _tiny_model(default_model, tmp_path)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    layers = list(input_hessians(load(), tokens))
    grid = SEARCHES[True]["output-error"]
    keep = {"model.layers.0.mlp.down_proj"}
    results = []
    for workers in (1, 2):
        model = load()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        results.append(quantize_from_hessians(model, lambda i: layers[-1 if i is None else i],
                                              GptqPlan(32, grid, 0.01, True, quantize_head=True, keep=keep,
                                                       workers=workers)))
        assert not model.config.tie_word_embeddings  # the head untied: the embedding table stays exact
        assert torch.equal(model.get_input_embeddings().weight, before["model.embed_tokens.weight"])
        assert torch.equal(model.get_submodule("model.layers.0.mlp.down_proj").weight,
                           before["model.layers.0.mlp.down_proj.weight"])
    one, two = results
    assert set(one) == {f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")} | {HEAD}
    original = load()
    for prefix, q in one.items():
        assert torch.equal(q.codes, two[prefix].codes) and torch.equal(q.scales, two[prefix].scales), prefix
        weight = original.get_output_embeddings().weight if prefix == HEAD else original.get_submodule(prefix).weight
        alone = quantize_layer(weight.data, layers[-1 if prefix == HEAD else 0][shared_input(prefix)], 32, grid,
                               0.01, True)
        assert torch.equal(q.codes, alone.codes), prefix


def test_the_hessian_store_refuses_a_file_that_is_not_the_records(tmp_path):
    from edgepath.quant import hessian_store

    h = {"model.layers.0.self_attn.q_proj": torch.eye(4, dtype=torch.float64) * 2}
    entries = [hessian_store.write(tmp_path, 0, h), hessian_store.write(tmp_path, None, {"lm_head": h[
        "model.layers.0.self_attn.q_proj"]})]
    store = hessian_store.HessianStore(tmp_path, entries)
    assert torch.equal(store(0)["model.layers.0.self_attn.q_proj"], h["model.layers.0.self_attn.q_proj"])
    with pytest.raises(EdgepathError, match="names no layer-001.safetensors: the model has more layers"):
        store(1)
    path = tmp_path / hessian_store.file_name(0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of one entry
    path.write_bytes(bytes(data))
    with pytest.raises(EdgepathError, match="layer-000.safetensors: its sha256 is not the one"):
        store(0)
    path.write_bytes(bytes(data[:-8]))  # truncated: refused before any layer is read
    with pytest.raises(EdgepathError, match=r"layer-000.safetensors: \d+ bytes, not the \d+ the calibration record"):
        hessian_store.HessianStore(tmp_path, entries)
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # whole again
    (tmp_path / hessian_store.HEAD_FILE).unlink()
    with pytest.raises(EdgepathError, match="head.safetensors: missing"):
        hessian_store.HessianStore(tmp_path, entries)


def test_search_names_in_settings_match_the_algorithms():
    assert all(set(quantize.SEARCH_NAMES) == set(s) for s in SEARCHES.values())
    # the report records the grid's own name: the record's schema must admit every one
    recorded = records.schema("quantization")["properties"]["algorithm"]["properties"]["search"]["enum"]
    assert sorted(recorded) == sorted(g.name for s in SEARCHES.values() for g in s.values())


@pytest.mark.parametrize("params, calibration, message", [
    ({"colour": 1}, {}, r"quantize\.colour: unknown key"),
    ({}, {"samples": "many"}, r"calibration\.samples: 'many' is not of type 'integer'"),
    ({}, {"holdout": "persuasion"}, "list of document names"),
    ({"gptq": {"search": "magic"}}, {}, r"quantize\.gptq\.search: 'magic' is not one of"),
    ({"gptq": {"damp": 2}}, {}, r"quantize\.gptq\.damp: 2 is greater than or equal to the maximum of 1"),
    ({"head": "int8"}, {}, r"quantize\.head: 'int8' is not one of"),
    ({"w4a8_bf16_down_proj": -1}, {}, r"quantize\.w4a8_bf16_down_proj: -1 is less than the minimum of 0"),
    ({"gptq": {"group_order": "yes"}}, {}, r"quantize\.gptq\.group_order: 'yes' is not of type 'boolean'"),
])
def test_settings_refuse_wrong_fields(params, calibration, message):
    with pytest.raises(EdgepathError, match=message):
        quantize.Settings.from_params(params, calibration)


def test_settings_read_the_shipped_params():
    import yaml

    from .conftest import ROOT

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    settings = quantize.Settings.from_params(params["quantize"], params["calibration"])
    # the shipped file states every default, and the code's defaults are the same
    assert settings == quantize.Settings()
    assert (settings.calibration.corpus, settings.search, settings.head) == ("mix", "output-error", "bf16")


def test_fidelity_is_per_genre_with_the_mean_and_the_worst_genre_as_headline():
    import jsonschema

    held_out = {"corpus": "mix", "documents_sha256": "sha256:" + "0" * 64,
                "genres": {"code": ["click-code"], "prose": ["alice"]}, "dropped": []}
    fid = quantize.fidelity({"code": 10.0, "prose": 20.0}, {"code": 11.0, "prose": 25.0}, 8, 512, held_out)
    assert fid["genres"]["code"] == {"perplexity_reference": 10.0, "perplexity_quantized": 11.0, "increase_pct": 10.0}
    assert fid["genres"]["prose"]["increase_pct"] == 25.0
    assert fid["mean_increase_pct"] == 17.5 and fid["worst"] == {"genre": "prose", "increase_pct": 25.0}
    schema = records.schema("quantization")["properties"]["fidelity"]
    jsonschema.validate(fid, schema)
    nothing = quantize.fidelity({}, {}, 0, 512, None)  # quantize.eval.windows: 0
    assert (nothing["genres"], nothing["mean_increase_pct"], nothing["worst"]) == ({}, None, None)
    jsonschema.validate(nothing, schema)
    with pytest.raises(jsonschema.ValidationError):  # windows asked for, nothing measured
        jsonschema.validate({**nothing, "windows_per_genre": 8}, schema)


def test_engine_check_scores_every_genre_and_passes_on_all_their_positions():
    from edgepath.scoring import agreement
    from edgepath.paths import vllm_checkpoint

    sequences = {"code": [[1, 2, 3, 4], [5, 6, 7, 8]], "prose": [[9, 10, 11, 12]]}
    assert agreement.all_windows(sequences) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    engine = [[2, 3, 4], [6, 7, 8], [10, 11, 12]]
    reference = [[2, 3, 4], [6, 7, 8], [0, 0, 12]]  # prose agrees on 1 of 3 positions
    assert agreement.agreement_by_genre(engine, reference, sequences) == {"code": 1.0, "prose": 0.3333}
    greedy = {"identical": 1, "prompts": 1, "mean_identical_leading_tokens": 4.0}
    comparisons = {name: {"teacher_forced_top1_agreement": round(agreement.agreement(engine, reference), 4),
                          "teacher_forced_top1_by_genre": agreement.agreement_by_genre(engine, reference, sequences),
                          "greedy": greedy} for name in ("dequantized", "bf16")}
    measured = {"layer_modes": [{"method": "AutoGPTQLinearMethod", "kernel": "_C::int4_scaled_mm_cpu", "layers": 2}],
                "ops": ["_C::int4_scaled_mm_cpu"], "top1": engine, "greedy": [[1]]}
    record = vllm_checkpoint.verdict(vllm_checkpoint.header("gptq", True), False, measured, comparisons, sequences, 4)
    assert record["held_out"] == {"windows_per_genre": {"code": 2, "prose": 1}, "length": 4}
    assert record["teacher_forced_positions"] == 9
    assert record["passed"]  # 7 of 9 positions (0.78) clear the W4A8 mark of 0.75, though prose alone does not
    records.validate("engine_check", {**records.envelope("engine_check"), **record})


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model / "hf")


def test_calibration_is_drawn_from_calibration_documents_only_and_recorded(tokenizer):
    corpus = calibration.load_corpus("austen", ["persuasion"])
    assert "persuasion" not in corpus.calibration and set(corpus.holdout) == {"persuasion"}
    calib = calibration.calibration_set(tokenizer, corpus, samples=8, length=64, chat_fraction=0.25, seed=1)
    assert calib.tokens.shape == (8, 64) and calib.chat_samples == 2
    again = calibration.calibration_set(tokenizer, corpus, samples=8, length=64, chat_fraction=0.25, seed=1)
    assert torch.equal(calib.tokens, again.tokens)
    record = calib.record
    assert record["held_out"] == ["persuasion"] and record["samples"] == 8 and record["length"] == 64
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert sum(im_start in row for row in calib.tokens.tolist()) == 2  # the chat-formatted ones
    held_out_text = set(calibration.evaluation_set(tokenizer, corpus, 4, 64).flatten().tolist())
    assert held_out_text  # and evaluation windows come from the held-out novel
    with pytest.raises(EdgepathError, match="not in it"):
        calibration.load_corpus("austen", ["ulysses"])


def test_a_corpus_too_short_is_refused_with_its_name(tokenizer, tmp_path):
    (tmp_path / "notes.txt").write_text("Only a few words here. " * 20)
    (tmp_path / "eval.txt").write_text("Held out. " * 20)
    corpus = calibration.load_corpus(str(tmp_path), ["eval"])
    with pytest.raises(EdgepathError, match=f"{tmp_path} is too short: .* 64 were asked for"):
        calibration.calibration_set(tokenizer, corpus, samples=64, length=128, chat_fraction=0, seed=0)


def test_chat_calibration_without_a_chat_template_is_refused(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    corpus = calibration.load_corpus("austen", ["persuasion"])
    with pytest.raises(EdgepathError, match="no chat template"):
        calibration.calibration_set(plain, corpus, samples=4, length=32, chat_fraction=0.5, seed=0)
    assert calibration.calibration_set(plain, corpus, samples=4, length=32, chat_fraction=0, seed=0)


def test_quantize_refuses_bad_input_up_front_and_writes_nothing(default_model, tmp_path):
    hf = default_model / "hf"
    out = tmp_path / "out"
    calibrated = tmp_path / "calibration"  # each refusal comes before the calibration is read
    with pytest.raises(EdgepathError, match="not built by the quantize stage"):
        quantize.run(hf, "bf16", out, calibrated)
    odd = write_tiny_llama(tmp_path / "odd", hf, intermediate_size=72)
    with pytest.raises(EdgepathError, match=r"layer model\.layers\.0\.mlp\.(down|gate|up)_proj .*multiple of 32"):
        quantize.run(odd, "w4a8-gptq", out, calibrated)
    narrow = write_tiny_llama(tmp_path / "narrow", hf, intermediate_size=40)
    with pytest.raises(EdgepathError, match=r"layer model\.layers\.0\.mlp\.\w+ .*tinygemm.*multiple of 16"):
        quantize.run(narrow, "w4a16-tinygemm", out, calibrated)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(hf, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])  # truncated mid-tensor
    with pytest.raises(EdgepathError, match="model.safetensors"):
        quantize.run(corrupt, "w4a8-gptq", out, calibrated)
    notok = tmp_path / "no-tokenizer"
    shutil.copytree(hf, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(EdgepathError, match="tokenizer"):
        quantize.run(notok, "w4a8-gptq", out, calibrated)
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())
