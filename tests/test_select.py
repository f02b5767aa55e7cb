import dataclasses

import pytest

from edgepath import probe, shapes
from edgepath.errors import EdgepathError
from edgepath.profile import HardwareProfile
from edgepath.select import has_amx, select_weight_path

from .conftest import HOSTS

AMX = HardwareProfile(arch="x86_64", cpu_model="Xeon", cpu_flags=["avx512f", "amx_tile", "amx_bf16", "amx_int8"])
AVX2 = HardwareProfile(arch="x86_64", cpu_model="Ryzen", cpu_flags=["avx2"])
ARM = HardwareProfile(arch="aarch64", cpu_model="Neoverse-V1", cpu_flags=["neon", "bf16", "sve"])
PHONE = HardwareProfile(arch="aarch64", accelerator="npu:qualcomm", npu_driver="fastrpc",
                        kernel_release="6.1.57-android14-11")
GPU = HardwareProfile(arch="x86_64", accelerator="cuda_discrete", gpu_name="NVIDIA L4", supports_bf16=True)
OLD_GPU = HardwareProfile(arch="x86_64", accelerator="cuda_discrete", gpu_name="Tesla T4", supports_bf16=False)
JETSON = HardwareProfile(arch="aarch64", accelerator="cuda_unified", gpu_name="Orin", supports_bf16=True)

# SmolLM2-135M's decoder linears: input sizes 576 and 1536.
SMOLLM2 = {
    "model.layers.0.self_attn.q_proj.weight": (576, 576),
    "model.layers.0.self_attn.k_proj.weight": (192, 576),
    "model.layers.0.mlp.down_proj.weight": (576, 1536),
}


def test_amx_speed_gets_w4a8_gptq():
    p = select_weight_path(AMX, "speed")
    assert (p.name, p.quantization, p.runs_in_vllm, p.verified) == ("w4a8-amx", "gptq", True, True)
    assert p.as_engine_kwargs() == {"quantization": "gptq"}
    assert p.as_engine_env() == {"VLLM_CPU_INT4_W4A8": "1"}
    assert p.activations.startswith("int8")
    assert p.fused_cpu_norms is False


@pytest.mark.parametrize("profile, priority", [(AMX, "fidelity"), (AVX2, "speed"), (AVX2, "fidelity")])
def test_x86_without_amx_or_fidelity_gets_w4a16(profile, priority):
    p = select_weight_path(profile, priority)
    assert (p.name, p.quantization, p.activations) == ("w4a16-tinygemm", "cpu_int4", "bfloat16")
    assert p.as_engine_kwargs() == {"quantization": "cpu_int4"}
    assert p.as_engine_env() == {"VLLM_CPU_INT4_W4A8": "0"}


def test_arm_gets_unverified_bf16_activation_4bit():
    p = select_weight_path(ARM)
    assert p.quantization == "cpu_int4" and p.activations == "bfloat16"
    assert p.verified is False
    assert "Arm" in p.rationale
    assert any(n.startswith("unverified") for n in p.notes)


def test_phone_npu_gets_calibrated_export():
    p = select_weight_path(PHONE)
    assert p.name == "w8a16-qnn" and p.activations.startswith("int16")
    assert p.quantization is None and p.runs_in_vllm is False and p.as_engine_kwargs() == {}
    assert "export" in p.build_with
    assert any("calibrat" in n and "real" in n for n in p.notes)
    assert p.fallback == "w4a8-xnnpack" and any("QNN_SDK_ROOT" in n for n in p.notes)


@pytest.mark.parametrize("change, why", [
    ({"accelerator": "none", "npu_driver": None}, "no NPU"),
    ({"accelerator": "npu:mediatek"}, "not one edgepath's QNN export"),
    ({"npu_driver": None}, "not one edgepath's QNN export"),
])
def test_phone_without_a_usable_npu_gets_the_xnnpack_export(change, why):
    p = select_weight_path(dataclasses.replace(PHONE, **change))
    assert (p.name, p.runs_in_vllm, p.fallback, p.group_size) == ("w4a8-xnnpack", False, None, 32)
    assert why in p.rationale and "phone" in p.rationale


def test_an_arm_cpu_without_npu_or_android_kernel_is_no_phone():
    server = dataclasses.replace(PHONE, accelerator="none", npu_driver=None, kernel_release="6.1.0-1009-aws")
    assert select_weight_path(server).name == "w4a16-tinygemm"


@pytest.mark.parametrize("profile, name, dtype", [(GPU, "bf16", "bfloat16"), (OLD_GPU, "fp16", "float16"),
                                                 (JETSON, "bf16", "bfloat16")])
def test_gpu_runs_unquantized(profile, name, dtype):
    p = select_weight_path(profile, "speed")
    assert (p.name, p.quantization, p.fused_cpu_norms) == (name, None, False)
    assert p.as_engine_kwargs() == {"dtype": dtype}
    assert select_weight_path(profile, "fidelity").name == name


def test_accelerator_decides_before_the_cpu():
    gpu_on_amx = dataclasses.replace(AMX, accelerator="cuda_discrete", gpu_name="H200", supports_bf16=True)
    assert select_weight_path(gpu_on_amx).name == "bf16"


def test_has_amx_only_on_x86():
    assert has_amx(AMX)
    assert has_amx(HardwareProfile(arch="x86_64", cpu_flags=["amx_bf16"]))
    assert not has_amx(AVX2)
    assert not has_amx(HardwareProfile(arch="aarch64", cpu_flags=["amx_tile", "amx_bf16"]))


def test_has_amx_respects_torch_check_that_denies_it():
    denied = dataclasses.replace(AMX, torch_amx_tile_supported=False)
    assert not has_amx(denied)
    assert select_weight_path(denied).name == "w4a16-tinygemm"


def test_unknown_priority_is_refused():
    with pytest.raises(EdgepathError, match="priority 'fast'"):
        select_weight_path(AMX, "fast")


def test_unknown_architecture_is_refused():
    with pytest.raises(EdgepathError, match="riscv64"):
        select_weight_path(HardwareProfile(arch="riscv64"))


@pytest.mark.parametrize("profile", [AMX, AVX2, ARM, PHONE, GPU, OLD_GPU])
def test_every_rationale_is_a_sentence_about_this_device(profile):
    p = select_weight_path(profile)
    assert p.rationale[0].isupper() and p.rationale.endswith(".") and len(p.rationale.split()) > 12
    assert (profile.gpu_name or profile.cpu_model or profile.accelerator.split(":")[-1]) in p.rationale


def test_group_size_from_model_shapes():
    p = select_weight_path(AMX, linears=SMOLLM2)
    assert p.group_size == 64  # 576 is not a multiple of 128
    assert p.bits_per_weight == pytest.approx(4 + 20 / 64)
    assert any("576" in n and "64" in n for n in p.notes)
    wide = {n: (o, k * 2) for n, (o, k) in SMOLLM2.items() if "down" not in n}
    assert select_weight_path(AMX, linears=wide).group_size == 128


def test_shapes_no_kernel_accepts_are_refused_naming_the_layer():
    odd_out = {**SMOLLM2, "model.layers.3.self_attn.v_proj.weight": (200, 576)}
    with pytest.raises(EdgepathError, match=r"model\.layers\.3\.self_attn\.v_proj\.weight"):
        select_weight_path(AMX, linears=odd_out)
    odd_in = {"model.layers.0.mlp.down_proj.weight": (576, 1552)}  # 1552 = 16 * 97
    with pytest.raises(EdgepathError, match="down_proj"):
        select_weight_path(AVX2, linears=odd_in)


def test_block_linears_skip_embeddings_norms_and_head():
    tensors = {
        "model.embed_tokens.weight": [49152, 576], "lm_head.weight": [49152, 576],
        "model.layers.0.input_layernorm.weight": [576],
        "model.layers.0.mlp.up_proj.weight": [1536, 576],
    }
    assert shapes.block_linears(tensors) == {"model.layers.0.mlp.up_proj.weight": (1536, 576)}


@pytest.mark.parametrize("host, name", [
    ("xeon-8480c-8vcpu", "w4a8-amx"), ("ryzen-5800x-desktop", "w4a16-tinygemm"),
    ("amd-epyc-zen4-2vcpu", "w4a16-tinygemm"), ("graviton3-16vcpu", "w4a16-tinygemm"),
    ("snapdragon-8gen3-phone", "w8a16-qnn"), ("epyc-l4-gpu", "bf16"),
])
def test_probed_snapshots_select_their_paths(host, name):
    assert select_weight_path(probe.probe(HOSTS / host)).name == name
