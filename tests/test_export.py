"""The export stage for real (ExecuTorch, torchao, QNN's quantizer) on a 2-layer Llama
with random weights: the mechanics of both phone paths. The default model's export
and its figures belong to the pipeline and benchmarks/phone_calibration.py."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.stages import export

from .conftest import edgepath_command, write_random_llama

# Small and fast: what is under test is the program, its record and its check, not the
# figures of a model that knows no language.
SMALL = {
    "qnn": {"window": 32, "samples": 4, "parity_windows": 2},
    "xnnpack": {"max_seq_len": 96, "check_tokens": 64, "greedy_tokens": 8, "decode_tokens": 16, "prefill_tokens": 32,
                # a model with random weights has no preference to keep: its logits are near-uniform
                "min_top1_fp32": 0.0},
}
SMALL_CALIBRATION = {"samples": 8, "length": 64}
"""The XNNPACK program's GPTQ calibration (``calibration``'s samples and length)."""


@pytest.fixture(scope="session")
def random_llama(default_model, tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random-llama") / "hf", default_model / "hf")


def _params(directory: Path, **overrides) -> Path:
    settings = json.loads(json.dumps(SMALL))
    for section, values in overrides.items():
        settings[section].update(values)
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump({"export": settings, "calibration": SMALL_CALIBRATION}))
    return path


@pytest.fixture(scope="session")
def calibrated(random_llama, tmp_path_factory) -> Path:
    """The calibrate stage on the random model (``SMALL_CALIBRATION``): the Hessians the
    4-bit program's GPTQ reads."""
    work = tmp_path_factory.mktemp("calibration")
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump({"calibration": SMALL_CALIBRATION, "quantize": {"eval": {"windows": 1,
                                                                                               "length": 64}}}))
    edgepath_command("calibrate", "--model", str(random_llama), "--params", str(params), "--out", str(work / "out"))
    return work / "out"


@pytest.fixture(scope="session")
def exported(random_llama, calibrated, tmp_path_factory) -> dict[str, Path]:
    """Both paths exported once by the real CLI (``edgepath export``)."""
    work = tmp_path_factory.mktemp("exports")
    params = _params(work)
    out = {}
    for path in export.PATHS:
        out[path] = work / path
        edgepath_command("export", "--path", path, "--model", str(random_llama), "--params", str(params),
                         "--calibration", str(calibrated), "--out", str(out[path]))
    return out


def test_qnn_program_carries_its_calibration_and_parity(exported, random_llama):
    d = exported["w8a16-qnn"]
    record = records.read(d / "export.json", "export")
    calibration = record["calibration"]
    assert (calibration["corpus"], calibration["samples"], calibration["length"]) == ("mix", 4, 32)  # the default
    assert calibration["chat_samples"] == 1 and "persuasion" not in calibration["documents"]
    assert "real text" in calibration["inputs"]
    parity = record["parity"]
    assert parity["positions"] == 2 * 32 and parity["passed"] is True
    assert 0 <= parity["top1_agreement"] <= 1 and parity["kl_nats"] >= 0
    # the tokenizer and generation settings travel with the build
    names = {f["path"] for f in record["files"]}
    assert {"program.pt2", "tokenizer.json", "generation_config.json", "chat_template.jinja"} <= names
    assert record["generation"]["eos_token_id"] == json.loads((random_llama / "generation_config.json").read_text())[
        "eos_token_id"]
    for f in record["files"]:
        assert (d / f["path"]).stat().st_size == f["size"]


@pytest.mark.skipif(bool(os.environ.get("QNN_SDK_ROOT")), reason="a QNN SDK is installed: the .pte is lowered")
def test_qnn_pte_is_not_built_without_the_sdk_and_the_record_says_why(exported):
    record = records.read(exported["w8a16-qnn"] / "export.json", "export")
    assert record["pte"]["state"] == "not built" and "QNN_SDK_ROOT" in record["pte"]["detail"]
    assert not (exported["w8a16-qnn"] / "model.pte").exists()


@pytest.mark.skipif(not os.environ.get("QNN_SDK_ROOT"),
                    reason="lowering to a QNN .pte needs Qualcomm's QNN SDK (QNN_SDK_ROOT), which no registry "
                           "reachable here provides")
def test_qnn_pte_is_lowered_with_the_sdk(exported):
    record = records.read(exported["w8a16-qnn"] / "export.json", "export")
    assert record["pte"]["state"] == "built" and (exported["w8a16-qnn"] / "model.pte").stat().st_size > 0


def test_qnn_program_is_quantized_w8a16_and_is_the_program_measured(exported, random_llama):
    """The saved program has int8 per-channel weights and 16-bit activations, holds no
    fp32 copy of the weights, and reproduces the parity its record states."""
    from edgepath.phone import graph, qnn_w8a16
    from edgepath.text import calibration

    d = exported["w8a16-qnn"]
    program = qnn_w8a16.load(d / "program.pt2")
    quantize_ops = [n for n in program.graph.nodes if "quantize_per" in str(n.target)]
    channel = [n for n in quantize_ops if "per_channel" in str(n.target)]
    tensor = [n for n in quantize_ops if "per_tensor" in str(n.target)]
    assert channel and tensor
    assert {n.args[-1] for n in channel} == {torch.int8}  # weights
    assert {n.args[-1] for n in tensor} & {torch.uint16, torch.int16}  # 16-bit activations
    assert not {n.args[-1] for n in tensor} & {torch.uint8, torch.int8}  # and no 8-bit ones
    assert not list(program.parameters())  # the weights are the folded int8 constants only

    from transformers import AutoTokenizer

    record = records.read(d / "export.json", "export")
    tokenizer = AutoTokenizer.from_pretrained(random_llama)
    corpus = calibration.load_corpus("mix", [])
    windows = calibration.evaluation_set(tokenizer, corpus, 2, 32)
    measured = qnn_w8a16.parity(graph.load_reference(random_llama), program, windows)
    assert measured["top1_agreement"] == record["parity"]["top1_agreement"]
    assert measured["logit_sqnr_db"] == pytest.approx(record["parity"]["logit_sqnr_db"], abs=0.05)


def test_qnn_gate_refuses_and_leaves_the_previous_export(random_llama, exported, tmp_path):
    out = tmp_path / "w8a16-qnn"
    shutil.copytree(exported["w8a16-qnn"], out)
    before = (out / "export.json").read_text()
    params = _params(tmp_path, qnn={"min_sqnr_db": 200.0})
    done = edgepath_command("export", "--path", "w8a16-qnn", "--model", str(random_llama), "--params", str(params),
                            "--out", str(out), check=False)
    assert done.returncode == 2 and "below the gate" in done.stderr and "nothing was written" in done.stderr
    assert (out / "export.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left behind


def test_xnnpack_pte_runs_in_executorch_and_matches_its_eager_model(exported):
    record = records.read(exported["w4a8-xnnpack"] / "export.json", "export")
    check = record["runtime_check"]
    assert check["passed"] is True and check["threads"] == 2
    assert check["against_eager"]["top1_agreement"] >= 0.95
    assert check["greedy"]["prompts"] == 12 and check["decode_tok_s"]["median"] > 0
    assert check["prefill_tok_s"]["median"] > 0 and check["prefill"]["tokens"] == 32
    assert record["pte"]["state"] == "built"
    # against fp32: every held-out genre, the worst named, its own gate
    parity = record["parity"]
    assert set(parity["genres"]) == {"code", "dialogue", "docs", "lists", "prose"}
    assert parity["positions"] == 5 * 63 and parity["passed"] is True and parity["gate"] == {"min_top1": 0.0}
    assert parity["worst"]["top1_agreement"] == min(g["top1_agreement"] for g in parity["genres"].values())
    # the weights are GPTQ's, calibrated on the params' text
    weights = record["calibration"]["weights"]
    assert weights["algorithm"] == "gptq" and weights["signed"] is False and weights["search"] == "output-error"
    assert (record["calibration"]["samples"], record["calibration"]["length"]) == tuple(SMALL_CALIBRATION.values())
    program = (exported["w4a8-xnnpack"] / "model.pte").read_bytes()
    assert b"XnnpackBackend" in program
    # attention and the KV cache run in ExecuTorch's LLM ops
    assert b"llama::custom_sdpa" in program and b"llama::update_cache" in program


def test_w8a8_xnnpack_pte_holds_8bit_weights_and_passes_both_gates(exported, random_llama):
    record = records.read(exported["w8a8-xnnpack"] / "export.json", "export")
    check, parity = record["runtime_check"], record["parity"]
    assert check["passed"] is True and check["against_eager"]["top1_agreement"] >= 0.95
    assert parity["passed"] is True and set(parity["genres"]) == {"code", "dialogue", "docs", "lists", "prose"}
    calibration = record["calibration"]
    assert calibration["weights"]["algorithm"] == "round-to-nearest" and "samples" not in calibration
    assert "int8 per-channel weights in every linear" in record["program"]["precision"]
    program = (exported["w8a8-xnnpack"] / "model.pte").read_bytes()
    assert b"XnnpackBackend" in program and b"llama::custom_sdpa" in program
    # 8-bit weights with one scale per channel against 4 bits with one per 32: larger
    assert len(program) > (exported["w4a8-xnnpack"] / "model.pte").stat().st_size


def _eager_like_the_stage(random_llama, calibrated):
    """The random model quantized as the stage quantized it: from the same Hessians,
    with the same GPTQ settings and program layout."""
    from transformers import AutoTokenizer

    from edgepath.core import records
    from edgepath.phone import graph, xnnpack
    from edgepath.rules.fleet import Gptq
    from edgepath.stages.calibrate import SharedCalibration

    tokenizer = AutoTokenizer.from_pretrained(random_llama)
    model = graph.load_reference(random_llama)
    shared = SharedCalibration(calibrated, records.read(calibrated / "calibration.json", "calibration")["model"][
        "fingerprint"])
    gptq = Gptq()
    layers = xnnpack.quantize_8da4w(model, shared.hessians(), gptq.search, gptq.damp, gptq.group_order)
    return tokenizer, model, layers


def test_xnnpack_pte_greedy_equals_the_eager_quantized_model(exported, random_llama, calibrated):
    """Independently of the stage: load the .pte in ExecuTorch's runtime and a freshly
    quantized eager model, and decode a chat prompt with both."""
    from edgepath.engines.executorch_runtime import PteDecoder
    from edgepath.text.prompts import chat_prompt_ids

    tokenizer, model, layers = _eager_like_the_stage(random_llama, calibrated)
    # the 4-bit linears hold GPTQ's codes and scales unchanged; the rest is 8-bit
    assert set(layers) == {f"model.layers.{i}.{n}" for i in range(2)
                           for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                     "mlp.down_proj")}
    for prefix, q in layers.items():
        weight = model.get_submodule(prefix).weight
        assert torch.equal(weight.qdata.int() + 8, q.codes) and torch.equal(weight.scale, q.scales)
        assert torch.equal(weight.dequantize(), q.dequantize())
    for name in ("model.layers.0.self_attn.k_proj", "lm_head"):
        weight = model.get_submodule(name).weight
        assert weight.target_dtype == torch.int8 and weight.scale.shape[1] == 1  # per channel

    prompt = chat_prompt_ids(tokenizer, "Why is the sky blue?")
    program = PteDecoder(exported["w4a8-xnnpack"] / "model.pte", 96)
    eager = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False)[0, len(prompt):].tolist()
    assert program.greedy(prompt, 12) == eager
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    got = program.logits(prompt)
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95
    # a prompt prefilled in one call leaves the cache as token-by-token feeding does
    program.reset()
    assert torch.allclose(program.feed(prompt), got[-1], atol=1e-3 * got[-1].abs().max())


def test_xnnpack_fp32_gate_refuses_before_lowering(default_model, shared_calibration, tmp_path):
    # the real model: a random one's next token is its input token's own (the embedding
    # dominates its residual stream), which 4-bit weights need not change
    calibrated, _ = shared_calibration
    params = _params(tmp_path, xnnpack={"min_top1_fp32": 1.0})
    done = edgepath_command("export", "--path", "w4a8-xnnpack", "--model", str(default_model / "hf"), "--params",
                            str(params), "--calibration", str(calibrated), "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and "export.xnnpack.min_top1_fp32" in done.stderr
    assert "nothing was lowered or written" in done.stderr and "lowering to XNNPACK" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_programs_weights_are_counted_before_it_is_built(exported, random_llama):
    """The selector counts a program's weights from the model's shapes (``rules.memory``):
    the built .pte holds those and under 1 MiB of program besides."""
    from safetensors import safe_open

    from edgepath.rules import memory, weight_paths

    with safe_open(random_llama / "model.safetensors", "pt") as f:
        tensors = {name: {"shape": f.get_slice(name).get_shape()} for name in f.keys()}
    shape = memory.ModelShape.from_record({"config": json.loads((random_llama / "config.json").read_text()),
                                           "tensors": tensors})
    for path in ("w4a8-xnnpack", "w8a8-xnnpack"):
        spec = weight_paths.get(path)
        counted = memory.weights_bytes(spec, spec.group_size(None)[0], shape)
        assert 0 <= (exported[path] / "model.pte").stat().st_size - counted < 2**20, path


def test_truncated_pte_is_refused(exported, tmp_path):
    from edgepath.engines.executorch_runtime import PteDecoder

    data = (exported["w4a8-xnnpack"] / "model.pte").read_bytes()
    (tmp_path / "model.pte").write_bytes(data[: len(data) // 2])
    with pytest.raises(EdgepathError, match="cannot load it"):
        PteDecoder(tmp_path / "model.pte", 96)


@pytest.mark.parametrize("path, section, change, message", [
    ("w4a8-xnnpack", "xnnpack", {"group_size": 32}, "export.xnnpack.group_size: unknown key"),
    ("w8a16-qnn", "qnn", {"soc": "SM0000"}, "not a Qualcomm SoC"),
    ("w4a8-xnnpack", "xnnpack", {"max_seq_len": 32}, "holds fewer positions"),
    ("w8a16-qnn", "qnn", {"colour": "blue"}, "export.qnn.colour: unknown key"),
    ("w8a16-qnn", "qnn", {"samples": "many"}, "export.qnn.samples: 'many' is not of type 'integer'"),
])
def test_bad_settings_are_refused_before_any_work(random_llama, calibrated, tmp_path, path, section, change,
                                                  message):
    params = _params(tmp_path, **{section: change})
    done = edgepath_command("export", "--path", path, "--model", str(random_llama), "--params", str(params),
                            "--calibration", str(calibrated), "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and message in done.stderr
    assert not (tmp_path / "out").exists()


def test_xnnpack_refuses_widths_its_group_does_not_divide():
    info = {"config": {"hidden_size": 48, "intermediate_size": 128}}
    with pytest.raises(EdgepathError, match=r"widths \[48\] are not multiples of XNNPACK's 4-bit weight group"):
        export.check_path("w4a8-xnnpack", export.Settings(), info, shared=None)


def test_the_4bit_program_needs_the_calibrate_stages_output_of_its_own_model(random_llama, calibrated, tmp_path,
                                                                               default_model):
    params = _params(tmp_path)
    done = edgepath_command("export", "--path", "w4a8-xnnpack", "--model", str(random_llama), "--params", str(params),
                            "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and "reads the calibrate stage's Hessians: pass --calibration" in done.stderr
    done = edgepath_command("export", "--path", "w4a8-xnnpack", "--model", str(default_model / "hf"), "--params",
                            str(params), "--calibration", str(calibrated), "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and "calibrated another model" in done.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_path_and_missing_tokenizer_are_refused(random_llama, tmp_path):
    done = edgepath_command("export", "--path", "w4a16-tinygemm", "--model", str(random_llama),
                            "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and "is not built by the export stage" in done.stderr
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(random_llama, broken)
    (broken / "tokenizer.json").unlink()
    done = edgepath_command("export", "--path", "w8a16-qnn", "--model", str(broken),
                            "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and "tokenizer" in done.stderr
    assert not (tmp_path / "out").exists()


def test_manifest_gives_a_qnn_phone_its_program_and_meanwhile_the_cpu_build(exported, random_llama, tmp_path):
    """The manifest's view of both phones, from the real export records."""
    from edgepath.rules.profile import HardwareProfile
    from edgepath.rules.select import select_weight_path
    from edgepath.stages import manifest, model
    from edgepath.stages.select import selection_record

    from .conftest import ROOT

    model_record = model.run(tmp_path / "model", source=str(random_llama))
    exports = tmp_path / "build" / "exports"
    for path, d in exported.items():
        shutil.copytree(d, exports / path)

    def target(name: str) -> dict:
        profile = HardwareProfile.from_json((ROOT / "profiles" / f"{name}.json").read_text())
        selection = selection_record(name, "speed", "linux/amd64", profile, model_record["fingerprint"],
                                     select_weight_path(profile))
        record = manifest.export_record(selection, exports, model_record)
        built = manifest._build(selection, model_record, tmp_path / "model", tmp_path / "build" / "weights",
                                record, exports, tmp_path)
        summary = manifest._export_summary(selection, record, exports, model_record, tmp_path)
        return {"build": built, "export": summary,
                "verification": manifest._verification(selection, tmp_path / "verify", summary, [], tmp_path)}

    npu = target("phone-npu")
    (state, detail), artifacts = (npu["build"][0]["state"], npu["build"][0]["detail"]), npu["build"][1]
    assert state == "built" and ".pte not built: QNN_SDK_ROOT" in detail and "calibrated on 4 x 32" in detail
    assert {a["path"] for a in artifacts} >= {"build/exports/w8a16-qnn/program.pt2",
                                               "build/exports/w8a16-qnn/export.json"}
    fallback = npu["export"]["fallback"]
    assert fallback["path"] == "w4a8-xnnpack" and fallback["state"] == "built"
    assert "build/exports/w4a8-xnnpack/model.pte" in {a["path"] for a in fallback["artifacts"]}
    assert npu["verification"]["state"] == "not run here" and npu["verification"]["verified"] is False

    cpu = target("phone-cpu")
    assert cpu["build"][0]["state"] == "built" and "fallback" not in cpu["export"]
    assert cpu["verification"]["state"] == "checked off-device" and cpu["verification"]["verified"] is False
    assert "no phone ran it" in cpu["verification"]["detail"]

    # an export of another model is refused, naming the stage to re-run
    record = json.loads((exports / "w4a8-xnnpack" / "export.json").read_text())
    record["model"]["fingerprint"] = "sha256:" + "0" * 64
    (exports / "w4a8-xnnpack" / "export.json").write_text(json.dumps(record))
    with pytest.raises(EdgepathError, match="re-run export@w4a8-xnnpack"):
        target("phone-cpu")


def test_default_settings_are_params_yaml():
    from edgepath.rules import fleet

    from .conftest import ROOT

    params = ROOT / "params.yaml"
    settings = export.Settings.from_file(params)
    assert (settings.qnn, settings.xnnpack) == (export.QnnSettings(), export.XnnpackSettings())
    assert settings.gptq == fleet.Gptq() and settings.calibration == fleet.Calibration()


def test_the_shipped_fleet_builds_every_program_its_phones_run():
    """export.paths holds each phone's selected program and its fallback, and no more."""
    from edgepath.rules import fleet
    from edgepath.rules.profile import HardwareProfile
    from edgepath.rules.select import select_weight_path

    from .conftest import ROOT

    params = ROOT / "params.yaml"
    needed = set()
    for target in fleet.load(params).targets.values():
        if target.profile == "probe":  # this build host: a CPU, whose builds are quantize's
            continue
        path = select_weight_path(HardwareProfile.from_json((ROOT / target.profile).read_text()), target.priority,
                                  engine=target.engine)
        if path.spec.built_by is export.Stage.EXPORT:
            needed |= {path.name, *([path.spec.fallback] if path.spec.fallback else [])}
    assert set(fleet.namespace(params, "export")["paths"]) == needed
