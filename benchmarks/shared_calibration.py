"""Benchmark: does a path's own true-sequential GPTQ pass pay for what it costs?

    .venv/bin/python -m benchmarks.shared_calibration                 # ~50 min on 2 cores
    .venv/bin/python -m benchmarks.shared_calibration --inputs shared  # the shared arms only

The calibrate stage runs the unquantized model over the calibration windows once
and stores the Hessian of every linear's input; each quantize path then runs GPTQ
from those (``inputs: shared``). The alternative (``inputs: sequential``,
``quantize.true_sequential``) is GPTQ's true-sequential pass, run by each path:
every group of linears calibrated on the outputs of those already quantized,
about three forwards of the calibration tokens per path.

For every path the quantize stage builds (params.yaml's settings, calibration
included), this runs the real calibrate stage once and the real quantize stage
per path and kind of input, each in its own process, and reports the stage's
own figures: the held-out perplexity increase over the unquantized model per
genre, their mean and the worst, GPTQ's time, the stage's wall time and peak
RSS, and the engine check's verdict. Rows of an earlier run with other names are
kept (``--inputs`` runs part of it). Results go to
benchmarks/results/shared_calibration.{json,csv}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import RESULTS, ROOT, host, params_with, quantize_arm, stage, today, write_csv, write_json

INPUTS = ("shared", "sequential")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", choices=INPUTS, action="append", help="only these arms (default: both)")
    parser.add_argument("--work", default=str(ROOT / "build" / "bench" / "shared_calibration"))
    args = parser.parse_args()

    from edgepath.core import records
    from edgepath.rules import fleet, weight_paths

    work = Path(args.work)
    model_record = ROOT / "build" / "model" / "model.json"
    if not model_record.is_file():
        stage("model", "--out", str(model_record.parent))
    wall, peak = stage("calibrate", "--model", str(model_record), "--out", str(work / "calibration"),
                       "--params", str(ROOT / "params.yaml"))
    calibrated = records.read(work / "calibration" / "calibration.json", "calibration")
    rows = {"calibrate": {"arm": "calibrate", "wall_time_s": round(wall, 1), "peak_rss_gib": round(peak / 2**30, 2)}}
    paths = fleet.namespace(str(ROOT / "params.yaml"), "quantize").get("paths") or weight_paths.built_by(
        weight_paths.Stage.QUANTIZE)
    for inputs in args.inputs or INPUTS:
        for path in paths:
            arm = f"{path}/{inputs}"
            print(f"\n== {arm} ==", file=sys.stderr, flush=True)
            params = params_with(work / f"{inputs}.yaml",
                                 quantize={"true_sequential": list(paths) if inputs == "sequential" else []})
            rows[arm] = {"arm": arm, "path": path, "inputs": inputs,
                         **quantize_arm(model_record, work / "calibration", path, work / arm, params)}

    earlier = RESULTS / "shared_calibration.json"
    if earlier.is_file():
        rows = {**{r["arm"]: r for r in json.loads(earlier.read_text())["rows"]}, **rows}
    ordered = [rows[k] for k in sorted(rows, key=lambda k: (k != "calibrate", k))]
    for r in ordered:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    meta = {"command": "python -m benchmarks.shared_calibration", "date": today(), "host": host(),
            "calibration": calibrated["calibration"] | {"documents": len(calibrated["calibration"]["documents"])},
            "reference": calibrated["reference"]["perplexity"], "versions": calibrated["versions"]}
    write_json(RESULTS / "shared_calibration.json", {"meta": meta, "rows": ordered})
    write_csv(RESULTS / "shared_calibration.csv", [r for r in ordered if r["arm"] != "calibrate"])
    print(f"\nresults -> {RESULTS}/shared_calibration.json, shared_calibration.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
