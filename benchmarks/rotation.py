"""Benchmark: does rotating the model before GPTQ (``quant.rotation``: norms folded, R1, R2)
lower a path's held-out perplexity increase?

    .venv/bin/python -m benchmarks.rotation               # ~30 min on 2 cores at 135M

Runs the real calibrate stage once (params.yaml's settings; reused where ``--work``
holds one), then the real quantize stage per path of params.yaml's ``quantize.paths``
twice, unrotated and rotated, each in its own process, and
reports the stage's own figures (``common.quantize_arm``): per genre the held-out
perplexity increase over the unquantized model, the mean and the worst, GPTQ's
time, wall time and peak RSS. Both arms quantize from the same Hessians (the rotated
one through ``Rotation.hessians``) and are scored on the same token ids. Results go to
benchmarks/results/rotation.{json,csv}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import RESULTS, ROOT, host, params_with, quantize_arm, stage, today, write_csv, write_json



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(ROOT / "build" / "bench" / "rotation"))
    parser.add_argument("--reuse", action="store_true",
                        help="keep the rows of the last run (rotation.json) whose build is still in --work")
    args = parser.parse_args()

    from edgepath.core import records
    from edgepath.rules import fleet

    work = Path(args.work)
    model_record = ROOT / "build" / "model" / "model.json"
    if not model_record.is_file():
        stage("model", "--out", str(model_record.parent))
    calibration = work / "calibration"
    if not (calibration / "calibration.json").is_file():
        stage("calibrate", "--model", str(model_record), "--out", str(calibration), "--params",
              str(ROOT / "params.yaml"))
    calibrated = records.read(calibration / "calibration.json", "calibration")
    earlier = {}
    if args.reuse and (RESULTS / "rotation.json").is_file():
        earlier = {r["arm"]: r for r in json.loads((RESULTS / "rotation.json").read_text())["rows"]}
    rows = []
    for path in fleet.namespace(str(ROOT / "params.yaml"), "quantize")["paths"]:
        for rotated in (False, True):
            arm = f"{path}/{'rotated' if rotated else 'plain'}"
            print(f"\n== {arm} ==", file=sys.stderr, flush=True)
            params = params_with(work / f"{arm}.yaml", quantize={"rotate": [path] if rotated else []})
            if arm in earlier and (work / arm / records.FILE_NAMES["quantization"]).is_file():
                figures = {k: v for k, v in earlier[arm].items() if k not in ("arm", "path", "rotation")}
            else:
                figures = quantize_arm(model_record, calibration, path, work / arm, params)
            # a rotated build of a model whose head is tied stores the head apart
            figures["artifact_bytes"] = sum(f.stat().st_size for f in (work / arm).rglob("*") if f.is_file())
            rows.append({"arm": arm, "path": path, "rotation": "R1+R2" if rotated else "none", **figures})
            print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    meta = {"command": "python -m benchmarks.rotation", "date": today(), "host": host(),
            "calibration": calibrated["calibration"] | {"documents": len(calibrated["calibration"]["documents"])},
            "reference": calibrated["reference"]["perplexity"], "versions": calibrated["versions"]}
    write_json(RESULTS / "rotation.json", {"meta": meta, "rows": rows})
    write_csv(RESULTS / "rotation.csv", rows)
    print(f"\nresults -> {RESULTS}/rotation.json, rotation.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
