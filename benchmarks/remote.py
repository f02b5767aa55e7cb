"""Benchmark: push and pull throughput of the default model's builds, against the
default directory remote and a real S3 server (SeaweedFS on loopback).

    .venv/bin/python -m benchmarks.remote --project DIR     # ~3 min on 2 cores

``DIR`` is a project after `dvc repro` (``scripts/run.sh``), with its `.dvc/cache`.
Each round, for each remote in turn (interleaved, directory then S3):

- ``push``: `dvc push` of every stage output to a new, empty location
  (``-j`` DVC's default), timed end to end: bytes in the cache / seconds.
- ``pull``: `edgepath pull <tag>` of each device with a build into a new
  directory of a fresh clone, timed end to end (download and the sha256 of
  every file): the build's bytes / seconds.

Medians and min-max over the rounds; the ratio is S3's median over the
directory's. Results: ``benchmarks/results/remote.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgepath.core import records
from edgepath.delivery import pull
from tests.s3server import SeaweedS3

from .common import ROOT


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")


def _cache_bytes(project: Path) -> int:
    return sum(p.stat().st_size for p in (project / ".dvc" / "cache").rglob("*") if p.is_file())


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, required=True, help="a project after `dvc repro`")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "remote.json")
    args = parser.parse_args()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "b@b"}
    with tempfile.TemporaryDirectory(prefix="edgepath-remote-bench.") as tmp:
        tmp = Path(tmp)
        project = tmp / "project"
        print(f"copying {args.project} ...", file=sys.stderr)
        shutil.copytree(args.project, project, symlinks=True, ignore=shutil.ignore_patterns("remote"))
        manifest = records.read(project / "manifest.json", "manifest")
        devices = {t["tag"]: sum(f["size"] for f in pull.device_files(t))
                   for t in manifest["targets"] if t["artifacts"]}
        cache = _cache_bytes(project)
        server = SeaweedS3(tmp / "s3").start()
        try:
            results = {"push": {"directory": [], "s3": []}, "pull": {"directory": [], "s3": []}}
            for r in range(args.rounds):
                for kind in ("directory", "s3"):
                    name = f"{kind}{r}"
                    if kind == "directory":
                        _run(["dvc", "remote", "add", "-f", name, str(tmp / f"remote-{r}")], project, env)
                    else:
                        server.configure(project, name, f"round-{r}", env)
                    start = time.perf_counter()
                    _run(["dvc", "push", "-r", name], project, env)
                    seconds = time.perf_counter() - start
                    results["push"][kind].append(cache / seconds / 2**20)
                    print(f"round {r + 1}/{args.rounds} {kind}: push {cache / 2**20:.0f} MiB in {seconds:.1f} s",
                          file=sys.stderr)
                    for tag, size in devices.items():
                        dest = tmp / f"pull-{name}-{tag}"
                        start = time.perf_counter()
                        _run(["edgepath", "pull", tag, "-r", name, "-o", str(dest)], project, env)
                        seconds = time.perf_counter() - start
                        results["pull"][kind].append(size / seconds / 2**20)
                        shutil.rmtree(dest)
                    print(f"round {r + 1}/{args.rounds} {kind}: pulled {len(devices)} devices", file=sys.stderr)
        finally:
            server.stop()
    record = {
        "what": "dvc push of every stage output, edgepath pull of each device with a build (MiB/s, end to end)",
        "host": {"cpus": os.cpu_count(), "machine": os.uname().machine},
        "cache_bytes": cache, "devices": devices, "rounds": args.rounds,
        "mib_per_s": {op: {kind: _summary(v) for kind, v in by.items()} for op, by in results.items()},
    }
    for op in ("push", "pull"):
        by = record["mib_per_s"][op]
        record["mib_per_s"][op]["s3_over_directory"] = by["s3"]["median"] / by["directory"]["median"]
        print(f"{op}: directory {by['directory']['median']:.0f} MiB/s "
              f"({by['directory']['min']:.0f}-{by['directory']['max']:.0f}), S3 {by['s3']['median']:.0f} MiB/s "
              f"({by['s3']['min']:.0f}-{by['s3']['max']:.0f}), S3/directory {by['s3_over_directory']:.2f}x")
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
