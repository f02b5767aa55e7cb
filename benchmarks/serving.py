"""Benchmark: serving throughput, vLLM's OpenAI server against llama.cpp's ``llama-server``.

    .venv/bin/python -m benchmarks.serving --weights build/weights --model build/model/hf \\
        --control build/control                                     # ~20 min on 2 cores

Every arm is the server ``edgepath serve`` starts for its build
(``serve.server_command``): vLLM's for each vLLM build in ``--weights`` this host
can run and for bf16 (``--model``), ``llama-server`` (built by set-up from the
sources of the benchmark's control) for the ``q4_0-gguf`` build and the control's
Q4_K_M and Q4_0. Each server has as many sequence slots as the most streams
measured, with continuous batching, and all servers stay up, so the arms
interleave: every round runs each concurrency level (1, 4, 16 streams by default)
on each arm in turn, the other servers stopped (SIGSTOP) meanwhile.

A level of C streams is vLLM's serving benchmark (``vllm bench serve``, run in
this process: ``vllm.benchmarks.serve``) against the server's OpenAI
``/v1/completions`` API, C requests at once (``--max-concurrency``): prompts of
``--prompt-tokens`` random token ids (vLLM's ``random`` dataset, the same seed for
every arm and a new one per round and level, so no prefix cache answers),
``--new-tokens`` tokens each, end of sequence ignored. Measured per arm and level:

- aggregate decode tokens/s: the tokens asked of every request over the benchmark's
  duration (median over rounds);
- time to first token, p50 and p95 (the median over rounds of each round's);
- the scaling: the aggregate at C streams over the same arm's at one stream;
- at one stream, batch 1: decode tokens/s (the tokens after the first over the median
  end-to-end latency less the median time to first token) and prefill tokens/s (the prompt over the median time to first
  token), and the decode's share of the host's memory read bandwidth
  (``benchmark.read_bandwidth``): the bytes a step reads (``hf_model.stored_bytes``;
  a GGUF's whole file) times decode tokens/s.

Ratios are against ``llama-server`` on the control's Q4_K_M at the same level.
Results: ``benchmarks/results/serving.{json,md,csv}`` (the CSV is drawn by
``dvc plots``), each naming the host's CPU tier.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from edgepath.core import atomic
from edgepath.core.errors import EdgepathError
from edgepath.delivery.serve import Server, free_port, server_command
from edgepath.formats.hf_model import stored_bytes
from edgepath.paths.vllm_checkpoint import why_not_runnable_here
from edgepath.rules import weight_paths
from edgepath.stages.benchmark import alone, read_bandwidth
from edgepath.stages.probe import probe

from .common import ROOT, today, write_csv, write_json

LEVELS = (1, 4, 16)
CONTROL_FILES = {"llama-server Q4_K_M": "model-q4_k_m.gguf", "llama-server Q4_0": "model-q4_0.gguf"}
BASELINE = "llama-server Q4_K_M"


def arms(weights: Path, model: Path, control: Path) -> list[tuple[str, weight_paths.WeightPathSpec, Path]]:
    """(name, weight path, model location) of every server to measure, in a fixed order."""
    found = []
    for name in ("w4a8-gptq", "w4a16-tinygemm"):
        spec = weight_paths.get(name)
        if (weights / name / "config.json").is_file():
            why = why_not_runnable_here(spec.quantization, spec.w4a8, probe())
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


def level(url: str, model: str, tokenizer: Path, streams: int, prompt_tokens: int, new_tokens: int,
          seed: int) -> dict[str, float]:
    """``streams`` requests at once through vLLM's serving benchmark against the server at
    ``url`` (module docstring); refused unless every request generated ``new_tokens``."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
        "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(prompt_tokens),
        "--random-output-len", str(new_tokens), "--random-range-ratio", "0", "--num-prompts", str(streams),
        "--max-concurrency", str(streams), "--ignore-eos", "--percentile-metrics", "ttft,e2el",
        "--metric-percentiles", "50,95", "--seed", str(seed), "--disable-tqdm"])
    with contextlib.redirect_stdout(sys.stderr):  # its report, beside the progress lines
        result = bench_serve(args)
    if (result["completed"], result["failed"]) != (streams, 0):
        raise EdgepathError(f"{url}: {result['completed']} of {streams} requests completed, {result['failed']} failed")
    # Tokens are counted as asked (each request generates new_tokens, end of sequence
    # ignored), not as vLLM's benchmark counts them: it re-tokenizes llama-server's text,
    # reading the usage only from a chunk without choices, and llama-server's last chunk
    # carries both.
    ttft, e2el = float(result["p50_ttft_ms"]), float(result["p50_e2el_ms"])
    return {"tok_s": streams * new_tokens / float(result["duration"]), "ttft_p50_ms": ttft,
            "ttft_p95_ms": float(result["p95_ttft_ms"]), "tpot_p50_ms": (e2el - ttft) / (new_tokens - 1)}


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

    host = probe().summary()
    parallel, context = max(args.levels), args.prompt_tokens + args.new_tokens + 16
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
        samples: dict[str, dict[int, list[dict[str, float]]]] = {name: {c: [] for c in args.levels}
                                                                  for name, _, _ in measured}
        for name, server in servers.items():  # warm-up: one request per arm, not measured
            level(server.url, name, args.model, 1, args.prompt_tokens, 8, seed=0)
        for r in range(args.rounds):
            for c in args.levels:
                seed = 1 + r * len(args.levels) + args.levels.index(c)  # the same prompts for every arm
                for name, server in servers.items():
                    with alone(server, servers.values()):
                        got = level(server.url, name, args.model, c, args.prompt_tokens, args.new_tokens, seed)
                    samples[name][c].append(got)
                    print(f"serving: round {r + 1}/{args.rounds}, {c} streams, {name}: {got['tok_s']:.1f} tok/s",
                          file=sys.stderr, flush=True)

    def median(name: str, c: int, key: str) -> float:
        return statistics.median(s[key] for s in samples[name][c])

    rows = []
    for name, by_level in samples.items():
        for c, s in by_level.items():
            tok_s = [x["tok_s"] for x in s]
            rows.append({"arm": name, "streams": c, "tok_s": round(statistics.median(tok_s), 1),
                         "tok_s_min": round(min(tok_s), 1), "tok_s_max": round(max(tok_s), 1),
                         "ttft_p50_ms": round(median(name, c, "ttft_p50_ms"), 1),
                         "ttft_p95_ms": round(median(name, c, "ttft_p95_ms"), 1)})
    by = {(r["arm"], r["streams"]): r for r in rows}
    for r in rows:
        r["vs_q4_k_m"] = round(r["tok_s"] / by[(BASELINE, r["streams"])]["tok_s"], 2)
        r["vs_one_stream"] = round(r["tok_s"] / by[(r["arm"], 1)]["tok_s"], 2) if 1 in args.levels else None
    bandwidth = read_bandwidth()
    batch1 = {}
    if 1 in args.levels:
        for name, _, location in measured:
            decode = 1000 / median(name, 1, "tpot_p50_ms")
            step_bytes = location.stat().st_size if location.is_file() else stored_bytes(location)[1]
            batch1[name] = {"decode_tok_s": round(decode, 1),
                            "prefill_tok_s": round(1000 * args.prompt_tokens / median(name, 1, "ttft_p50_ms"), 1),
                            "step_bytes": step_bytes, "bandwidth_share": round(step_bytes * decode / bandwidth, 3)}
        for b in batch1.values():
            b["decode_vs_q4_k_m"] = round(b["decode_tok_s"] / batch1[BASELINE]["decode_tok_s"], 2)
    record = {"command": "python -m benchmarks.serving " + " ".join(sys.argv[1:]), "date": today(),
              "host": host, "bandwidth_gb_s": round(bandwidth / 1e9, 1),
              "settings": {"levels": args.levels, "rounds": args.rounds, "prompt_tokens": args.prompt_tokens,
                           "new_tokens": args.new_tokens, "slots": parallel, "context": context},
              "servers": {name: {"argv": [Path(a).name if i == 0 else a for i, a in enumerate(servers[name].argv)],
                                 "start_s": round(servers[name].start_s, 1)} for name in servers},
              "batch1": batch1, "rows": rows}
    write_json(args.out, record)
    header = ["arm", "streams", "tok_s", "vs_q4_k_m", "vs_one_stream", "ttft_p50_ms", "ttft_p95_ms"]
    # one category per arm and level: dvc's bar templates draw one bar per category
    write_csv(args.out.with_suffix(".csv"),
              ({"arm_streams": f"{r['arm']} x{r['streams']}", **{k: r[k] for k in header}} for r in rows))
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
        f"memory read bandwidth {record['bandwidth_gb_s']} GB/s. {args.rounds} rounds, arms interleaved, each level "
        f"run by vLLM's serving benchmark; prompts of {args.prompt_tokens} random tokens, {args.new_tokens} new "
        f"tokens per stream, {parallel} slots per server.",
        "", *table, ""]))


if __name__ == "__main__":
    main()
