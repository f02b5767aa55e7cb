"""Benchmark: what each stage costs at a model's size, and which builds fit the fleet.

    .venv/bin/python -m benchmarks.scale                                      # SmolLM2-135M, params.yaml's settings
    .venv/bin/python -m benchmarks.scale --source packaged:qwen2.5-coder-1.5b \\
        --samples 64 --windows 2 --paths w4a16-tinygemm                       # the 1.5B model, fewer tokens
    .venv/bin/python -m benchmarks.scale --source packaged:qwen2.5-coder-1.5b --until select

For one model source this runs the real stages, each in its own process, in
order: the model stage, ``select`` for every target of params.yaml's fleet (what
each device gets at that size and its memory need against what it has), the
calibrate stage, and the quantize stage for each path asked. Each stage's wall
time and peak RSS (the child's own, ``wait4``) are recorded, with the quantize
stage's GPTQ time and its held-out perplexity increase per genre. ``--samples``,
``--length`` (calibration windows) and ``--windows`` (held-out windows per genre)
override params.yaml's, so a large model can be measured in less time; ``--until
select`` stops before calibrating. The record says what ran. Rows are keyed by model and stage; a run keeps the other models'
rows. Results: benchmarks/results/scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import RESULTS, ROOT, host, params_with, stage, today, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="embedded", help="model.source (default: embedded)")
    parser.add_argument("--samples", type=int, help="calibration windows (default: params.yaml's)")
    parser.add_argument("--length", type=int, help="tokens per calibration window (default: params.yaml's)")
    parser.add_argument("--windows", type=int, help="held-out windows per genre (default: params.yaml's)")
    parser.add_argument("--paths", nargs="*", help="quantize paths (default: params.yaml's quantize.paths)")
    parser.add_argument("--until", choices=("select", "quantize"), default="quantize",
                        help="the last stage to run (default: quantize)")
    parser.add_argument("--work", default=str(ROOT / "build" / "bench" / "scale"))
    args = parser.parse_args()

    from edgepath.core import records
    from edgepath.rules import fleet

    work = Path(args.work) / args.source.replace(":", "-").replace("/", "_")
    params_file = ROOT / "params.yaml"
    quantize = fleet.namespace(params_file, "quantize")
    evaluation = {**(quantize.get("eval") or {}), **({"windows": args.windows} if args.windows else {})}
    params = params_with(
        work / "params.yaml", model={"source": args.source},
        calibration={k: v for k, v in (("samples", args.samples), ("length", args.length)) if v},
        quantize={"eval": evaluation})
    rows = []

    def measured(name: str, *stage_args: str) -> dict:
        print(f"\n== {args.source}: {name} ==", file=sys.stderr, flush=True)
        wall, peak = stage(*stage_args)
        rows.append({"model": args.source, "stage": name, "wall_time_s": round(wall, 1),
                     "peak_rss_gib": round(peak / 2**30, 2)})
        return rows[-1]

    model_dir = work / "model"
    measured("model", "model", "--params", str(params), "--out", str(model_dir))
    model = records.read(model_dir / "model.json", "model")
    rows[-1]["parameters"] = model["parameters"]
    fleet_params = fleet.load(params_file)
    for tag, target in fleet_params.targets.items():
        profile = (ROOT / target.profile) if target.profile != fleet.PROBE else None
        if profile is None:
            continue  # the build host: its own row would name this machine, not a device of the fleet
        out = work / "selections" / f"{tag}.json"
        stage("select", "--target", tag, "--params", str(params_file), "--profile", str(profile),
              "--model", str(model_dir / "model.json"), "--out", str(out))
        chosen = records.read(out, "selection")["path"]
        need = chosen["memory"]
        rows.append({"model": args.source, "stage": f"select@{tag}", "path": chosen["name"],
                     "need_gib": round(need["need_bytes"] / 2**30, 2), "have_gib": round(need["have_bytes"] / 2**30, 1),
                     "weights_gib": round(need["weights_bytes"] / 2**30, 2),
                     "runtime_measured": need["runtime_measured"] is not None})
    earlier = RESULTS / "scale.json"
    runs = json.loads(earlier.read_text())["runs"] if earlier.is_file() else {}
    runs[args.source] = {"command": " ".join(["python -m benchmarks.scale", *sys.argv[1:]]), "date": today(),
                         "host": host()}
    if args.until == "quantize":
        _calibrate_and_quantize(args, work, model_dir, params, quantize, measured, runs[args.source])
    kept = [r for r in json.loads(earlier.read_text())["rows"] if r["model"] != args.source] if earlier.is_file() else []
    write_json(RESULTS / "scale.json", {"runs": runs, "rows": kept + rows})
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))


def _calibrate_and_quantize(args, work: Path, model_dir: Path, params: Path, quantize: dict, measured, run: dict) -> None:
    from edgepath.core import records

    calibrated = work / "calibration"
    row = measured("calibrate", "calibrate", "--model", str(model_dir / "model.json"), "--params", str(params),
                   "--out", str(calibrated))
    record = records.read(calibrated / "calibration.json", "calibration")
    row.update(tokens=record["hessians"]["tokens"],
                    hessians_gib=round(sum(f["bytes"] for f in record["hessians"]["files"]) / 2**30, 2))
    for path in args.paths if args.paths is not None else quantize.get("paths") or []:
        row = measured(f"quantize@{path}", "quantize", "--model", str(model_dir / "model.json"), "--calibration",
                       str(calibrated), "--path", path, "--params", str(params), "--out", str(work / path))
        report = records.read(work / path / records.FILE_NAMES["quantization"], "quantization")
        row.update(gptq_time_s=report["gptq_time_s"], mean_increase_pct=report["fidelity"]["mean_increase_pct"],
                   worst_genre=report["fidelity"]["worst"]["genre"],
                   worst_increase_pct=report["fidelity"]["worst"]["increase_pct"])
    run.update(calibration={k: record["calibration"][k] for k in ("samples", "length")},
               held_out_windows_per_genre=record["reference"]["windows_per_genre"])


if __name__ == "__main__":
    main()
