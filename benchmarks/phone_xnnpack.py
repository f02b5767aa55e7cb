"""Benchmark: the XNNPACK phone build, side by side: fidelity against fp32 and speed.

    .venv/bin/python -m benchmarks.phone_xnnpack --pte build/exports/w4a8-xnnpack/model.pte \
        --pte build/exports/w8a8-xnnpack/model.pte [--baseline-pte OLD.pte] [--parts]

Each ``.pte`` (named by its directory: the export path) runs in ExecuTorch's runtime
on ``export.xnnpack.threads`` threads:

- fidelity: teacher-forced over 256 held-out tokens of each genre (never calibrated
  on), one token per call, against the fp32 model: top-1 agreement, KL, logit SQNR,
  per genre, pooled, and the worst genre;
- speed, in interleaved rounds (medians, min-max): decode of 64 tokens after a chat
  prompt, and the prefill of a 128-token held-out window. A program exported by
  edgepath before its custom-ops decoder (``--baseline-pte``: ``forward(input_ids
  [1, 1], cache_position [1])``) takes one token per call, so its prefill is timed
  token by token, which is all it can do.

With ``--parts``, where the fidelity goes: the fp32 model with one part quantized
alone by round-to-nearest (torchao's configs, as the export would without GPTQ), in
eager PyTorch, against fp32 on the same windows.

Results: edgepath/rules/measured/phone_xnnpack.json (the registry reads the programs' figures from it)
and benchmarks/results/phone_xnnpack.csv (``dvc plots show``); the table goes
to stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgepath.core import records
from edgepath.rules.measurements import MEASURED
from edgepath.rules.weight_paths import XNNPACK_GROUP_SIZE
from edgepath.scoring.stats import spread
from edgepath.stages import export

from .common import ROOT, host, today, write_csv, write_json

CHECK_TOKENS = 256
DECODE_TOKENS = 64
PREFILL_TOKENS = 128
ROUNDS = 5


def _parts(model_dir: Path, genres, fp32) -> list[dict]:
    """Each part of the model quantized alone (RTN), against fp32 (module docstring)."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    from edgepath.phone import graph
    from edgepath.phone.parity import Parity

    def embedding(m, _):
        return isinstance(m, torch.nn.Embedding)

    def body(m, fqn):
        return isinstance(m, torch.nn.Linear) and fqn != "lm_head"

    def head(m, fqn):
        return isinstance(m, torch.nn.Linear) and fqn == "lm_head"

    g = XNNPACK_GROUP_SIZE
    a8w4 = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(g))
    a8w8 = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    parts = (  # name, what it does to the fp32 model
        ("embedding int8 per row", lambda m: quantize_(
            m, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)), embedding)),
        (f"head a8w4 (group {g})", lambda m: quantize_(m, a8w4, head)),
        ("head a8w8 (per channel)", lambda m: quantize_(m, a8w8, head)),
        (f"decoder linears w4, weights only (group {g})", lambda m: quantize_(
            m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(g)), body)),
        (f"decoder linears a8w4 (group {g})", lambda m: quantize_(m, a8w4, body)),
        ("decoder linears a8w8 (per channel)", lambda m: quantize_(m, a8w8, body)),
    )
    rows = []
    for name, quantize in parts:
        m = graph.load_reference(model_dir)
        m.config.tie_word_embeddings = False
        m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
        quantize(m)
        parity = Parity()
        with torch.no_grad():
            for genre, ids in genres.items():
                parity.add(fp32[genre], m(input_ids=ids[None], use_cache=False).logits[0])
        rows.append({"part": name, **parity.result()})
        print(f"phone_xnnpack: {name}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def _fidelity(program, genres, fp32) -> dict:
    from edgepath.phone.parity import by_genre

    return by_genre({genre: fp32[genre][:-1] for genre in genres},
                    {genre: program.logits(ids.tolist())[:-1] for genre, ids in genres.items()})




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pte", action="append", required=True, help="an export stage's model.pte (repeatable)")
    parser.add_argument("--baseline-pte", help="a one-token-per-call .pte from an earlier export, measured beside it")
    parser.add_argument("--parts", action="store_true", help="also quantize each part alone (RTN) in eager PyTorch")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from edgepath.engines import executorch_runtime
    from edgepath.phone import graph
    from edgepath.text import calibration
    from edgepath.text.prompts import fixed_prompt_ids

    model_record = ROOT / "build" / "model" / "model.json"
    model_dir = records.model_directory(model_record, records.read(model_record, "model"))
    x = export.Settings.from_file(ROOT / "params.yaml").xnnpack
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = calibration.load_corpus("mix", [])
    genres = {g: w[0] for g, w in calibration.held_out_genres(tokenizer, corpus, 1, CHECK_TOKENS).items()}
    prefill = calibration.evaluation_set(tokenizer, corpus, 1, PREFILL_TOKENS)[0].tolist()
    prompt = fixed_prompt_ids(tokenizer)[0]
    with torch.no_grad():
        model = graph.load_reference(model_dir)
        fp32 = {g: model(input_ids=ids[None], use_cache=False).logits[0] for g, ids in genres.items()}
        del model

    executorch_runtime.set_threads(x.threads)
    arms = {Path(pte).parent.name: (Path(pte), True) for pte in args.pte}
    if args.baseline_pte:
        arms["baseline"] = (Path(args.baseline_pte), False)
    programs = {name: executorch_runtime.PteDecoder(path, x.max_seq_len, one_token_per_call=not whole)
                for name, (path, whole) in arms.items()}
    fidelity = {}
    for name, program in programs.items():
        fidelity[name] = _fidelity(program, genres, fp32)
        print(f"phone_xnnpack: {name}: top-1 against fp32 {fidelity[name]['top1_agreement']:.3f}, worst "
              f"{fidelity[name]['worst']}", file=sys.stderr, flush=True)
    decode = {name: [] for name in programs}
    prefill_rates = {name: [] for name in programs}
    for round_ in range(ROUNDS):  # interleaved: each round measures every program once
        for name, program in programs.items():
            decode[name] += [1 / s for s in program.decode_seconds_per_token(prompt, DECODE_TOKENS, 1)]
            prefill_rates[name] += [1 / s for s in program.prefill_seconds_per_token(prefill, 1)]
        print(f"phone_xnnpack: round {round_ + 1}/{ROUNDS}", file=sys.stderr, flush=True)
    results = {name: {"pte": str(path), "size_bytes": path.stat().st_size, "fidelity_against_fp32": fidelity[name],
                      "decode_tok_s": spread(decode[name], 2), "prefill_tok_s": spread(prefill_rates[name], 2),
                      "prefill": "one call" if arms[name][1] else "one token per call"}
               for name, (path, _) in arms.items()}
    if "baseline" in results:
        baseline = results["baseline"]
        for name in results.keys() - {"baseline"}:
            results[name]["speed_ups"] = {key: round(results[name][key]["median"] / baseline[key]["median"], 2)
                                          for key in ("decode_tok_s", "prefill_tok_s")}
    rows = _parts(model_dir, genres, fp32) if args.parts else None

    command = "python -m benchmarks.phone_xnnpack" + "".join(f" --pte {pte}" for pte in args.pte)
    command += f" --baseline-pte {args.baseline_pte}" if args.baseline_pte else ""
    command += " --parts" if args.parts else ""
    record = {"command": command, "date": today(), "host": host(),
              "threads": x.threads, "held_out": {"genres": sorted(genres), "tokens_per_genre": CHECK_TOKENS},
              "decode_tokens": DECODE_TOKENS, "prefill_tokens": PREFILL_TOKENS, "rounds": ROUNDS,
              "versions": records.versions("torch", "transformers", "executorch", "torchao"), "programs": results,
              "parts_against_fp32": rows}
    write_json(MEASURED / "phone_xnnpack.json", record)
    write_csv(Path(args.results) / "phone_xnnpack.csv", (
        {"program": name, "top1_vs_fp32": r["fidelity_against_fp32"]["top1_agreement"],
         "worst_genre_top1": r["fidelity_against_fp32"]["worst"]["top1_agreement"],
         "decode_tok_s": r["decode_tok_s"]["median"], "prefill_tok_s": r["prefill_tok_s"]["median"]}
        for name, r in results.items()))

    on = record["host"]
    print(f"\nhost {on['cpu_model']}, kernel ISA tier {on['kernel_isa']}, {x.threads} threads\n")
    print("| program | size MB | top-1 vs fp32 | worst genre | KL (nats) | decode tok/s | prefill tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        f, d, p = r["fidelity_against_fp32"], r["decode_tok_s"], r["prefill_tok_s"]
        print(f"| {name} | {r['size_bytes'] / 1e6:.1f} | {f['top1_agreement']:.3f} | {f['worst']['genre']} "
              f"{f['worst']['top1_agreement']:.3f} | {f['kl_nats']:.4f} | {d['median']:.1f} ({d['min']:.1f}-"
              f"{d['max']:.1f}) | {p['median']:.0f} ({p['min']:.0f}-{p['max']:.0f}) |")
    for name, r in results.items():
        if "speed_ups" in r:
            print(f"{name} against baseline: decode {r['speed_ups']['decode_tok_s']}x, prefill "
                  f"{r['speed_ups']['prefill_tok_s']}x")
    if rows:
        print("\n| quantized alone (RTN) | top-1 vs fp32 | KL (nats) | logit SQNR (dB) |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['part']} | {r['top1_agreement']:.3f} | {r['kl_nats']:.4f} | {r['logit_sqnr_db']} |")


if __name__ == "__main__":
    main()
