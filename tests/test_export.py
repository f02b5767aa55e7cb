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

from edgepath import export, records
from edgepath.errors import EdgepathError

from .conftest import edgepath_command, write_random_llama

# Small and fast: what is under test is the program, its record and its check, not the
# figures of a model that knows no language.
SMALL = {
    "qnn": {"window": 32, "samples": 4, "parity_windows": 2},
    "xnnpack": {"max_seq_len": 96, "check_tokens": 64, "greedy_tokens": 8, "decode_tokens": 16},
}


@pytest.fixture(scope="session")
def random_llama(default_model, tmp_path_factory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random-llama") / "hf", default_model / "hf")


def _params(directory: Path, **overrides) -> Path:
    settings = json.loads(json.dumps(SMALL))
    for section, values in overrides.items():
        settings[section].update(values)
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump({"export": settings}))
    return path


@pytest.fixture(scope="session")
def exported(random_llama, tmp_path_factory) -> dict[str, Path]:
    """Both paths exported once by the real CLI (``edgepath export``)."""
    work = tmp_path_factory.mktemp("exports")
    params = _params(work)
    out = {}
    for path in export.PATHS:
        out[path] = work / path
        edgepath_command("export", "--path", path, "--model", str(random_llama), "--params", str(params),
                         "--out", str(out[path]))
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
    from edgepath import calibration

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
    assert record["pte"]["state"] == "built"
    assert b"XnnpackBackend" in (exported["w4a8-xnnpack"] / "model.pte").read_bytes()


def test_xnnpack_pte_greedy_equals_the_eager_quantized_model(exported, random_llama):
    """Independently of the stage: load the .pte in ExecuTorch's runtime and a freshly
    quantized eager model, and decode a chat prompt with both."""
    from transformers import AutoTokenizer

    from edgepath.engines.executorch_runtime import PteDecoder
    from edgepath.phone import graph, xnnpack_8da4w
    from edgepath.prompts import chat_prompt_ids

    prompt = chat_prompt_ids(AutoTokenizer.from_pretrained(random_llama), "Why is the sky blue?")
    program = PteDecoder(exported["w4a8-xnnpack"] / "model.pte", 96)
    model = graph.load_reference(random_llama)
    xnnpack_8da4w.quantize(model, 32)
    eager = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False)[0, len(prompt):].tolist()
    assert program.greedy(prompt, 12) == eager
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    got = program.logits(prompt)
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95


def test_truncated_pte_is_refused(exported, tmp_path):
    from edgepath.engines.executorch_runtime import PteDecoder

    data = (exported["w4a8-xnnpack"] / "model.pte").read_bytes()
    (tmp_path / "model.pte").write_bytes(data[: len(data) // 2])
    with pytest.raises(EdgepathError, match="cannot load it"):
        PteDecoder(tmp_path / "model.pte", 96)


@pytest.mark.parametrize("path, section, change, message", [
    ("w4a8-xnnpack", "xnnpack", {"group_size": 48}, "does not divide"),
    ("w8a16-qnn", "qnn", {"soc": "SM0000"}, "not a Qualcomm SoC"),
    ("w4a8-xnnpack", "xnnpack", {"max_seq_len": 32}, "holds fewer positions"),
    ("w8a16-qnn", "qnn", {"colour": "blue"}, "export.qnn.colour: unknown key"),
    ("w8a16-qnn", "qnn", {"samples": "many"}, "export.qnn.samples: 'many' is not of type 'integer'"),
])
def test_bad_settings_are_refused_before_any_work(random_llama, tmp_path, path, section, change, message):
    params = _params(tmp_path, **{section: change})
    done = edgepath_command("export", "--path", path, "--model", str(random_llama), "--params", str(params),
                            "--out", str(tmp_path / "out"), check=False)
    assert done.returncode == 2 and message in done.stderr
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
    from edgepath import manifest, model
    from edgepath.profile import HardwareProfile
    from edgepath.select import select_weight_path, selection_record

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
    from edgepath import fleet

    from .conftest import ROOT

    params = ROOT / "params.yaml"
    settings = export.Settings.from_file(params)
    assert (settings.qnn, settings.xnnpack) == (export.QnnSettings(), export.XnnpackSettings())
    assert list(fleet.namespace(params, "export")["paths"]) == list(export.PATHS)
