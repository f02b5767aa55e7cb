"""A build's memory need against its device's (``edgepath.rules.memory``), and the
selector's choice of a build that fits."""

import dataclasses
import json

import pytest
import yaml

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.rules import measurements, memory, weight_paths
from edgepath.rules.profile import HardwareProfile
from edgepath.rules.select import GGUF_PATH, select_weight_path
from edgepath.rules.shapes import block_linears

from .conftest import edgepath_command

GIB = 2**30
PHONE = HardwareProfile(arch="aarch64", cpu_model="Cortex-A78", cpu_flags=["neon", "dotprod"],
                        kernel_release="5.10.43-android12-9", ram_total_bytes=4 * GIB)
"""A phone with 4 GB of RAM and no NPU."""
CPU = HardwareProfile(arch="x86_64", cpu_model="EPYC 9B14", ram_total_bytes=64 * GIB, cpu_flags=[
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"])
AMX = HardwareProfile(arch="x86_64", cpu_model="Xeon", ram_total_bytes=64 * GIB,
                      cpu_flags=["avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"])
"""A CPU whose tier no build's decode was measured on: engine auto keeps vLLM's path there."""
GPU = HardwareProfile(arch="x86_64", accelerator="cuda_discrete", gpu_name="NVIDIA L4", supports_bf16=True,
                      gpu_mem_bytes=24 * GIB, ram_total_bytes=64 * GIB)


def decoder(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
            tied: bool) -> memory.ModelShape:
    """A Llama/Qwen2-style model's shape as its model record gives it (no weights)."""
    head_dim = hidden // heads
    tensors = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    if not tied:
        tensors["lm_head.weight"] = [vocab, hidden]
    for i in range(layers):
        at = f"model.layers.{i}."
        tensors.update({
            at + "self_attn.q_proj.weight": [hidden, hidden], at + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
            at + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden], at + "self_attn.o_proj.weight": [hidden, hidden],
            at + "mlp.gate_proj.weight": [intermediate, hidden], at + "mlp.up_proj.weight": [intermediate, hidden],
            at + "mlp.down_proj.weight": [hidden, intermediate],
            at + "input_layernorm.weight": [hidden], at + "post_attention_layernorm.weight": [hidden]})
    config = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "tie_word_embeddings": tied}
    return memory.ModelShape.from_record({"config": config, "tensors": {n: {"shape": s} for n, s in tensors.items()}})


# Qwen2.5-Coder-1.5B-Instruct (its output head apart) and a 7B of Qwen2.5-7B's shape.
QWEN_1_5B = decoder(28, 1536, 8960, 12, 2, 151936, tied=False)
QWEN_7B = decoder(28, 3584, 18944, 28, 4, 152064, tied=False)


def _select(profile, priority="speed", model=QWEN_1_5B, **kw):
    return select_weight_path(profile, priority, linears=block_linears(model.tensors), model=model, **kw)


def _with_ram(profile: HardwareProfile, ram: int) -> HardwareProfile:
    return dataclasses.replace(profile, ram_total_bytes=ram)


def test_weights_are_counted_as_the_engines_count_them(default_model):
    """The count from the model's shapes against the engines' own on the real model: llama.cpp's
    tensor bytes of the q4_0-gguf build and vLLM's loaded weights, as the benchmark recorded them."""
    model_record = records.read(default_model / "model.json", "model")
    bench = measurements.benchmark("engine_auto.json")
    if bench["model"]["fingerprint"] != model_record["fingerprint"]:
        pytest.skip("the engine record measured another model than the embedded default")
    shape = memory.ModelShape.from_record(model_record)
    linears = block_linears(shape.tensors)
    gguf = weight_paths.get(GGUF_PATH)
    assert memory.weights_bytes(gguf, gguf.group_size(linears)[0], shape) \
        == measurements.arm("engine_auto.json", GGUF_PATH)["engine_info"]["tensor_bytes"]
    for name in ("w4a16-tinygemm", "bf16"):
        spec, arm = weight_paths.get(name), measurements.arm("engine_auto.json", "vllm bf16" if name == "bf16" else name)
        assert memory.weights_bytes(spec, spec.group_size(linears)[0], shape) == arm["bytes_per_token"]
    bf16 = memory.weights_bytes(weight_paths.get("bf16"), None, shape)
    assert bf16 == 2 * model_record["parameters"]


def test_a_need_is_its_parts_and_its_kv_cache_grows_with_the_context():
    short, long = (_select(CPU, engine="llama.cpp", context=c).memory for c in (1024, 4096))
    for m in (short, long):
        assert m["need_bytes"] == m["weights_bytes"] + m["kv_cache_bytes"] + m["runtime_bytes"]
        assert m["fits"] and m["have"] == "RAM" and m["have_bytes"] == CPU.ram_total_bytes
        assert m["runtime_measured"] and "engine_auto.json" in m["runtime_measured"]
    assert long["kv_cache_bytes"] == 4 * short["kv_cache_bytes"] > 0
    # vLLM on a CPU reserves its KV space whatever the context
    vllm = _select(CPU, engine="vllm", context=16).memory
    assert vllm["kv_cache_bytes"] == memory.VLLM_CPU_KV_SPACE_GIB * GIB
    assert vllm["runtime_bytes"] > short["runtime_bytes"] > 0


def test_a_built_artifact_s_size_replaces_the_estimate_and_decides_the_fit():
    estimated = _select(CPU, engine="llama.cpp", context=1024).memory
    spare = estimated["have_bytes"] - estimated["need_bytes"]
    built = memory.with_built_weights(estimated, estimated["weights_bytes"] + spare + 1, "the built model.gguf")
    assert built["need_bytes"] == built["weights_bytes"] + built["kv_cache_bytes"] + built["runtime_bytes"]
    assert not built["fits"] and built["weights_from"] == "the built model.gguf"
    assert memory.with_built_weights(estimated, estimated["weights_bytes"] + spare, "f")["fits"]


def test_a_4gb_phone_gets_its_program_and_a_smaller_phone_the_4bit_one():
    faithful = _select(PHONE, "fidelity")
    assert faithful.name == "w8a8-xnnpack" and faithful.memory["fits"]
    assert faithful.memory["runtime_measured"] is None  # ExecuTorch's own memory: not measured here
    small = _with_ram(PHONE, faithful.memory["need_bytes"] - 1)
    chosen = _select(small, "fidelity")
    assert chosen.name == "w4a8-xnnpack" and chosen.memory["need_bytes"] <= small.ram_total_bytes
    assert "w8a8-xnnpack" in chosen.rationale and "next build that fits" in chosen.rationale
    assert _select(PHONE).name == "w4a8-xnnpack"


def test_a_build_that_fits_nowhere_is_refused_with_every_need():
    with pytest.raises(EdgepathError) as refused:
        _select(PHONE, "fidelity", model=QWEN_7B)
    message = str(refused.value)
    assert "w8a8-xnnpack needs" in message and "w4a8-xnnpack needs" in message
    assert "4.00 GiB of RAM" in message and "2048 tokens" in message


def test_a_cpu_short_of_memory_for_vllm_gets_llama_cpp_unless_the_target_asked_for_vllm():
    vllm = _select(AMX)
    assert vllm.spec.engine is weight_paths.Engine.VLLM
    short = _with_ram(AMX, vllm.memory["need_bytes"] - 1)
    chosen = _select(short)
    assert chosen.name == GGUF_PATH and chosen.memory["fits"] and vllm.name in chosen.rationale
    with pytest.raises(EdgepathError, match="rules out"):
        _select(short, engine="vllm")


def test_a_gpu_build_is_held_to_the_gpus_memory():
    m = _select(GPU).memory
    assert m["have"] == "GPU memory" and m["have_bytes"] == GPU.gpu_mem_bytes and m["runtime_measured"] is None
    with pytest.raises(EdgepathError, match="GPU memory"):
        _select(dataclasses.replace(GPU, gpu_mem_bytes=m["need_bytes"] - 1))


def test_a_model_record_without_the_attention_shape_is_refused():
    with pytest.raises(EdgepathError, match="num_attention_heads"):
        memory.ModelShape.from_record({"config": {"num_hidden_layers": 2}, "tensors": {}})


def test_a_targets_context_reaches_its_selection(default_model, tmp_path):
    """The real select command, its target read from a params file with a context."""
    profile = tmp_path / "profiles" / "phone.json"
    profile.parent.mkdir()
    profile.write_text(json.dumps({**records.envelope("profile"), **dataclasses.asdict(PHONE)}))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"model": {"source": "embedded"}, "targets": {"phone-4gb": {
        "profile": "profiles/phone.json", "priority": "fidelity", "platform": "auto", "context": 4096}}}))
    out = tmp_path / "sel.json"
    edgepath_command("select", "--target", "phone-4gb", "--params", str(params), "--profile", str(profile),
                     "--model", str(default_model / "model.json"), "--out", str(out))
    chosen = records.read(out, "selection")["path"]
    assert chosen["name"] == "w8a8-xnnpack" and chosen["memory"]["context"] == 4096 and chosen["memory"]["fits"]
