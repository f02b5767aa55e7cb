"""Benchmark: where a batch-1 decode step's time goes in vLLM, for the host's build and bf16.

    .venv/bin/python -m benchmarks.builds                    # ~10 min on 2 cores

The PyTorch profiler over 128 decode steps of the host's build
(``w4a16-tinygemm``) and of bf16 in vLLM (compiled; the prompt's prefill profiled
alone and subtracted): self CPU time per step in the 4-bit or bf16 GEMMs of the
layers, the output head, attention, the compiled graph's fused kernels, sampling,
the other operators, and the time no operator accounts for (vLLM's per-step
Python and scheduling).

Its record once held a second part, ``compare``: the benchmark stage's own
comparison run outside DVC. That question is the benchmark stage's (``dvc repro
benchmark``); the record of 2026-12-03 keeps that part (``parts.compare``), whose
figures the registry reads for the AVX2 tier (``rules.measurements``).

Needs ``build/`` from ``scripts/run.sh`` (model, weights, verify, control).
Results: ``edgepath/rules/measured/builds.json`` and ``benchmarks/results/builds.md``,
with the host's load."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from edgepath.rules.measurements import MEASURED

from .common import RESULTS, ROOT, host, load, today, write_json

DECODE_STEPS = 128


def _category(op: dict, vocab: int) -> str:
    """Where an operator's time belongs: the layers' GEMMs, the head (its output is
    vocabulary-wide), attention (and its KV-cache writes), the compiled graph's fused
    kernels (norms, rotary, activations), sampling or anything else."""
    import ast

    name, shapes = op["name"], ast.literal_eval(op["shapes"])
    if name in ("edgepath::int4_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::mm", "aten::addmm"):
        widths = [shape[-1] for shape in shapes if isinstance(shape, list) and shape]
        # tinygemm's scale_and_zero is [K/g, N, 2]: its output width is the middle dimension
        if name != "aten::mm" and name != "aten::addmm":
            widths = [shapes[3][1]] if len(shapes) > 3 and shapes[3] else widths
        return "head" if vocab in widths else "GEMM (layers)"
    if any(k in name.lower() for k in ("attention", "attn", "kv_cache")):
        return "attention"
    if "CompiledFxGraph" in name:
        return "compiled graph (norms, rotary, activations)"
    if any(k in name for k in ("argmax", "topk", "sort", "softmax", "multinomial", "exponential")):
        return "sampling"
    return "other operators"


def step_breakdown(profiled: dict, vocab: int) -> tuple[float, dict[str, float]]:
    """A worker's ``profile`` answer over ``DECODE_STEPS`` steps: (wall ms per step, ms per
    step by ``_category``, with the time no operator accounts for as its own category)."""
    per_step: dict[str, float] = {}
    for op in profiled["ops"]:
        kind = _category(op, vocab)
        per_step[kind] = per_step.get(kind, 0) + op["self_cpu_us"] / 1e3 / DECODE_STEPS
    step_ms = profiled["wall_s"] * 1e3 / DECODE_STEPS
    per_step["no operator (framework, per step)"] = step_ms - sum(per_step.values())
    return step_ms, per_step


def breakdown() -> dict:
    """Per decode step, milliseconds by category (``_category``) for the host's build and bf16."""
    from transformers import AutoTokenizer

    from edgepath.core import records
    from edgepath.stages import benchmark
    from edgepath.text.prompts import fixed_prompt_ids

    model = ROOT / "build/model/hf"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompt = fixed_prompt_ids(AutoTokenizer.from_pretrained(model, local_files_only=True))[0]
    parameters = records.read(ROOT / "build/model/model.json", "model")["parameters"]
    # the stage's own arms: the host's build (it must have passed patch-verify here) and vLLM bf16
    arms, states = benchmark.plan(["w4a16-tinygemm"], ROOT / "build/verify", ROOT / "build/weights", model,
                                  parameters, None, ROOT / "build/control")
    if states["w4a16-tinygemm"]["state"] != "measured":
        raise SystemExit(f"w4a16-tinygemm: {states['w4a16-tinygemm']['detail']}")
    threads = os.cpu_count() or 1
    out = {}
    with tempfile.TemporaryDirectory(prefix="edgepath-breakdown-") as work:
        peaks = benchmark.PeakRss()
        for i, arm in enumerate(arms):
            w = benchmark.Worker(arm, Path(work) / f"cache-{i}", threads, Path(work) / f"{i}.log", peaks)
            try:
                w.ask("decode", prompt=prompt, new_tokens=8)  # warm-up
                plain = w.ask("decode", prompt=prompt, new_tokens=DECODE_STEPS)["seconds_per_token"]
                profiled = w.ask("profile", prompt=prompt, new_tokens=DECODE_STEPS)
            finally:
                w.close()
            step_ms, per_step = step_breakdown(profiled, vocab)
            top = sorted(profiled["ops"], key=lambda o: -o["self_cpu_us"])[:12]
            out[arm.name] = {"step_ms_profiled": round(step_ms, 2), "step_ms_unprofiled": round(plain * 1e3, 2),
                             "per_step_ms": {k: round(v, 3) for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
                             "top_ops": [{**o, "ms_per_step": round(o["self_cpu_us"] / 1e3 / DECODE_STEPS, 3)}
                                         for o in top]}
            print(f"breakdown {arm.name}: {step_ms:.2f} ms/step profiled ({plain * 1e3:.2f} unprofiled): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in out[arm.name]["per_step_ms"].items()), flush=True)
    return out


def _increase(fidelity: dict) -> str:
    """An arm's perplexity increase over bf16: the mean over the held-out genres and the
    worst genre; a run from before per-genre fidelity had only one novel's perplexity."""
    if "mean_increase_pct" not in fidelity:
        return f"(perplexity {fidelity['perplexity']} on one novel)"
    worst = fidelity["worst"]
    return (f"{fidelity['mean_increase_pct']:+.1f} % ({worst['genre']} {worst['increase_pct']:+.1f} %)"
            if worst else "-")


def _control_increase(control: dict | None) -> str:
    return "(not measured)" if control is None else _increase(control)


def _markdown(record: dict) -> str:
    on = (f"{record['host']['cpu_model']} ({record['host']['kernel_isa']}), {record['host']['cpus']} threads"
          if "host" in record else f"{record['cpu']}, {record['threads']} threads")
    lines = ["# Builds against their controls (benchmarks/builds.py)", "",
             f"Command: `{record['command']}`, {record['date']}, {on}.", ""]
    if "compare" in record["parts"]:
        c = record["parts"]["compare"]["result"]
        lines += ["## Compare (the benchmark stage's run)", "",
                  f"Load: other processes used median {c['load']['other_cpu_share']['median']:.1%} (max "
                  f"{c['load']['other_cpu_share']['max']:.1%}) of the CPU while an engine was measured; memory "
                  f"read bandwidth {c['read_bandwidth_gb_s']} GB/s; llama.cpp F16 / vLLM bf16 perplexity per genre "
                  f"{c['f16_perplexity_over_bf16']}. Perplexity increase over vLLM bf16 on each held-out genre; "
                  f"the mean and the worst genre.", "",
                  "| arm | bits/weight | decode tok/s (min-max) | prefill tok/s (min-max) | decode share of bandwidth "
                  "| start cold / warm s | RssAnon MiB (peak) | perplexity increase: mean (worst genre) "
                  "| top-1 vs bf16 | prompts reproduced |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for a in c["arms"]:
            d, p, f = a["decode_tok_s"], a["prefill_tok_s"], a["fidelity"]
            mem = a["memory"]
            lines.append(
                f"| {a['name']} | {a['bits_per_weight']:.2f} | {d['median']} ({d['min']}-{d['max']}) | "
                f"{p['median']:.0f} ({p['min']:.0f}-{p['max']:.0f}) | {a['decode_bandwidth_share']:.0%} | "
                f"{a['start']['cold_s']:.1f} / {a['start']['warm_s']:.1f} | "
                f"{mem['rss_anon_after_start_bytes'] / 2**20:.0f} ({mem['rss_anon_peak_bytes'] / 2**20:.0f}) | "
                f"{_increase(f)} | {f['top1_vs_bf16']:.3f} | {f['prompts_reproduced']}/{f['prompts']} |")
        for a in c["arms"]:
            if a["ratios"]:
                r = a["ratios"]
                lines += ["", f"{a['name']}: decode {r['decode_vs_bf16']}x vLLM bf16 and {r['decode_vs_llama_q4_k_m']}x "
                          f"llama.cpp Q4_K_M; prefill {r['prefill_vs_bf16']}x and {r['prefill_vs_llama_q4_k_m']}x; "
                          f"perplexity {_increase(a['fidelity'])} over bf16 against Q4_K_M's "
                          f"{_control_increase(r['llama_q4_k_m'])} and Q4_0's {_control_increase(r['llama_q4_0'])}; "
                          f"prompts reproduced "
                          f"{a['fidelity']['prompts_reproduced']} against Q4_K_M's {r['llama_q4_k_m_prompts_reproduced']}."]
        not_here = {p: s["detail"] for p, s in c["paths"].items() if s["state"] != "measured"}
        lines += [""] + [f"- {p}: not measured here: {why}" for p, why in not_here.items()]
    if "compare_previous" in record["parts"] and "compare" in record["parts"]:
        old_run, new_run = (record["parts"][k]["result"] for k in ("compare_previous", "compare"))
        previous = {a["name"]: a for a in old_run["arms"]}
        lines += ["", f"### Reproduced? This run against the previous one ({old_run['date']})", "",
                  "A median inside the other run's min-max reproduces it; fidelity is deterministic.", "",
                  "| arm | decode: this run (min-max) / previous median | prefill: this run (min-max) / previous "
                  "median | perplexity increase (mean over genres) this / previous |", "|---|---|---|---|"]
        for a in new_run["arms"]:
            b = previous.get(a["name"])
            if b is None:
                continue

            def cell(metric: str) -> str:
                x, y = a[metric], b[metric]
                inside = x["min"] <= y["median"] <= x["max"] or y["min"] <= x["median"] <= y["max"]
                return (f"{x['median']:g} ({x['min']:g}-{x['max']:g}) / {y['median']:g} "
                        f"{'(within)' if inside else '(OUTSIDE)'}")

            lines.append(f"| {a['name']} | {cell('decode_tok_s')} | {cell('prefill_tok_s')} | "
                         f"{_increase(a['fidelity'])} / {_increase(b['fidelity'])} |")
    if "breakdown" in record["parts"]:
        b = record["parts"]["breakdown"]["result"]
        lines += ["", "## Where a decode step's time goes (PyTorch profiler, 128 steps, batch 1)", "",
                  "| arm | step ms (unprofiled) | " + " | ".join(next(iter(b.values()))["per_step_ms"]) + " |",
                  "|---|---|" + "---|" * len(next(iter(b.values()))["per_step_ms"])]
        keys = list(next(iter(b.values()))["per_step_ms"])
        for name, r in b.items():
            lines.append(f"| {name} | {r['step_ms_profiled']} ({r['step_ms_unprofiled']}) | "
                         + " | ".join(str(r["per_step_ms"].get(k, 0)) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS), help="where builds.md goes")
    args = parser.parse_args()

    for needed in ("build/weights/w4a16-tinygemm/config.json", "build/control/control.json", "build/verify"):
        if not (ROOT / needed).exists():
            raise SystemExit(f"{ROOT / needed} is missing: run scripts/run.sh first")
    record_path = MEASURED / "builds.json"
    previous = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record = {"command": "python -m benchmarks.builds", "date": today(), "host": host(),
              "parts": previous.get("parts", {})}
    before = load()
    record["parts"]["breakdown"] = {"result": breakdown(), "date": record["date"], "load_before": before,
                                    "load_after": load()}
    write_json(record_path, record)
    (Path(args.results) / "builds.md").write_text(_markdown(record))
    sys.stdout.write(_markdown(record))


if __name__ == "__main__":
    main()
