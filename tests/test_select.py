import dataclasses

import pytest

from edgepath.core.errors import EdgepathError
from edgepath.rules import coverage, select, shapes, weight_paths
from edgepath.rules.coverage import has_amx
from edgepath.rules.profile import HardwareProfile
from edgepath.rules.select import AUTO, GGUF_PATH, select_weight_path
from edgepath.stages import probe

from .conftest import HOSTS

AMX = HardwareProfile(arch="x86_64", cpu_model="Xeon", cpu_flags=["avx512f", "amx_tile", "amx_bf16", "amx_int8"])
AVX2 = HardwareProfile(arch="x86_64", cpu_model="Ryzen", cpu_flags=["avx2"])
ARM = HardwareProfile(arch="aarch64", cpu_model="Neoverse-V1", cpu_flags=["neon", "bf16", "sve"])
PHONE = HardwareProfile(arch="aarch64", accelerator="npu:qualcomm", npu_driver="fastrpc",
                        kernel_release="6.1.57-android14-11")
GPU = HardwareProfile(arch="x86_64", accelerator="cuda_discrete", gpu_name="NVIDIA L4", supports_bf16=True)
OLD_GPU = HardwareProfile(arch="x86_64", accelerator="cuda_discrete", gpu_name="Tesla T4", supports_bf16=False)
JETSON = HardwareProfile(arch="aarch64", accelerator="cuda_unified", gpu_name="Orin", supports_bf16=True)
# CPUs of the kernel ISA tiers edgepath's builds were measured on (``HardwareProfile.kernel_isa``)
AVX2_TIER = HardwareProfile(arch="x86_64", cpu_model="EPYC 7B13", cpu_flags=["avx2", "fma"])
ZEN4_TIER = HardwareProfile(arch="x86_64", cpu_model="EPYC 9B14", cpu_flags=[
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"])

# SmolLM2-135M's decoder linears: input sizes 576 and 1536.
SMOLLM2 = {
    "model.layers.0.self_attn.q_proj.weight": (576, 576),
    "model.layers.0.self_attn.k_proj.weight": (192, 576),
    "model.layers.0.mlp.down_proj.weight": (576, 1536),
}


def test_amx_speed_gets_w4a8_gptq():
    p = select_weight_path(AMX, "speed", engine="vllm")
    assert (p.name, p.spec.quantization, p.spec.engine) == ("w4a8-gptq", "gptq", weight_paths.Engine.VLLM)
    assert p.as_engine_kwargs() == {"quantization": "gptq"}
    assert p.as_engine_env() == {"VLLM_CPU_INT4_W4A8": "1"}
    assert p.spec.activations.startswith("int8")
    assert p.spec.fused_cpu_norms is False


@pytest.mark.parametrize("profile, priority", [(AMX, "fidelity"), (AVX2, "speed"), (AVX2, "fidelity")])
def test_x86_without_amx_or_fidelity_gets_w4a16_in_vllm(profile, priority):
    p = select_weight_path(profile, priority, engine="vllm")
    assert (p.name, p.spec.quantization, p.spec.activations) == ("w4a16-tinygemm", "cpu_int4", "bfloat16")
    assert p.as_engine_kwargs() == {"quantization": "cpu_int4"}
    assert p.as_engine_env() == {"VLLM_CPU_INT4_W4A8": "0"}


def test_arm_gets_bf16_activation_4bit_in_vllm_and_says_its_kernel_differs():
    p = select_weight_path(ARM, engine="vllm")
    assert p.spec.quantization == "cpu_int4" and p.spec.activations == "bfloat16"
    assert "Arm" in p.rationale and "different kernel" in p.rationale
    # whether it is verified is the manifest's, from records; the selection claims nothing
    assert "verified" not in p.to_dict() and not any("verified" in n for n in p.notes)


def test_phone_npu_gets_calibrated_export():
    p = select_weight_path(PHONE)
    assert p.name == "w8a16-qnn" and p.spec.activations.startswith("int16")
    assert p.spec.quantization is None and p.spec.engine is weight_paths.Engine.EXECUTORCH
    assert p.as_engine_kwargs() == {} and p.spec.built_by is weight_paths.Stage.EXPORT
    assert any("calibrat" in n and "real" in n for n in p.notes)
    assert p.spec.fallback == "w4a8-xnnpack" and any("QNN_SDK_ROOT" in n for n in p.notes)


def test_a_qualcomm_npu_without_driver_information_gets_the_calibrated_export():
    """A hand-written profile that says nothing of the driver is no evidence that it is
    missing: the device gets the QNN program, and its notes carry the calibration lesson."""
    p = select_weight_path(dataclasses.replace(PHONE, npu_driver=None))
    assert p.name == "w8a16-qnn" and "no driver information" in p.rationale
    assert any("calibrat" in n.lower() for n in p.notes)


@pytest.mark.parametrize("change, why", [
    ({"accelerator": "none", "npu_driver": None}, "no NPU"),
    ({"accelerator": "npu:mediatek"}, "not one edgepath's QNN export"),
    ({"npu_driver": coverage.NO_NPU_DRIVER}, "found no driver"),
])
def test_phone_without_a_usable_npu_gets_the_xnnpack_export(change, why):
    p = select_weight_path(dataclasses.replace(PHONE, **change))
    assert p.name in select.PHONE_CPU_PROGRAMS and (p.spec.engine, p.spec.fallback) == (weight_paths.Engine.EXECUTORCH,
                                                                                       None)
    assert p.group_size == p.spec.fixed_group
    assert why in p.rationale and "phone" in p.rationale


def test_a_phone_cpu_program_is_chosen_by_its_measured_fidelity_and_speed(monkeypatch):
    """For speed the fastest program measured at or above the fidelity floor, for fidelity
    the most faithful; the rationale cites both programs' figures."""
    phone = dataclasses.replace(PHONE, accelerator="none", npu_driver=None)
    measured = {name: weight_paths.get(name).program for name in select.PHONE_CPU_PROGRAMS}
    faithful = max(measured, key=lambda n: measured[n].top1_vs_fp32)
    passing = [n for n, m in measured.items() if m.top1_vs_fp32 >= select.PHONE_MIN_TOP1]
    fast = max(passing, key=lambda n: measured[n].decode_tok_s) if passing else faithful
    speed, fidelity = select_weight_path(phone, "speed"), select_weight_path(phone, "fidelity")
    assert (speed.name, fidelity.name) == (fast, faithful)
    for p in (speed, fidelity):
        assert all(f"{m.top1_vs_fp32:.3f}" in p.rationale and f"{m.decode_tok_s:.1f} tok/s" in p.rationale
                   for m in measured.values())
    # a 4-bit program measured below the floor is not chosen for speed
    spec = weight_paths.get("w4a8-xnnpack")
    monkeypatch.setitem(weight_paths.PATHS, "w4a8-xnnpack", dataclasses.replace(
        spec, program=dataclasses.replace(spec.program, top1_vs_fp32=select.PHONE_MIN_TOP1 - 0.01)))
    assert select_weight_path(phone, "speed").name == "w8a8-xnnpack"


def test_an_arm_cpu_without_npu_or_android_kernel_is_no_phone():
    server = dataclasses.replace(PHONE, accelerator="none", npu_driver=None, kernel_release="6.1.0-1009-aws")
    assert select_weight_path(server, engine="vllm").name == "w4a16-tinygemm"


@pytest.mark.parametrize("profile, name, dtype", [(GPU, "bf16", "bfloat16"), (OLD_GPU, "fp16", "float16"),
                                                 (JETSON, "bf16", "bfloat16")])
def test_gpu_runs_unquantized(profile, name, dtype):
    p = select_weight_path(profile, "speed")
    assert (p.name, p.spec.quantization, p.spec.fused_cpu_norms) == (name, None, False)
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
    assert select_weight_path(denied, engine="vllm").name == "w4a16-tinygemm"


def test_unknown_priority_is_refused():
    with pytest.raises(EdgepathError, match="priority 'fast'"):
        select_weight_path(AMX, "fast")


def test_unknown_architecture_is_refused():
    with pytest.raises(EdgepathError, match="riscv64"):
        select_weight_path(HardwareProfile(arch="riscv64"))


@pytest.mark.parametrize("profile, engine", [
    *((p, AUTO) for p in (AMX, AVX2, AVX2_TIER, ZEN4_TIER, ARM, PHONE, GPU, OLD_GPU)),
    *((p, e) for p in (AMX, AVX2_TIER, ZEN4_TIER, ARM) for e in ("vllm", "llama.cpp"))])
def test_every_rationale_is_a_sentence_about_this_device(profile, engine):
    p = select_weight_path(profile, engine=engine)
    assert p.rationale[0].isupper() and p.rationale.endswith(".") and len(p.rationale.split()) > 12
    assert (profile.gpu_name or profile.cpu_model or profile.accelerator.split(":")[-1]) in p.rationale


def test_group_size_from_model_shapes():
    w4a8 = select_weight_path(AMX, linears=SMOLLM2)
    assert w4a8.group_size == 32  # the W4A8 path's only group: it lost less than 64 (shapes.GPTQ_CPU)
    assert w4a8.bits_per_weight == pytest.approx(4 + 20 / 32)
    assert any("group size 32" in n and "9.60 %" in n for n in w4a8.notes)
    tinygemm = select_weight_path(AVX2, linears=SMOLLM2, engine="vllm")
    assert tinygemm.group_size == 64  # its first preference, 128, does not divide 576
    assert any("576" in n and "128 does not divide" in n for n in tinygemm.notes)
    wide = {n: (o, k * 2) for n, (o, k) in SMOLLM2.items() if "down" not in n}
    assert select_weight_path(AVX2, linears=wide, engine="vllm").group_size == 128
    assert select_weight_path(AMX, linears=wide).group_size == 32


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


@pytest.mark.parametrize("host, in_vllm", [
    ("xeon-8480c-8vcpu", "w4a8-gptq"), ("ryzen-5800x-desktop", "w4a16-tinygemm"),
    ("amd-epyc-zen4-2vcpu", "w4a8-gptq"), ("graviton3-16vcpu", "w4a16-tinygemm"),
])
def test_probed_cpu_snapshots_select_their_paths(host, in_vllm):
    profile = probe.probe(HOSTS / host)
    assert select_weight_path(profile, engine="vllm").name == in_vllm
    assert select_weight_path(profile, engine="llama.cpp").name == GGUF_PATH
    measured = [weight_paths.get(n).decode_on(profile.kernel_isa()) for n in (in_vllm, GGUF_PATH)]
    faster = in_vllm if None in measured or measured[0].vs_q4_k_m >= measured[1].vs_q4_k_m else GGUF_PATH
    assert select_weight_path(profile).name == faster


@pytest.mark.parametrize("host, name", [("snapdragon-8gen3-phone", "w8a16-qnn"), ("epyc-l4-gpu", "bf16")])
def test_probed_accelerator_snapshots_select_their_paths(host, name):
    assert select_weight_path(probe.probe(HOSTS / host)).name == name


@pytest.mark.parametrize("profile", [AMX, AVX2_TIER, ZEN4_TIER, ARM, PHONE, dataclasses.replace(PHONE, accelerator="none")])
def test_engine_llama_cpp_gives_a_cpu_or_a_phone_cpu_the_gguf(profile):
    p = select_weight_path(profile, "speed", linears=SMOLLM2, engine="llama.cpp")
    assert (p.name, p.spec.engine, p.group_size, p.as_engine_kwargs()) == (GGUF_PATH, weight_paths.Engine.LLAMA_CPP,
                                                                          32, {})
    assert "asks for llama.cpp" in p.rationale and profile.kernel_isa() in p.rationale
    measured = p.spec.decode_on(profile.kernel_isa())
    assert (str(measured) in p.rationale) if measured else "no build of it was measured" in p.rationale


@pytest.mark.parametrize("profile, engine", [(GPU, "llama.cpp"), (GPU, "executorch"), (PHONE, "vllm"),
                                             (AMX, "executorch"), (ARM, "executorch")])
def test_an_engine_the_device_cannot_run_is_refused(profile, engine):
    with pytest.raises(EdgepathError, match=f"engine '{engine}'.*it can have"):
        select_weight_path(profile, engine=engine)


def test_an_unknown_engine_is_refused():
    with pytest.raises(EdgepathError, match="unknown engine 'tgi'; choose one of auto, vllm, llama.cpp, executorch"):
        select_weight_path(AMX, engine="tgi")


@pytest.mark.parametrize("profile", [AMX, AVX2_TIER, ZEN4_TIER, ARM])
@pytest.mark.parametrize("priority", ["speed", "fidelity"])
def test_auto_takes_the_build_measured_better_for_the_priority_or_keeps_vllms(profile, priority):
    """On a CPU, auto compares vLLM's path with the GGUF by the registry's measurements:
    decode on the CPU's tier for speed, held-out perplexity for fidelity; where either
    was not measured it keeps vLLM's path and says so. The rationale cites both figures."""
    vllm, gguf = (select_weight_path(profile, priority, engine=e) for e in ("vllm", "llama.cpp"))
    tier = profile.kernel_isa()
    if priority == "speed":
        figures = [vllm.spec.decode_on(tier), gguf.spec.decode_on(tier)]
        merit = [f.vs_q4_k_m if f else None for f in figures]
    else:
        figures = [vllm.spec.held_out, gguf.spec.held_out]
        merit = [-f.mean_increase_pct if f else None for f in figures]
    chosen = select_weight_path(profile, priority)
    if None in merit:
        assert chosen.name == vllm.name and chosen.rationale == vllm.rationale
        assert "engine auto" in chosen.notes[-1] and "not measured" in chosen.notes[-1]
    elif merit[1] > merit[0]:
        assert chosen.name == GGUF_PATH and "engine is auto" in chosen.rationale
        assert str(figures[0]) in chosen.rationale and str(figures[1]) in chosen.rationale
    else:
        assert chosen.name == vllm.name and str(figures[1]) in chosen.notes[-1]


def test_auto_has_a_measured_choice_on_the_tiers_the_builds_were_measured_on():
    """The registry holds both builds' decode on the AVX2 and Zen 4 tiers, so auto decides
    there by measurement (not by the fallback), and both builds' held-out fidelity."""
    for profile in (AVX2_TIER, ZEN4_TIER):
        assert weight_paths.get("w4a16-tinygemm").decode_on(profile.kernel_isa()) is not None
        assert weight_paths.get(GGUF_PATH).decode_on(profile.kernel_isa()) is not None
        assert not any("not measured" in n for n in select_weight_path(profile).notes)
    assert weight_paths.get("w4a16-tinygemm").held_out and weight_paths.get(GGUF_PATH).held_out


@pytest.mark.parametrize("profile", [PHONE, GPU])
def test_auto_keeps_a_phones_program_and_a_gpus_vllm(profile):
    assert select_weight_path(profile).name == select_weight_path(
        profile, engine="executorch" if profile is PHONE else "vllm").name


def test_every_registry_path_is_consistent():
    """Each record's preconditions hold (asserted on construction) and what the stages
    derive from it agrees: the kernel op of a vLLM CPU checkpoint, the builder stage."""
    for name, spec in weight_paths.PATHS.items():
        assert spec.name == name
        if spec.built_by is weight_paths.Stage.QUANTIZE:
            assert spec.group_rule is not None and spec.verifiable_by_patch_verify
            if spec.engine is weight_paths.Engine.VLLM:
                assert spec.kernel is not None and spec.kernel.op.count("::") == 1
            else:  # a GGUF for llama.cpp: no vLLM kernel
                assert spec.engine is weight_paths.Engine.LLAMA_CPP and spec.kernel is None
                assert spec.checkpoint_format == "gguf" and spec.group_rule.group_sizes == (32,)
        if spec.fallback is not None:
            assert weight_paths.get(spec.fallback).built_by is spec.built_by
    assert weight_paths.get("w4a8-gptq").kernel.op == "_C::int4_scaled_mm_cpu"
    assert weight_paths.get("w4a16-tinygemm").kernel.op == "edgepath::int4_mm"
    with pytest.raises(EdgepathError, match="unknown weight path 'w9'"):
        weight_paths.get("w9")
    with pytest.raises(EdgepathError, match="not built by the quantize stage"):
        weight_paths.require("w8a16-qnn", weight_paths.Stage.QUANTIZE)


def test_selection_records_name_engine_and_builder_not_prose():
    for profile, engine in [(p, AUTO) for p in (AMX, AVX2, ZEN4_TIER, ARM, PHONE, GPU)] + [(ARM, "llama.cpp")]:
        d = select_weight_path(profile, engine=engine).to_dict()
        spec = weight_paths.get(d["name"])
        assert (d["engine"], d["built_by"]) == (spec.engine.value, spec.built_by.value)
        assert d["runs_in_vllm"] == (spec.engine is weight_paths.Engine.VLLM)


@pytest.mark.parametrize("flags, runs", [
    (["avx512f", "amx_tile", "amx_bf16", "amx_int8"], True),   # AMX tiles
    (ZEN4_TIER.cpu_flags, True),                                 # Zen 4: VNNI, the gate lifted
    # Cascade Lake: VNNI, but vLLM loads its AVX512 kernel build, which has no int4_scaled_mm_cpu
    ([f for f in ZEN4_TIER.cpu_flags if f != "avx512_bf16"], False),
    ([f for f in ZEN4_TIER.cpu_flags if f != "avx512_vnni"], False),
    (["avx2", "fma"], False),
])
def test_w4a8_runs_where_amx_or_vnni_with_its_kernel_build_is(flags, runs):
    host = HardwareProfile(arch="x86_64", cpu_flags=flags)
    assert (coverage.w4a8_unsupported(host) is None) == runs


def test_a_run_stands_for_targets_of_its_kernel_tier_only():
    amx, avx2 = AMX.summary(), AVX2.summary()
    assert coverage.why_host_does_not_stand_for(amx, amx) is None
    assert "selects other kernels" in coverage.why_host_does_not_stand_for(avx2, amx)
    assert "lacks" in coverage.why_host_does_not_stand_for(avx2, GPU.summary())
