"""What every benchmark of the suite shares: where the project and its results are,
the host and load record each result names, the summary of repeated samples, and
the writers of the JSON and CSV records (``dvc plots`` draws the CSVs)."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from edgepath.core.usage import peak_rss_bytes
from edgepath.scoring.stats import spread

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

__all__ = ["RESULTS", "ROOT", "held_out_prompts", "host", "load", "params_with", "quantize_arm", "spread", "stage",
           "today", "write_csv", "write_json"]


def load() -> list[float]:
    """The host's load averages (1, 5, 15 min): a result taken on a busy host says so."""
    return [round(x, 2) for x in os.getloadavg()]


def host() -> dict[str, Any]:
    """The host a result was measured on: its probed profile (CPU tier included) and load."""
    from edgepath.stages.probe import probe

    return {**probe().summary(), "loadavg": load(), "cpus": os.cpu_count()}


def today() -> str:
    return time.strftime("%Y-%m-%d")


def write_json(path: str | os.PathLike, record: Mapping[str, Any]) -> Path:
    """``record`` as indented JSON at ``path``, replaced whole (written beside, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)
    return path


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> Path:
    """``rows`` (one dict each; the header is every key, in the order the rows first
    name them, a row without one leaving it empty) as CSV at ``path``, replaced whole."""
    rows = list(rows)
    text = io.StringIO()
    if rows:
        writer = csv.DictWriter(text, fieldnames=list(dict.fromkeys(k for r in rows for k in r)),
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text.getvalue())
    os.replace(partial, path)
    return path


def stage(*args: str) -> tuple[float, int]:
    """Run ``edgepath ARGS`` (a stage, in its own process); (wall seconds, the child's
    peak RSS in bytes: ``wait4`` reports that child only). A failure stops the benchmark."""
    import subprocess
    import sys

    cmd = [str(Path(sys.executable).parent / "edgepath"), *args]
    started = time.monotonic()
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed")
    return time.monotonic() - started, peak_rss_bytes(usage)


def quantize_arm(model_record: Path, calibration: Path, path: str, out: Path, params: Path) -> dict[str, Any]:
    """Run the real quantize stage (its own process) for ``path``; the stage's own
    figures: held-out perplexity increase per genre, their mean and the worst, GPTQ's
    time, the stage's wall time and peak RSS."""
    from edgepath.core import records

    wall, peak = stage("quantize", "--model", str(model_record), "--calibration", str(calibration),
                       "--path", path, "--out", str(out), "--params", str(params))
    report = records.read(out / records.FILE_NAMES["quantization"], "quantization")
    fidelity = report["fidelity"]
    return {"mean_increase_pct": fidelity["mean_increase_pct"], "worst_genre": fidelity["worst"]["genre"],
            "worst_increase_pct": fidelity["worst"]["increase_pct"],
            **{f"{g}_increase_pct": v["increase_pct"] for g, v in fidelity["genres"].items()},
            "gptq_time_s": report["gptq_time_s"], "wall_time_s": round(wall, 1),
            "peak_rss_gib": round(peak / 2**30, 2)}


def params_with(path: Path, **namespaces: Mapping[str, Any]) -> Path:
    """The project's params.yaml with ``namespaces``' keys replaced (one level deep:
    ``calibration={"samples": 128}`` keeps the namespace's other keys), written to ``path``."""
    import yaml

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, values in namespaces.items():
        params[name] = {**(params.get(name) or {}), **values}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def held_out_prompts(model: Path, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of ``tokens`` token ids each: the held-out windows every
    benchmark scores (``calibration.held_out_genres``), the genres taken in turn."""
    from transformers import AutoTokenizer

    from edgepath.rules import fleet
    from edgepath.text import calibration

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    text = fleet.calibration(str(ROOT / "params.yaml"))
    sets = calibration.held_out_genres(tokenizer, calibration.load_corpus(text.corpus, list(text.holdout)),
                                       count, tokens)
    return [window for row in zip(*(s.tolist() for s in sets.values())) for window in row][:count]

