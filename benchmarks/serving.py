"""Benchmark: serving throughput, vLLM's OpenAI server against llama.cpp's ``llama-server``.

    .venv/bin/python benchmarks/serving.py --weights build/weights --model build/model/hf \\
        --control build/control                                     # ~20 min on 2 cores

Every arm is the server ``edgepath serve`` starts for its build
(``serve.server_command``): vLLM's for each vLLM build in ``--weights`` this host
can run and for bf16 (``--model``), ``llama-server`` (built by set-up from the
sources of the benchmark's control) for the ``q4_0-gguf`` build and the control's
Q4_K_M and Q4_0. Each server has as many sequence slots as the most streams
measured, with continuous batching, and all servers stay up, so the arms
interleave: every round runs each concurrency level (1, 4, 16 streams by default)
on each arm in turn, the other servers stopped (SIGSTOP) meanwhile.

A level of C streams is C HTTP clients (threads) sending at once one streamed
``/v1/completions`` request each: a prompt of ``--prompt-tokens`` token ids of
held-out text (the same prompts for every arm; a different prompt per stream and
round, so no prefix cache answers), ``--new-tokens`` tokens, end of sequence
ignored. Measured per arm and level:

- aggregate decode tokens/s: every stream's generated tokens over the wall time
  from the first request sent to the last answer finished (median over rounds);
- time to first token: from sending a request to its first streamed token, p50
  and p95 over every request of every round;
- the scaling: the aggregate at C streams over the same arm's at one stream;
- at one stream, batch 1: decode tokens/s after the first token ((tokens - 1) over the
  time from the first token to the end) and prefill tokens/s (prompt over the time to
  first token), and the decode's share of the host's memory read bandwidth
  (``benchmark.read_bandwidth``): the bytes a step reads (``benchmark.stored_bytes``;
  a GGUF's whole file) times decode tokens/s.

Ratios are against ``llama-server`` on the control's Q4_K_M at the same level.
Results: ``benchmarks/results/serving.{json,md,csv}`` (the CSV is drawn by
``dvc plots``), each naming the host's CPU tier.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgepath.core import atomic
from edgepath.core.errors import EdgepathError  # noqa: E402
from edgepath.delivery.serve import Server, free_port, server_command, why_not_servable_here  # noqa: E402
from edgepath.rules import weight_paths  # noqa: E402
from edgepath.stages.benchmark import alone, read_bandwidth, stored_bytes  # noqa: E402

LEVELS = (1, 4, 16)
CONTROL_FILES = {"llama-server Q4_K_M": "model-q4_k_m.gguf", "llama-server Q4_0": "model-q4_0.gguf"}
BASELINE = "llama-server Q4_K_M"


def arms(weights: Path, model: Path, control: Path) -> list[tuple[str, weight_paths.WeightPathSpec, Path]]:
    """(name, weight path, model location) of every server to measure, in a fixed order."""
    found = []
    for name in ("w4a8-gptq", "w4a16-tinygemm"):
        spec = weight_paths.get(name)
        if (weights / name / "config.json").is_file():
            why = why_not_servable_here(spec)
            if why:
                print(f"serving: {name} not measured: {why}", file=sys.stderr)
            else:
                found.append((f"vllm {name}", spec, weights / name))
    found.append(("vllm bf16", weight_paths.get("bf16"), model))
    if (weights / "q4_0-gguf" / "model.gguf").is_file():
        found.append(("llama-server q4_0-gguf", weight_paths.get("q4_0-gguf"), weights / "q4_0-gguf" / "model.gguf"))
    for name, file in CONTROL_FILES.items():
        found.append((name, weight_paths.get("q4_0-gguf"), control / file))
    return found


def stream(url: str, model: str, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """One streamed completion: seconds to its first token and to its end, and the
    tokens the server says it generated."""
    host, port = url.removeprefix("http://").split(":")
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    if reply.status != 200:
        raise EdgepathError(f"{url}: {reply.status} {reply.read().decode(errors='replace')[:500]}")
    first, tokens = None, None
    for line in reply:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and any(c.get("text") for c in chunk.get("choices", ())):
            first = time.perf_counter() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    if first is None or tokens is None:
        raise EdgepathError(f"{url}: a streamed answer without text or without usage")
    return {"ttft_s": first, "end_s": time.perf_counter() - started, "tokens": tokens}


def level(url: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """All ``prompts`` sent at once, one client thread each."""
    results: list[dict[str, float] | BaseException] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = stream(url, model, prompts[i], new_tokens)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    for r in results:
        if isinstance(r, BaseException):
            raise r
    tokens = sum(r["tokens"] for r in results)
    if tokens != new_tokens * len(prompts):
        raise EdgepathError(f"{url}: {tokens} tokens generated, not {new_tokens} per stream (end of sequence "
                            f"not ignored?)")
    return {"tok_s": tokens / wall, "ttft_s": [r["ttft_s"] for r in results],
            "decode_tok_s": [(r["tokens"] - 1) / (r["end_s"] - r["ttft_s"]) for r in results]}


def held_out_prompts(model: Path, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids each: the held-out windows every
    benchmark scores (``calibration.held_out_genres``), the genres taken in turn."""
    from transformers import AutoTokenizer

    from edgepath.rules import fleet
    from edgepath.text import calibration

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    text = fleet.calibration(str(ROOT / "params.yaml"))
    sets = calibration.held_out_genres(tokenizer, calibration.load_corpus(text.corpus, list(text.holdout)),
                                       count, tokens)
    return [window for row in zip(*(s.tolist() for s in sets.values())) for window in row][:count]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=ROOT / "build" / "weights", help="the quantize stage's outputs")
    parser.add_argument("--model", type=Path, default=ROOT / "build" / "model" / "hf", help="the bf16 model")
    parser.add_argument("--control", type=Path, default=ROOT / "build" / "control", help="the control stage's GGUFs")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help="concurrent streams")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/edgepath-serving"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serving.json")
    args = parser.parse_args()

    from edgepath.stages.probe import probe

    host = probe().summary()
    parallel, context = max(args.levels), args.prompt_tokens + args.new_tokens + 16
    # one more prompt than measured, for the warm-up: a prompt sent twice is answered from
    # the servers' prompt caches
    *prompts, warm_up = held_out_prompts(args.model, args.rounds * sum(args.levels) + 1, args.prompt_tokens)
    args.logs.mkdir(parents=True, exist_ok=True)
    measured = arms(args.weights, args.model, args.control)
    servers: dict[str, Server] = {}
    with ExitStack() as stack:
        for name, spec, location in measured:
            port = free_port()
            # the engine's own compile cache per arm, kept between runs of this script
            env = {**os.environ, "VLLM_CACHE_ROOT": str(args.logs / "vllm-cache" / name.replace(" ", "-"))}
            argv, env = server_command(spec, location, name, "127.0.0.1", port, parallel, context, environ=env)
            started = time.perf_counter()
            servers[name] = stack.enter_context(Server(argv, env, port, args.logs / f"{name.replace(' ', '-')}.log"))
            print(f"serving: {name} up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        samples = {name: {c: {"tok_s": [], "ttft_s": [], "decode_tok_s": []} for c in args.levels}
                   for name, _, _ in measured}
        for name, server in servers.items():  # warm-up: one request per arm, not measured
            level(server.url, name, [warm_up], 8)
        used = 0
        for r in range(args.rounds):
            for c in args.levels:
                batch, used = prompts[used:used + c], used + c
                for name, server in servers.items():
                    with alone(server, servers.values()):
                        got = level(server.url, name, batch, args.new_tokens)
                    samples[name][c]["tok_s"].append(got["tok_s"])
                    samples[name][c]["ttft_s"] += got["ttft_s"]
                    samples[name][c]["decode_tok_s"] += got["decode_tok_s"]
                    print(f"serving: round {r + 1}/{args.rounds}, {c} streams, {name}: {got['tok_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)

    rows = []
    for name, by_level in samples.items():
        for c, s in by_level.items():
            rows.append({"arm": name, "streams": c, "tok_s": round(statistics.median(s["tok_s"]), 1),
                         "tok_s_min": round(min(s["tok_s"]), 1), "tok_s_max": round(max(s["tok_s"]), 1),
                         "ttft_p50_ms": round(1000 * _percentile(s["ttft_s"], 0.5), 1),
                         "ttft_p95_ms": round(1000 * _percentile(s["ttft_s"], 0.95), 1)})
    by = {(r["arm"], r["streams"]): r for r in rows}
    for r in rows:
        r["vs_q4_k_m"] = round(r["tok_s"] / by[(BASELINE, r["streams"])]["tok_s"], 2)
        r["vs_one_stream"] = round(r["tok_s"] / by[(r["arm"], 1)]["tok_s"], 2) if 1 in args.levels else None
    bandwidth = read_bandwidth()
    batch1 = {}
    if 1 in args.levels:
        for name, _, location in measured:
            decode = statistics.median(samples[name][1]["decode_tok_s"])
            step_bytes = location.stat().st_size if location.is_file() else stored_bytes(location)[1]
            batch1[name] = {"decode_tok_s": round(decode, 1),
                            "prefill_tok_s": round(args.prompt_tokens / statistics.median(samples[name][1]["ttft_s"]),
                                                   1),
                            "step_bytes": step_bytes, "bandwidth_share": round(step_bytes * decode / bandwidth, 3)}
        for b in batch1.values():
            b["decode_vs_q4_k_m"] = round(b["decode_tok_s"] / batch1[BASELINE]["decode_tok_s"], 2)
    record = {"command": "python benchmarks/serving.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
              "host": host, "bandwidth_gb_s": round(bandwidth / 1e9, 1),
              "settings": {"levels": args.levels, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "slots": parallel, "context": context},
              "servers": {name: {"argv": [Path(a).name if i == 0 else a for i, a in enumerate(servers[name].argv)],
                                 "start_s": round(servers[name].start_s, 1)} for name in servers},
              "batch1": batch1, "rows": rows}
    atomic.write_text(args.out, json.dumps(record, indent=2))
    header = ["arm", "streams", "tok_s", "vs_q4_k_m", "vs_one_stream", "ttft_p50_ms", "ttft_p95_ms"]
    # one category per arm and level: dvc's bar templates draw one bar per category
    atomic.write_text(args.out.with_suffix(".csv"), "\n".join(
        [",".join(["arm_streams", *header])]
        + [",".join([f"{r['arm']} x{r['streams']}", *(str(r[k]) for k in header)]) for r in rows]) + "\n")
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(str(r[k]) for k in header) + " |" for r in rows]
    if batch1:
        table += ["", "| arm | decode tok/s (batch 1) | vs Q4_K_M | prefill tok/s | bytes per step | bandwidth share |",
                  "|---|---|---|---|---|---|"]
        table += [f"| {name} | {b['decode_tok_s']} | {b['decode_vs_q4_k_m']} | {b['prefill_tok_s']} | "
                  f"{b['step_bytes'] / 1e6:.0f} MB | {b['bandwidth_share']} |" for name, b in batch1.items()]
    print("\n".join(table))
    atomic.write_text(args.out.with_suffix(".md"), "\n".join([
        f"# Serving throughput: vLLM's server against llama-server ({record['date']})", "",
        f"Command: `{record['command']}`", "",
        f"Host: {host['cpu_model']}, kernel ISA tier `{host['kernel_isa']}`, {host['n_logical']} logical cores; "
        f"memory read bandwidth {record['bandwidth_gb_s']} GB/s. {args.rounds} rounds, arms interleaved; prompts of "
        f"{args.prompt_tokens} held-out tokens, {args.new_tokens} new tokens per stream, {parallel} slots per server.",
        "", *table, ""]))


if __name__ == "__main__":
    main()
