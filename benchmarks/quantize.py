"""Benchmark: how faithful each 4-bit quantizer variant is, on the default model.

    .venv/bin/python -m benchmarks.quantize            # ~25 min on 2 cores

For bf16 and each variant (plain symmetric GPTQ, GPTQ + weight-MSE scale
search, GPTQ + output-error scale search with a 4-bit and with a bf16 head), it
runs the real calibrate stage once, then the real quantize stage (`edgepath
quantize`, engine check included) per variant, each in its own process, and
reports: the held-out perplexity increase over bf16
(the quantize stage's: the mean over the held-out genres and the worst genre), how many of the 12 fixed prompts are reproduced token for token
against bf16 over 64 greedy tokens and the mean identical leading tokens, in
PyTorch on the dequantized weights and in vLLM's W4A8 kernel, the engine's
teacher-forced top-1 agreement, GPTQ wall time and the process's peak RSS.
Results go to benchmarks/results/quantize.{json,csv} (`dvc plots show`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .common import ROOT, host, params_with, stage, today, write_csv, write_json

VARIANTS = (  # name, search, head
    ("gptq-plain", "none", "int4"),
    ("gptq-weight-mse", "weight-mse", "int4"),
    ("gptq-output-error", "output-error", "int4"),
    ("gptq-output-error-bf16-head", "output-error", "bf16"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--work", default=str(ROOT / "build" / "bench"))
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    model_record = ROOT / "build" / "model" / "model.json"
    if not model_record.is_file():
        subprocess.run([str(Path(sys.executable).parent / "edgepath"), "model", "--out", str(model_record.parent)],
                       check=True)
    work = Path(args.work)
    params = params_with(work / "params.yaml", calibration={"samples": args.samples, "length": args.length})
    stage("calibrate", "--model", str(model_record), "--out", str(work / "calibration"), "--params", str(params))
    peaks = {}
    for name, search, head in VARIANTS:
        print(f"\n== {name}: quantize (search {search}, head {head}) ==", file=sys.stderr, flush=True)
        _, peaks[name] = stage("quantize", "--model", str(model_record), "--calibration", str(work / "calibration"),
                               "--path", "w4a8-gptq", "--out", str(work / name), "--search", search, "--head", head,
                               "--params", str(params))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgepath.core import records
    from edgepath.scoring.agreement import common_prefix, top1_against
    from edgepath.scoring.evaluate import greedy
    from edgepath.stages.engine_check import dequantized_reference
    from edgepath.text.prompts import fixed_prompt_ids

    torch.set_num_threads(os.cpu_count() or 1)
    hf = model_record.parent / "hf"
    tokenizer = AutoTokenizer.from_pretrained(hf)
    prompts = fixed_prompt_ids(tokenizer)
    bf16 = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    reference = greedy(bf16, prompts, 64)

    rows = []
    first = records.read(work / VARIANTS[0][0] / "quantization_report.json", "quantization")
    rows.append({"variant": "bf16", "perplexity_increase_mean_pct": 0.0, "worst_genre": "",
                 "torch_identical_of_12": 12, "torch_mean_leading": 64.0})
    for name, search, head in VARIANTS:
        d = work / name
        report = records.read(d / "quantization_report.json", "quantization")
        check = records.read(d / "engine_check.json", "engine_check")
        model = dequantized_reference(d, hf)
        outs = greedy(model, prompts, 64)
        prefixes = [common_prefix(o, r) for o, r in zip(outs, reference)]
        vs_bf16 = check["against"]["bf16"]["greedy"]
        rows.append({
            "variant": name, "search": search, "head": head,
            "perplexity_increase_mean_pct": report["fidelity"]["mean_increase_pct"],
            "worst_genre": f"{report['fidelity']['worst']['genre']} {report['fidelity']['worst']['increase_pct']:+.1f} %",
            "torch_identical_of_12": sum(p == 64 for p in prefixes),
            "torch_mean_leading": round(sum(prefixes) / len(prefixes), 1),
            "vllm_w4a8_identical_of_12": vs_bf16["identical"],
            "vllm_w4a8_mean_leading": round(vs_bf16["mean_identical_leading_tokens"], 1),
            "vllm_w4a8_top1_vs_bf16": top1_against(check, "bf16"),
            "vllm_w4a8_top1_vs_dequantized": top1_against(check, "dequantized"),
            "bits_per_weight": report["bits_per_weight"],
            "gptq_time_s": report["gptq_time_s"],
            "peak_rss_gib": round(peaks[name] / 2**30, 2),
        })
        del model

    columns = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("\n" + "  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))

    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m benchmarks.quantize" + (
                "" if (args.samples, args.length) == (128, 256) else f" --samples {args.samples} --length {args.length}"),
            "date": today(), "host": host(),
            "calibration": first["calibration"], "versions": first["versions"]}
    write_json(results / "quantize.json", {"meta": meta, "rows": rows})
    write_csv(results / "quantize.csv", rows)
    print(f"\nresults -> {results}/quantize.json, quantize.csv (load average {meta['host']['loadavg']})")


if __name__ == "__main__":
    main()
