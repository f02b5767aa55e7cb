"""Benchmark: the measurements behind the vLLM plugin's defaults, on the default model.

    .venv/bin/python -m benchmarks.plugin                 # all parts, ~25 min on 2 cores
    .venv/bin/python -m benchmarks.plugin --only gemm     # one part: gemm | head-gate | starts | engines

Parts, each interleaved (A B A B ...) with medians and min-max:

- ``gemm``: cpu_int4 through tinygemm (``edgepath::int4_mm``) against
  dequantizing to bf16 and a bf16 GEMM, and against the bf16 GEMM alone on a
  weight dequantized beforehand (the bound for any dequantize-once scheme), per
  row count, on SmolLM2's layer shapes: where (if anywhere) prefill should
  dequantize instead.
- ``head-gate``: the eager multiply-and-sum of ``edgepath::head_gate`` against
  ``F.linear`` on per-head gate shapes, per row count: ``HEAD_GATE_MAX_ROWS``.
- ``starts``: engine start, cold and warm, with the compile-cache patch and
  without it (``EDGEPATH_COMPILE_CACHE=0``), each arm on its own cache
  directory, and whether the two warm engines write the same greedy tokens.
- ``engines``: decode and prefill tokens/s of compiled engines (warm cache):
  the w4a16-tinygemm checkpoint with the fused CPU norms off (default) and on,
  and the bf16 model as the control.

Needs ``build/model`` and ``build/weights/w4a16-tinygemm`` (``scripts/run.sh``).
Results: ``benchmarks/results/plugin.{json,csv}`` (``dvc plots show``), with the
host's load average before and after each part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from .common import ROOT, host, load, today, write_csv, write_json

PARTS = ("gemm", "head-gate", "starts", "engines")
# SmolLM2-135M's quantized layers as vLLM runs them: qkv, o, gate/up, down, head.
LAYERS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _summary(samples: list[float]) -> dict[str, float]:
    from edgepath.scoring.stats import spread

    return {**spread(samples, 4), "n": len(samples)}


def _interleaved(arms: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each arm, alternating arms on every repetition."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in arms.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def bench_gemm() -> list[dict]:
    import torch

    from edgepath.formats.cpu_int4_format import CpuInt4

    rows = []
    for layer, (n, k) in LAYERS.items():
        gen = torch.Generator().manual_seed(0)
        stored = CpuInt4.pack(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32),
                              torch.full((n, k // 64), 0.01).to(torch.bfloat16).float(),
                              torch.zeros(n, k // 64))
        packed, scale_and_zero = stored.tinygemm_operands()
        dense = stored.dequantize(torch.bfloat16)
        for m in (1, 4, 16, 64, 256, 512):
            x = torch.randn(m, k).to(torch.bfloat16)
            reps = 3 if n * m > 10_000_000 else 15
            t = _interleaved({
                "tinygemm": lambda: torch.ops.edgepath.int4_mm(x, packed, 64, scale_and_zero),
                "dequant_bf16": lambda: x @ stored.dequantize(torch.bfloat16).t(),
                "bf16_only": lambda: x @ dense.t(),
            }, reps)
            tg, dq = statistics.median(t["tinygemm"]), statistics.median(t["dequant_bf16"])
            bf = statistics.median(t["bf16_only"])
            rows.append({"part": "gemm", "layer": layer, "n": n, "k": k, "rows": m,
                         "tinygemm_ms": _summary([s * 1e3 for s in t["tinygemm"]]),
                         "dequant_bf16_ms": _summary([s * 1e3 for s in t["dequant_bf16"]]),
                         "bf16_only_ms": _summary([s * 1e3 for s in t["bf16_only"]]),
                         "dequant_over_tinygemm": round(dq / tg, 2), "bf16_only_over_tinygemm": round(bf / tg, 2)})
            print(f"gemm {layer} [{n}x{k}] rows {m}: tinygemm {tg * 1e3:.3f} ms, dequantize + bf16 "
                  f"{dq * 1e3:.3f} ms ({dq / tg:.2f}x), bf16 GEMM alone {bf * 1e3:.3f} ms ({bf / tg:.2f}x)",
                  flush=True)
    return rows


def bench_head_gate() -> list[dict]:
    import torch

    rows = []
    for hidden, heads in ((2048, 8), (4096, 32)):
        weight = torch.randn(heads, hidden).to(torch.bfloat16)
        for m in (1, 2, 4, 8, 16, 64):
            x = torch.randn(m, hidden).to(torch.bfloat16)
            t = _interleaved({
                "reduction": lambda: (x.unsqueeze(1) * weight.unsqueeze(0)).sum(dim=-1, dtype=torch.float32),
                "f_linear": lambda: torch.nn.functional.linear(x, weight),
            }, 200)
            red, lin = statistics.median(t["reduction"]), statistics.median(t["f_linear"])
            rows.append({"part": "head-gate", "hidden": hidden, "heads": heads, "rows": m,
                         "reduction_us": _summary([s * 1e6 for s in t["reduction"]]),
                         "f_linear_us": _summary([s * 1e6 for s in t["f_linear"]]),
                         "linear_over_reduction": round(lin / red, 2)})
            print(f"head-gate [{heads}x{hidden}] rows {m}: multiply-and-sum {red * 1e6:.1f} us, "
                  f"F.linear {lin * 1e6:.1f} us ({lin / red:.2f}x)", flush=True)
    return rows


def _prompts(model: Path) -> list[list[int]]:
    """The fixed prompts (``edgepath.text.prompts``) through ``model``'s own tokenizer."""
    from transformers import AutoTokenizer

    from edgepath.text.prompts import fixed_prompt_ids

    return fixed_prompt_ids(AutoTokenizer.from_pretrained(str(model), local_files_only=True))


def _engine(model: Path, quantization: str | None, cache: Path, env: dict[str, str], *,
            greedy: int = 0, speed: int = 0) -> dict:
    """One compiled engine start in a fresh worker process (``edgepath.engines.worker``)
    on ``cache``: its construction time, vLLM's count of compiled artifacts loaded from
    the cache and the plugin's status; with ``greedy``, that many greedy tokens per fixed
    prompt; with ``speed``, that many repetitions of decode (128 tokens after a chat
    prompt) and prefill (512 tokens), in tokens/s, with the prefix cache off (a timed
    prompt is repeated: with it on, its prefill would be served from it)."""
    from edgepath.core.errors import EdgepathError
    from edgepath.engines.worker import EngineProcess, command

    cmd = command("vllm", model, quantization=quantization, env={"VLLM_CPU_INT4_W4A8": "0", **env},
                  cache_dir=cache, prefix_caching=not speed)
    prompts = _prompts(model) if greedy or speed else []
    try:
        with EngineProcess(f"engine on {model} ({cache.name})", cmd, cache.parent / f"{cache.name}.log") as process:
            info = process.wait_ready()
            result = {"start_s": round(process.engine_start_s, 2), "aot_artifacts_loaded": info["aot_artifacts_loaded"],
                      "plugin": process.ask("plugin_status")}
            if greedy:
                result["greedy"] = process.ask("greedy", prompts=prompts, new_tokens=greedy)["tokens"]
            if speed:
                long_prompt = (sum(prompts, []) * 8)[:512]
                process.ask("greedy", prompts=[prompts[0]], new_tokens=8)  # first-call warm-up
                decode, prefill = [], []
                for _ in range(speed):
                    decode.append(1 / process.ask("decode", prompt=prompts[0], new_tokens=128)["seconds_per_token"])
                    prefill.append(len(long_prompt) / process.ask("prefill", prompt=long_prompt)["seconds"])
                result["decode_tok_s"], result["prefill_tok_s"] = decode, prefill
    except EdgepathError as e:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{e}") from None
    return result


def bench_starts(checkpoint: Path, work: Path, passes: int) -> list[dict]:
    arms = {"patched": {"EDGEPATH_COMPILE_CACHE": "1"}, "unpatched": {"EDGEPATH_COMPILE_CACHE": "0"}}
    rows, greedy = [], {}
    for p in range(passes):
        caches = {arm: work / f"starts-{arm}-{p}" for arm in arms}
        for phase in ("cold", "warm"):
            for arm, env in arms.items():
                r = _engine(checkpoint, "cpu_int4", caches[arm], env, greedy=32 if phase == "warm" else 0)
                if "greedy" in r:  # the warm starts only
                    greedy.setdefault(arm, r["greedy"])
                rows.append({"part": "starts", "arm": arm, "phase": phase, "pass": p, "start_s": r["start_s"],
                             "aot_artifacts_loaded": r["aot_artifacts_loaded"],
                             "noop_attached": r["plugin"]["compile_cache"].get("loads", {}).get("noop_attached")})
                print(f"starts pass {p} {arm} {phase}: {r['start_s']:.1f} s, AOT artifacts loaded "
                      f"{r['aot_artifacts_loaded']}", flush=True)
    same = greedy["patched"] == greedy["unpatched"]
    print(f"starts: warm greedy output identical with and without the patch: {same}", flush=True)
    rows.append({"part": "starts", "arm": "both", "phase": "warm", "greedy_identical": same})
    return rows


def bench_engines(checkpoint: Path, bf16: Path, work: Path, passes: int) -> list[dict]:
    arms = {
        "w4a16-tinygemm": (checkpoint, "cpu_int4", {"EDGEPATH_FUSED_CPU_NORMS": "0"}),
        "w4a16-tinygemm + fused norms": (checkpoint, "cpu_int4", {"EDGEPATH_FUSED_CPU_NORMS": "1"}),
        "bf16": (bf16, None, {"EDGEPATH_FUSED_CPU_NORMS": "0"}),
    }
    rows = []
    # one cache directory per arm, named by index: inductor's compiler command breaks on spaces
    caches = {name: work / f"engines-{i}" for i, name in enumerate(arms)}
    for name, (model, quantization, env) in arms.items():  # a cold start fills each arm's cache
        _engine(model, quantization, caches[name], env)
    for p in range(passes):
        for name, (model, quantization, env) in arms.items():
            r = _engine(model, quantization, caches[name], env, speed=3)
            rows.append({"part": "engines", "arm": name, "pass": p, "start_s": r["start_s"],
                         "decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"]})
            print(f"engines pass {p} {name}: decode {statistics.median(r['decode_tok_s']):.1f} tok/s, prefill "
                  f"{statistics.median(r['prefill_tok_s']):.0f} tok/s", flush=True)
    return rows


def _engine_summary(rows: list[dict]) -> list[dict]:
    by_arm: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r["part"] == "engines":
            arm = by_arm.setdefault(r["arm"], {"decode": [], "prefill": []})
            arm["decode"] += r["decode_tok_s"]
            arm["prefill"] += r["prefill_tok_s"]
    base = by_arm.get("bf16")
    out = []
    for name, arm in by_arm.items():
        d, pf = statistics.median(arm["decode"]), statistics.median(arm["prefill"])
        out.append({"arm": name, "decode_tok_s": round(d, 1), "prefill_tok_s": round(pf, 0),
                    "decode_vs_bf16": round(d / statistics.median(base["decode"]), 2) if base else None,
                    "prefill_vs_bf16": round(pf / statistics.median(base["prefill"]), 2) if base else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=PARTS, action="append", help="run these parts only")
    parser.add_argument("--passes", type=int, default=3, help="interleaved passes of the engine parts")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
    checkpoint, bf16 = ROOT / "build/weights/w4a16-tinygemm", ROOT / "build/model/hf"
    parts = args.only or list(PARTS)
    if {"starts", "engines"} & set(parts) and not (checkpoint / "config.json").is_file():
        raise SystemExit(f"{checkpoint} is missing: run scripts/run.sh (or dvc repro quantize@w4a16-tinygemm)")
    import edgepath.engines.vllm_plugin.ops  # noqa: F401  registers edgepath::int4_mm

    results = Path(args.results)
    previous = json.loads((results / "plugin.json").read_text()) if (results / "plugin.json").is_file() else {}
    record = {"command": "python -m benchmarks.plugin" + "".join(f" --only {p}" for p in args.only or []),
              "date": today(), "host": host(), "threads": os.environ["OMP_NUM_THREADS"],
              "parts": previous.get("parts", {})}
    with tempfile.TemporaryDirectory(prefix="edgepath-bench-") as work:
        for part in parts:
            before = load()
            if part == "gemm":
                rows = bench_gemm()
            elif part == "head-gate":
                rows = bench_head_gate()
            elif part == "starts":
                rows = bench_starts(checkpoint, Path(work), args.passes)
            else:
                rows = bench_engines(checkpoint, bf16, Path(work), args.passes)
            record["parts"][part] = {"rows": rows, "load_before": before, "load_after": load(),
                                     "date": record["date"]}
            _write(record, results)  # after every part: a later part's failure keeps the earlier ones
    if "engines" in record["parts"]:
        record["engines_summary"] = _engine_summary(record["parts"]["engines"]["rows"])
        for r in record["engines_summary"]:
            print(f"engines: {r['arm']}: decode {r['decode_tok_s']} tok/s ({r['decode_vs_bf16']}x bf16), "
                  f"prefill {r['prefill_tok_s']} tok/s ({r['prefill_vs_bf16']}x bf16)")
    _write(record, results)
    if "engines_summary" in record:
        write_csv(results / "plugin.csv", record["engines_summary"])


def _write(record: dict, results: Path) -> None:
    write_json(results / "plugin.json", record)


if __name__ == "__main__":
    main()
