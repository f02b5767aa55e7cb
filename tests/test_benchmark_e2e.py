"""The benchmark stage in the session's one `dvc repro` (``pipeline``): the host's build
against vLLM bf16 and llama.cpp, for real, and what the manifest and DVC make of it."""

import json
import subprocess

import pytest

from edgepath.core import records
from edgepath.rules import coverage
from edgepath.rules.select import select_weight_path
from edgepath.stages import probe

from .conftest import run_checked

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bench(pipeline):
    dest, env, _ = pipeline
    return dest, env, records.read(dest / "build/benchmark/benchmark.json", "benchmark")


def test_every_arm_was_measured_interleaved_with_its_spread(bench):
    _, _, record = bench
    arms = {a["name"]: a for a in record["arms"]}
    assert set(arms) >= {"w4a16-tinygemm", "vllm bf16", "llama.cpp Q4_K_M", "llama.cpp Q4_0", "llama.cpp Q4_0-imatrix",
                         "llama.cpp F16"}
    for a in arms.values():
        for metric in ("decode_tok_s", "prefill_tok_s"):
            spread = a[metric]
            assert len(spread["samples"]) == 3 and spread["min"] <= spread["median"] <= spread["max"]
        assert 0 < a["memory"]["rss_anon_after_start_bytes"] <= a["memory"]["rss_anon_peak_bytes"]
        assert a["start"]["cold_s"] > 0 and a["start"]["warm_s"] > 0
        if a["engine"] == "vllm":  # the warm start loaded the compiled graph its cold start made
            assert a["start"]["warm_loaded_compiled"] is True
    assert arms["w4a16-tinygemm"]["engine_info"]["layer_modes"][0]["kernel"] == "edgepath::int4_mm"
    # the GGUF build runs in llama.cpp on any CPU, counted as llama.cpp counts its controls
    gguf = arms["q4_0-gguf"]
    assert (gguf["role"], gguf["engine"], record["paths"]["q4_0-gguf"]["state"]) == ("build", "llama.cpp", "measured")
    # Q4_0 blocks and a Q8_0 embedding, as llama.cpp's own Q4_0 file holds, and the key and value
    # projections at Q8_0: between Q4_0's size and Q4_K_M's. llama.cpp's imatrix Q4_0 keeps the first
    # eighth of the layers' ffn_down at Q4_1, a little more than Q4_0
    bits = {name: arms[name]["bits_per_weight"]
            for name in ("q4_0-gguf", "llama.cpp Q4_0", "llama.cpp Q4_0-imatrix", "llama.cpp Q4_K_M")}
    assert bits["llama.cpp Q4_0"] <= bits["llama.cpp Q4_0-imatrix"] < bits["q4_0-gguf"] < bits["llama.cpp Q4_K_M"]
    assert gguf["ratios"]["llama_q4_k_m"]["increase_ratio"] is not None
    assert record["settings"]["passes"] == 3 and record["settings"]["threads"] >= 1
    assert 0 <= record["load"]["other_cpu_share"]["max"] <= 1


def test_fidelity_is_measured_per_genre_against_the_models_own_bf16(bench):
    _, _, record = bench
    arms = {a["name"]: a for a in record["arms"]}
    genres = set(record["evaluation"]["tokens_sha256"])
    assert genres == {"prose", "code", "docs", "dialogue", "lists"}
    assert set(record["evaluation"]["held_out"]["genres"]) == genres
    # llama.cpp F16 and vLLM bf16 hold the same weights: scored the same way, they agree on every genre
    assert set(record["f16_perplexity_over_bf16"]) == genres
    for genre, ratio in record["f16_perplexity_over_bf16"].items():
        assert ratio == pytest.approx(1.0, abs=0.03), genre
    assert arms["llama.cpp F16"]["fidelity"]["top1_vs_bf16"] >= 0.9
    bf16 = arms["vllm bf16"]["fidelity"]
    assert bf16["mean_increase_pct"] == 0 and all(f["increase_pct"] == 0 for f in bf16["genres"].values())
    build = arms["w4a16-tinygemm"]
    fidelity = build["fidelity"]
    assert fidelity["prompts"] == 12 and set(fidelity["genres"]) == genres
    assert 0.5 < fidelity["top1_vs_bf16"] < 1
    for genre, f in fidelity["genres"].items():
        assert f["increase_pct"] == pytest.approx(100 * (f["perplexity"] / bf16["genres"][genre]["perplexity"] - 1),
                                                  abs=0.05), genre
    assert fidelity["worst"]["increase_pct"] == max(f["increase_pct"] for f in fidelity["genres"].values())
    assert fidelity["mean_increase_pct"] == pytest.approx(
        sum(f["increase_pct"] for f in fidelity["genres"].values()) / len(genres), abs=0.01)
    r = build["ratios"]
    assert r["decode_vs_bf16"] == pytest.approx(
        build["decode_tok_s"]["median"] / arms["vllm bf16"]["decode_tok_s"]["median"], abs=0.01)
    for key, name in (("llama_q4_k_m", "llama.cpp Q4_K_M"), ("llama_q4_0", "llama.cpp Q4_0"),
                      ("llama_q4_0_imatrix", "llama.cpp Q4_0-imatrix")):
        control = arms[name]["fidelity"]
        assert (r[key]["mean_increase_pct"], r[key]["worst"]) == (control["mean_increase_pct"], control["worst"])
        if control["mean_increase_pct"] > 0:
            assert r[key]["increase_ratio"] == pytest.approx(
                fidelity["mean_increase_pct"] / control["mean_increase_pct"], abs=0.01)
    # bits per weight counted the same way for every arm: 576-wide rows push "Q4_K_M" past 5
    assert arms["llama.cpp F16"]["bits_per_weight"] == pytest.approx(16, abs=0.1)
    assert arms["llama.cpp Q4_K_M"]["bits_per_weight"] > arms["llama.cpp Q4_0"]["bits_per_weight"] > 4


def test_manifest_carries_each_targets_figures_or_why_not(bench):
    dest, _, record = bench
    m = {t["tag"]: t for t in records.read(dest / "manifest.json", "manifest")["targets"]}
    here = probe.probe()  # what this host measures follows from its probe, on every CPU tier
    host_path = select_weight_path(here, "speed").name
    host = m["host"]["benchmark"]
    assert (host["state"], host["arm"]) == ("measured", host_path)
    assert host["run"]["date"] == record["date"] and host["run"]["host_digest"] == record["host"]["digest"]
    assert host["figures"]["decode_tok_s"] == next(a for a in record["arms"]
                                                   if a["name"] == host_path)["decode_tok_s"]["median"]
    for tag in ("arm64-server", "phone-npu", "gpu-cuda"):
        assert m[tag]["benchmark"]["state"] == "not measured here" and "figures" not in m[tag]["benchmark"]
    # W4A8 runs where patch-verify ran it: AMX, or AVX512-VNNI with vLLM's gate lifted by the plugin
    w4a8 = record["paths"]["w4a8-gptq"]
    if coverage.w4a8_unsupported(here) is not None:
        assert w4a8["state"] == "not measured here" and coverage.w4a8_unsupported(here) in w4a8["detail"]
    if here.kernel_isa() != "x86_64 AMX":
        assert m["xeon-amx"]["benchmark"]["state"] == "not measured here"
    host_arm = next(a for a in record["arms"] if a["name"] == host_path)
    assert (host["figures"]["mean_increase_pct"], host["figures"]["worst"]) == (
        host_arm["fidelity"]["mean_increase_pct"], host_arm["fidelity"]["worst"])
    targets = json.loads((dest / "build/targets.json").read_text())
    assert targets["host"]["decode_tok_s"] == host["figures"]["decode_tok_s"]
    assert targets["host"]["worst_genre"] == host["figures"]["worst"]["genre"]


def test_dvc_shows_the_metrics_and_plots(bench, tmp_path):
    dest, env, _ = bench
    shown = subprocess.run(["dvc", "metrics", "show", "--json"], cwd=dest, env=env, capture_output=True, text=True,
                           check=True).stdout
    json.loads(shown)
    assert "decode_tok_s" in shown and "llama.cpp Q4_K_M" in shown and '"host"' in shown
    assert "mean_increase_pct" in shown and "worst_genre" in shown
    run_checked(["dvc", "plots", "show", "--out", str(tmp_path / "plots")], dest, env)
    page = (tmp_path / "plots" / "index.html").read_text()
    assert "Decode tokens/s per build and control" in page and "llama.cpp Q4_0" in page
    assert "Decode tokens/s against mean held-out perplexity increase" in page
    assert "per held-out genre and arm" in page and "dialogue: vllm bf16" in page


def test_every_stage_records_its_cost_and_dvc_shows_each(bench):
    """Each heavy stage's record carries its wall time and peak memory; the manifest
    stage collects them into build/costs.json, which `dvc metrics show` lists."""
    dest, env, record = bench
    shown = json.loads(subprocess.run(["dvc", "metrics", "show", "--json"], cwd=dest, env=env, capture_output=True,
                                      text=True, check=True).stdout)
    costs = next(iter(shown.values()))["data"]["build/costs.json"]["data"]
    lock = subprocess.run(["dvc", "stage", "list", "--name-only"], cwd=dest, env=env, capture_output=True, text=True,
                          check=True).stdout.split()
    costly = {s for s in lock if s.split("@")[0] in ("model", "calibrate", "quantize", "patch_verify", "export",
                                                    "control", "benchmark")}
    assert set(costs) == costly
    for stage, cost in costs.items():
        assert cost["wall_time_s"] > 0 and cost["peak_rss_gib"] > 0, stage
    # the benchmark's engines ran in child processes: the stage's peak is at least theirs
    assert record["peak_rss_bytes"] >= max(a["memory"]["rss_anon_peak_bytes"] for a in record["arms"])
    assert costs["benchmark"]["wall_time_s"] == record["wall_time_s"]
