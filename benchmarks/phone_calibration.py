"""Benchmark: what the phone export's calibration guards against, on the default model.

    .venv/bin/python -m benchmarks.phone_calibration        # ~15 min on 2 cores

The same QNN program (``edgepath.phone.qnn_w8a16``: the model traced at the export's
window, annotated by ExecuTorch's ``QnnQuantizer`` for the SoC, calibrated, converted)
built four ways, each measured against the fp32 reference on the same held-out
windows (Persuasion, never calibrated on): top-1 agreement, KL(fp32 || program) in
nats per position, logit SQNR in dB.

- ``w8a16 real text``: the export stage's build (calibration windows of real text,
  a quarter of them chat turns, through the reference model);
- ``w8a16 random tokens``: the same count and length of uniformly random token
  ids (a graph "calibrated" on the example inputs it was traced with);
- ``w8a8 real text``: 8-bit static activations, calibrated as the first;
- ``w8a16 real text, 4 samples``: how little real text already fixes the ranges.

The export gate (``export.qnn.min_top1``, ``min_sqnr_db``) is set between the first
and the others from these figures. Results: benchmarks/results/phone.{md,json,csv}.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from edgepath.core import records
from edgepath.stages import export

from .common import ROOT, host, today, write_csv, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from edgepath.phone import graph, qnn_w8a16
    from edgepath.text import calibration

    model_record = ROOT / "build" / "model" / "model.json"
    if not model_record.is_file():
        subprocess.run([str(Path(sys.executable).parent / "edgepath"), "model", "--out", str(model_record.parent)],
                       check=True)
    model_dir = records.model_directory(model_record, records.read(model_record, "model"))
    settings = export.Settings.from_file(ROOT / "params.yaml")
    s = settings.qnn
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = calibration.load_corpus(settings.corpus, list(settings.holdout))
    real = calibration.calibration_set(tokenizer, corpus, s.samples, s.window, s.chat_fraction, settings.seed)
    held_out = calibration.evaluation_set(tokenizer, corpus, s.parity_windows, s.window)
    random_tokens = torch.randint(0, tokenizer.vocab_size, real.tokens.shape,
                                  generator=torch.Generator().manual_seed(settings.seed))
    variants = (  # name, precision, calibration windows
        ("w8a16 real text", "w8a16", real.tokens),
        ("w8a16 random tokens", "w8a16", random_tokens),
        ("w8a8 real text", "w8a8", real.tokens),
        ("w8a16 real text, 4 samples", "w8a16", real.tokens[:4]),
    )
    reference = graph.load_reference(model_dir)
    rows = []
    for name, precision, windows in variants:
        started = time.monotonic()
        print(f"phone_calibration: {name}: calibrating on {len(windows)} x {s.window} tokens", file=sys.stderr,
              flush=True)
        converted = qnn_w8a16.calibrate(reference, windows, precision, s.soc)
        figures = qnn_w8a16.parity(reference, converted, held_out)
        rows.append({"variant": name, "precision": precision, "calibration_windows": len(windows),
                     **figures, "seconds": round(time.monotonic() - started, 1)})
        print(f"phone_calibration: {name}: top-1 {figures['top1_agreement']:.3f}, KL {figures['kl_nats']:.4f}, "
              f"SQNR {figures['logit_sqnr_db']} dB ({rows[-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
        del converted

    results = Path(args.results)
    record = {"command": "python -m benchmarks.phone_calibration", "date": today(), "host": host(),
              "soc": s.soc, "window": s.window, "held_out": {"documents": list(settings.holdout),
                                                              "windows": s.parity_windows, "length": s.window},
              "calibration": real.record,
              "versions": records.versions("torch", "transformers", "executorch", "torchao"), "variants": rows}
    write_json(results / "phone.json", record)
    write_csv(results / "phone.csv", ({k: r[k] for k in ("variant", "top1_agreement", "kl_nats", "logit_sqnr_db")}
                                      for r in rows))
    print("\n| variant | top-1 vs fp32 | KL (nats) | logit SQNR (dB) | passes the gate |\n|---|---|---|---|---|")
    for r in rows:
        gate = r["top1_agreement"] >= s.min_top1 and (r["logit_sqnr_db"] or 0) >= s.min_sqnr_db
        print(f"| {r['variant']} | {r['top1_agreement']:.3f} | {r['kl_nats']:.4f} | {r['logit_sqnr_db']} | "
              f"{'yes' if gate else 'no'} |")


if __name__ == "__main__":
    main()
