"""Benchmark: vLLM's per-step cost on the CPU, one configuration lever at a time.

    .venv/bin/python -m benchmarks.step_cost                   # ~45 min on 2 cores, AVX2
    .venv/bin/python -m benchmarks.step_cost --levers default eager nobind

The breakdown (``benchmarks/builds.py --only breakdown``) splits a batch-1 decode
step of the host's build in vLLM into the layers' GEMMs, attention, the compiled
graph's norms and activations, and framework time no operator accounts for.
Each lever below changes one setting of edgepath's engine (``VllmCpu`` through
``engines.worker``, the in-process engine core every stage runs) and is measured
against ``default`` (edgepath's settings as they are) on the same checkpoint
(``--path``, the host's vLLM build by default: ``w4a16-tinygemm`` on AVX2).

Every lever runs in its own engine process; levers are measured in groups of at
most ``--group`` processes (each group with its own ``default``, so that every
ratio is from one interleaved run: the other processes of the group are stopped
while one is timed). Per round and lever:

- decode at batch 1: seconds per token after a 128-token held-out prompt,
  prefill excluded (``decode``: ``(t(1 + n) - t(1)) / n``, n = ``--new-tokens``);
- prefill of that prompt;
- decode at batch ``--batch``: that many held-out prompts at once, aggregate
  tokens/s of ``--batch-tokens`` tokens each, prefill excluded the same way.

After the rounds each lever is profiled once (PyTorch profiler over 128 batch-1
decode steps, ``builds.step_breakdown``: where the step's time went) and its batch's
greedy tokens are compared with ``default``'s (a lever that changes the numbers
says so). Results: ``benchmarks/results/step_cost.{json,md,csv}`` (the CSV is
drawn by ``dvc plots``), naming the host's CPU tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from edgepath.core import atomic
from edgepath.engines.worker import EngineProcess, command
from edgepath.rules import weight_paths
from edgepath.scoring.stats import spread
from edgepath.stages.benchmark import alone

from .builds import DECODE_STEPS, step_breakdown
from .common import ROOT, held_out_prompts, host, today, write_csv, write_json

PROMPT_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class Lever:
    """One setting changed from edgepath's engine: environment, ``vllm.LLM`` keyword
    arguments, or libraries preloaded into the engine process (``LD_PRELOAD``)."""

    what: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    preload: tuple[str, ...] = ()

    def missing(self) -> str | None:
        """Why this lever cannot run here (a library to preload is not installed), or None."""
        for library in self.preload:
            if not Path(library).is_file():
                return f"{library} is not installed"
        return None


def _tcmalloc() -> str:
    """Where Debian's libtcmalloc-minimal4 puts the library, for this machine's architecture."""
    found = sorted(Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"))
    return str(found[0]) if found else "libtcmalloc_minimal.so.4 (apt install libtcmalloc-minimal4)"


LEVERS = {
    "default": Lever("edgepath's engine: compiled (inductor), OpenMP threads bound one per CPU, "
                     "KV blocks of 128, split-KV attention, vLLM's batch limits"),
    "eager": Lever("no compiled graph (enforce_eager): norms, rotary and activations as PyTorch ops",
                   engine_args={"enforce_eager": True}),
    "custom-ops": Lever("vLLM's C++ kernels for RMSNorm, SiLU-and-mul and rotary in the compiled graph, "
                        "instead of inductor's code",
                        engine_args={"compilation_config": {
                            "custom_ops": ["+rms_norm", "+silu_and_mul", "+rotary_embedding"]}}),
    "no-split-kv": Lever("CPU attention without splitting the KV sequence across threads",
                         env={"VLLM_CPU_ATTN_SPLIT_KV": "0"}),
    "block-32": Lever("KV cache blocks of 32 positions instead of 128", engine_args={"block_size": 32}),
    "max-seqs-16": Lever("at most 16 sequences per step (vLLM's default on CPU: 256), "
                         "smaller per-step batch buffers", engine_args={"max_num_seqs": 16}),
    "nobind": Lever("OpenMP threads not bound to CPUs", env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    "iomp": Lever("Intel OpenMP (libiomp5, installed with vllm-cpu) preloaded in place of GNU OpenMP",
                  preload=(str(Path(sys.prefix) / "lib" / "libiomp5.so"),)),
    "tcmalloc": Lever("tcmalloc preloaded as the allocator (vLLM's CPU guide recommends it)",
                      preload=(_tcmalloc(),)),
}


def _start(name: str, lever: Lever, spec: weight_paths.WeightPathSpec, model: Path, cache: Path,
           logs: Path) -> EngineProcess:
    """edgepath's engine (``VllmCpu``: threads bound to every CPU this process may run on),
    with ``lever`` applied."""
    cmd = command("vllm", model, quantization=spec.quantization, env={**spec.process_env(), **lever.env},
                  cache_dir=cache, engine_args=lever.engine_args or None)
    if lever.preload:
        cmd = ["env", f"LD_PRELOAD={':'.join(lever.preload)}", *cmd]
    process = EngineProcess(name, cmd, logs / f"{name}.log")
    process.wait_ready()
    return process


def _timed(process: EngineProcess, op: str, **request: Any) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    reply = process.ask(op, **request)
    return reply, time.perf_counter() - started


def _round(process: EngineProcess, prompt: list[int], batch: list[list[int]], new_tokens: int,
           batch_tokens: int) -> dict[str, Any]:
    decode = process.ask("decode", prompt=prompt, new_tokens=new_tokens)["seconds_per_token"]
    prefill = process.ask("prefill", prompt=prompt)["seconds"]
    _, first = _timed(process, "greedy", prompts=batch, new_tokens=1)
    reply, whole = _timed(process, "greedy", prompts=batch, new_tokens=1 + batch_tokens)
    return {"decode_ms": decode * 1e3, "prefill_tok_s": len(prompt) / prefill,
            "batch_tok_s": len(batch) * batch_tokens / (whole - first), "tokens": reply["tokens"]}


def _profile(process: EngineProcess, prompt: list[int], vocab: int) -> dict[str, float]:
    step_ms, per_step = step_breakdown(process.ask("profile", prompt=prompt, new_tokens=DECODE_STEPS), vocab)
    return {"step_ms_profiled": round(step_ms, 2), **{k: round(v, 2) for k, v in sorted(per_step.items())}}


def measure_group(names: list[str], spec: weight_paths.WeightPathSpec, model: Path, vocab: int,
                  prompts: list[list[int]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``default`` and the levers ``names``, interleaved: their medians, ratios to
    ``default``, greedy agreement with it and profiles."""
    prompt, batch = prompts[0], prompts[:args.batch]
    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack:
        processes = {}
        for name in ["default", *names]:
            started = time.perf_counter()
            processes[name] = stack.enter_context(_start(name, LEVERS[name], spec, model, args.logs / "vllm-cache",
                                                         args.logs))
            print(f"step_cost: {name} up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        for process in processes.values():  # warm-up, not measured
            process.ask("greedy", prompts=batch, new_tokens=4)
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in processes}
        for r in range(args.rounds):
            for name, process in processes.items():
                with alone(process, processes.values()):
                    got = _round(process, prompt, batch, args.new_tokens, args.batch_tokens)
                samples[name].append(got)
                print(f"step_cost: round {r + 1}/{args.rounds} {name}: decode {got['decode_ms']:.1f} ms/step, "
                      f"prefill {got['prefill_tok_s']:.0f} tok/s, batch {args.batch} {got['batch_tok_s']:.0f} tok/s",
                      file=sys.stderr, flush=True)
        for name, process in processes.items():
            with alone(process, processes.values()):
                results[name] = {"profile_ms_per_step": _profile(process, prompt, vocab),
                                 "engine_start_s": round(process.engine_start_s, 1)}
    reference = samples["default"][-1]["tokens"]
    for name, rounds in samples.items():
        tokens = rounds[-1]["tokens"]
        same = sum(a == b for seq_a, seq_b in zip(tokens, reference) for a, b in zip(seq_a, seq_b))
        results[name].update({
            "decode_ms": spread([s["decode_ms"] for s in rounds], 2),
            "prefill_tok_s": spread([s["prefill_tok_s"] for s in rounds], 1),
            "batch_tok_s": spread([s["batch_tok_s"] for s in rounds], 1),
            "greedy_agreement": round(same / sum(len(t) for t in reference), 3)})
    base = results["default"]
    for r in results.values():
        r["decode_speedup"] = round(base["decode_ms"]["median"] / r["decode_ms"]["median"], 3)
        r["prefill_speedup"] = round(r["prefill_tok_s"]["median"] / base["prefill_tok_s"]["median"], 3)
        r["batch_speedup"] = round(r["batch_tok_s"]["median"] / base["batch_tok_s"]["median"], 3)
    return results


def _markdown(record: dict[str, Any]) -> str:
    host = record["host"]
    lines = [f"# vLLM's per-step cost, one lever at a time ({record['date']})", "",
             f"Command: `{record['command']}`", "",
             f"Host: {host['cpu_model']}, kernel ISA tier `{host['kernel_isa']}`, {host['n_logical']} logical cores. "
             f"Checkpoint: `{record['path']}`. {record['settings']['rounds']} interleaved rounds per group; batch-1 "
             f"decode of {record['settings']['new_tokens']} tokens after a {PROMPT_TOKENS}-token held-out prompt; "
             f"batch {record['settings']['batch']}: {record['settings']['batch_tokens']} tokens per sequence. "
             "Speed-ups are against the same group's `default` (>1: the lever is faster).", "",
             "| group | lever | decode ms/step (min-max) | decode speed-up | prefill tok/s | prefill speed-up | "
             f"batch-{record['settings']['batch']} tok/s (min-max) | batch speed-up | greedy tokens as default |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g, group in enumerate(record["groups"], 1):
        for name, r in group.items():
            d = r["decode_ms"]
            b = r["batch_tok_s"]
            lines.append(f"| {g} | {name} | {d['median']} ({d['min']}-{d['max']}) | {r['decode_speedup']} | "
                         f"{r['prefill_tok_s']['median']} | {r['prefill_speedup']} | "
                         f"{b['median']} ({b['min']}-{b['max']}) | {r['batch_speedup']} | {r['greedy_agreement']} |")
    kinds = ["step_ms_profiled", *sorted({k for group in record["groups"] for r in group.values()
                                          for k in r["profile_ms_per_step"]} - {"step_ms_profiled"})]
    lines += ["", "## Where a batch-1 decode step's time goes (PyTorch profiler, ms per step)", "",
              "| group | lever | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for g, group in enumerate(record["groups"], 1):
        for name, r in group.items():
            lines.append(f"| {g} | {name} | " + " | ".join(str(r["profile_ms_per_step"].get(k, "-")) for k in kinds)
                         + " |")
    lines += ["", "## The levers", ""]
    lines += [f"- `{name}`: {LEVERS[name].what}" for name in record["levers"]]
    lines += [f"- `{name}`: not measured here: {why}" for name, why in record["skipped"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="w4a16-tinygemm", help="the weight path whose checkpoint is measured")
    parser.add_argument("--weights", type=Path, default=ROOT / "build" / "weights", help="the quantize stage's outputs")
    parser.add_argument("--model", type=Path, default=ROOT / "build" / "model" / "hf", help="the bf16 model")
    parser.add_argument("--levers", nargs="+", default=[n for n in LEVERS if n != "default"], choices=list(LEVERS))
    parser.add_argument("--group", type=int, default=5,
                        help="engine processes at once, default included (~2 GB each for SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    # 128: at 32 the batch's prefill (16 x 128 tokens, ~8 s here, timed twice) outweighed its
    # decode and the aggregate's spread across rounds was 2-3x
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/edgepath-step-cost"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_cost.json")
    args = parser.parse_args()


    spec = weight_paths.get(args.path)
    model = args.model if spec.quantization is None else args.weights / args.path
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = held_out_prompts(args.model, args.batch, PROMPT_TOKENS)
    args.logs.mkdir(parents=True, exist_ok=True)
    levers = [n for n in dict.fromkeys(args.levers) if n != "default"]
    skipped = {n: why for n in levers if (why := LEVERS[n].missing())}
    levers = [n for n in levers if n not in skipped]
    per_group = max(1, args.group - 1)
    groups = [measure_group(levers[i:i + per_group], spec, model, vocab, prompts, args)
              for i in range(0, max(1, len(levers)), per_group)]
    record = {"command": "python -m benchmarks.step_cost " + " ".join(sys.argv[1:]), "date": today(),
              "host": host(), "path": args.path, "levers": ["default", *levers], "skipped": skipped,
              "settings": {k: getattr(args, k) for k in ("rounds", "new_tokens", "batch", "batch_tokens", "group")},
              "groups": groups}
    write_json(args.out, record)
    # one row per lever (a lever's group's default as its baseline): dvc's bar template
    write_csv(args.out.with_suffix(".csv"), (
        {"lever": name if g == 0 or name != "default" else f"default ({g + 1})", "decode_speedup": r["decode_speedup"],
         "prefill_speedup": r["prefill_speedup"], "batch_speedup": r["batch_speedup"],
         "decode_ms": r["decode_ms"]["median"]}
        for g, group in enumerate(groups) for name, r in group.items()))
    markdown = _markdown(record)
    atomic.write_text(args.out.with_suffix(".md"), markdown)
    print(markdown)


if __name__ == "__main__":
    main()
