"""Benchmark: where the XNNPACK phone build's fidelity goes, and its decode speed.

    .venv/bin/python benchmarks/phone_xnnpack.py [--pte build/exports/w4a8-xnnpack/model.pte]   # ~3 min

Fidelity: the default model quantized in eager PyTorch one part at a time with the
export's torchao configs (``edgepath.phone.xnnpack_8da4w``), each against fp32 on
held-out text (Persuasion, 2 x 256 tokens): top-1 agreement, KL, logit SQNR. The
last row is the export's whole recipe, which the ``.pte`` tracks (its record's
``runtime_check``). Speed: with ``--pte``, the exported program decoding in
ExecuTorch's runtime on ``export.xnnpack.threads`` threads (medians of 5 rounds of
64 tokens after a chat prompt). Results: benchmarks/results/phone_xnnpack.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgepath import export, records  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pte", help="an exported w4a8-xnnpack model.pte to time")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    from transformers import AutoTokenizer

    from edgepath.phone import graph, xnnpack_8da4w
    from edgepath.phone.parity import Parity
    from edgepath import calibration

    model_record = ROOT / "build" / "model" / "model.json"
    model_dir = records.model_directory(model_record, records.read(model_record, "model"))
    settings = export.Settings.from_file(ROOT / "params.yaml")
    x = settings.xnnpack
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = calibration.evaluation_set(tokenizer, calibration.load_corpus(settings.corpus, list(settings.holdout)),
                                         2, 256)
    with torch.no_grad():
        fp32 = graph.load_reference(model_dir)(input_ids=windows, use_cache=False).logits

    def embedding(m, _):
        return isinstance(m, torch.nn.Embedding)

    def body(m, fqn):
        return isinstance(m, torch.nn.Linear) and fqn != "lm_head"

    def head(m, fqn):
        return isinstance(m, torch.nn.Linear) and fqn == "lm_head"

    a8w4 = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(x.group_size))
    parts = (  # name, what it does to the fp32 model
        ("embedding int8 per row", lambda m: quantize_(
            m, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)), embedding)),
        (f"head a8w4 (group {x.group_size})", lambda m: quantize_(m, a8w4, head)),
        ("head a8w8 (per channel)", lambda m: quantize_(m, Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int8, weight_granularity=PerAxis(0)), head)),
        (f"decoder linears w4, weights only (group {x.group_size})", lambda m: quantize_(
            m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(x.group_size)), body)),
        (f"decoder linears a8w4 (group {x.group_size})", lambda m: quantize_(m, a8w4, body)),
        ("the export's recipe (all of the above but the 8-bit head)", lambda m: xnnpack_8da4w.quantize(m, x.group_size)),
    )
    rows = []
    for name, quantize in parts:
        m = graph.load_reference(model_dir)
        quantize(m)
        with torch.no_grad():
            logits = m(input_ids=windows, use_cache=False).logits
        parity = Parity()
        parity.add(fp32, logits)
        rows.append({"part": name, **parity.result()})
        print(f"phone_xnnpack: {name}: {rows[-1]}", file=sys.stderr, flush=True)

    speed = None
    if args.pte:
        from edgepath.engines import executorch_runtime
        from edgepath.prompts import fixed_prompt_ids

        executorch_runtime.set_threads(x.threads)
        program = executorch_runtime.PteDecoder(Path(args.pte), x.max_seq_len)
        rates = program.decode_seconds_per_token(fixed_prompt_ids(tokenizer)[0], 64, 5)
        speed = {"pte": args.pte, "threads": x.threads, "tokens": 64, "rounds": 5,
                 "decode_tok_s": executorch_runtime.median_tok_s(rates)}

    record = {"command": "python benchmarks/phone_xnnpack.py" + (f" --pte {args.pte}" if args.pte else ""),
              "date": time.strftime("%Y-%m-%d"), "held_out": {"windows": 2, "length": 256},
              "versions": export._versions(), "fidelity_against_fp32": rows, "speed": speed}
    (Path(args.results) / "phone_xnnpack.json").write_text(json.dumps(record, indent=2) + "\n")
    print("\n| quantized part | top-1 vs fp32 | KL (nats) | logit SQNR (dB) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['part']} | {r['top1_agreement']:.3f} | {r['kl_nats']:.4f} | {r['logit_sqnr_db']} |")
    if speed:
        d = speed["decode_tok_s"]
        print(f"\ndecode {d['median']:.1f} tok/s ({d['min']:.1f}-{d['max']:.1f}) on {speed['threads']} threads")


if __name__ == "__main__":
    main()
