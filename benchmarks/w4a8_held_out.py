"""Benchmark: a W4A8 checkpoint's held-out perplexity in vLLM, int8 activations included.

    .venv/bin/python benchmarks/w4a8_held_out.py --checkpoint build/weights/w4a8-gptq \\
        --reference benchmarks/results/engine_auto.json              # ~5 min on 2 cores

The quantize stage's report scores the W4A8 build in PyTorch on its dequantized
weights, so it leaves out the int8 activations vLLM's kernel (``int4_scaled_mm_cpu``)
computes with. This script loads the checkpoint in vLLM with W4A8 on
(``engines.vllm_cpu.VllmCpu``; on an AVX512-VNNI host edgepath's plugin lifts vLLM's
AMX gate), compiled, and scores the benchmark stage's
held-out windows (``calibration.held_out_genres``, 16 x 512 tokens per genre by
default). The increase is over vLLM bf16's perplexity on the same token ids, read
from a benchmark stage record of the same kernel ISA tier (``--reference``), whose
llama.cpp Q4_K_M arm gives the ratio issue 20's goal is stated in.

Results go to benchmarks/results/w4a8_held_out.json and are printed as a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="the quantize stage's w4a8-gptq directory")
    parser.add_argument("--reference", default=str(ROOT / "benchmarks" / "results" / "engine_auto.json"),
                        help="a benchmark stage record (benchmark.json) from a host of this tier")
    parser.add_argument("--params", default=str(ROOT / "params.yaml"))
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "w4a8_held_out.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from edgepath.core import atomic, files
    from edgepath.engines.vllm_cpu import VllmCpu
    from edgepath.rules import fleet
    from edgepath.scoring import fidelity, stats
    from edgepath.stages.probe import probe
    from edgepath.text import calibration

    host = probe().summary()
    reference = files.read_json(Path(args.reference))
    tier = reference["host"]["summary"]["kernel_isa"]
    if tier != host["kernel_isa"]:
        raise SystemExit(f"{args.reference} was measured on {tier}, this host is {host['kernel_isa']}: "
                         f"its bf16 perplexities would not compare")
    arms = {a["name"]: a["fidelity"] for a in reference["arms"]}
    bf16, q4_k_m = arms["vllm bf16"]["genres"], arms["llama.cpp Q4_K_M"]
    evaluation = reference["evaluation"]
    windows, length = evaluation["windows_per_genre"], evaluation["length"]

    checkpoint = Path(args.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)
    text = fleet.calibration(args.params)
    sets = calibration.held_out_genres(tokenizer, calibration.load_corpus(text.corpus, list(text.holdout)),
                                       windows, length)
    for genre, ids in sets.items():  # the token ids the reference scored, or no comparison
        if calibration.tokens_sha256(ids) != evaluation["tokens_sha256"][genre]:
            raise SystemExit(f"{genre}: these held-out windows are not the ones {args.reference} scored")
    started = time.monotonic()
    # compiled, as the benchmark stage runs every vLLM arm: eager mode rounds differently
    # (this build measured a mean 0.2 points lower eager)
    engine = VllmCpu(str(checkpoint), quantization="gptq", w4a8=True, enforce_eager=False)
    genres = {}
    for genre, ids in sorted(sets.items()):
        perplexity = stats.perplexity(engine.score(ids.tolist())["nll"])
        genres[genre] = {"perplexity": round(perplexity, 3),
                         "increase_pct": round(fidelity.increase_percent(perplexity, bf16[genre]["perplexity"]), 2)}
        print(f"w4a8_held_out: {genre}: {genres[genre]['increase_pct']:+.2f} % over bf16, "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    headline = fidelity.headline({genre: g["increase_pct"] for genre, g in genres.items()})
    mean = headline["mean_increase_pct"]
    record = {
        "command": "python benchmarks/" + Path(__file__).name + " " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"), "host": host, "checkpoint": str(checkpoint),
        "quantization_report": files.read_json(checkpoint / "quantization_report.json")["format"],
        "w4a8_gate_lifted": engine.w4a8_gate_lifted, "layer_modes": engine.layer_modes(),
        "windows_per_genre": windows, "length": length, "reference": args.reference,
        "genres": genres, **headline,
        "q4_k_m_mean_increase_pct": q4_k_m["mean_increase_pct"],
        "vs_q4_k_m": round(mean / q4_k_m["mean_increase_pct"], 2),
    }
    atomic.write_text(args.results, json.dumps(record, indent=2))
    print("| genre | perplexity | over vLLM bf16 |\n|---|---|---|")
    for genre, g in genres.items():
        print(f"| {genre} | {g['perplexity']} | {g['increase_pct']:+.2f} % |")
    print(f"| mean | | {mean:+.2f} % ({record['vs_q4_k_m']}x llama.cpp Q4_K_M's "
          f"{q4_k_m['mean_increase_pct']:+.2f} %) |")


if __name__ == "__main__":
    main()
