"""The params stage: ``params.yaml`` checked whole, before any stage whose command DVC
builds from its values can run (``edgepath.rules.fleet`` holds the settings and their
checks)."""

from __future__ import annotations

import argparse

from ..core import records
from ..core.command import Command
from ..rules.fleet import load

CHECKED = records.dumps({
    "checked": "params.yaml, whole: the schema (edgepath/schemas/params.schema.json), device tags, the weight "
               "paths of quantize.paths and export.paths, target profile files inside the repository",
    "why": "DVC builds stage commands from params values and runs them through a shell: the stages whose "
           "commands take a value depend on this file, so the check runs, and stops `dvc repro`, before them",
    "content": "constant: it never depends on the params, so depending on it re-runs nothing",
})
"""What ``edgepath params --out`` writes: the same bytes whatever the params say."""


def _write_checked(out: str) -> None:
    """Write ``CHECKED`` to ``out``, replacing only an earlier copy of it or an empty file."""
    data = CHECKED.encode()
    records.write_over_own(out, CHECKED, lambda p: p.stat().st_size in (0, len(data))
                           and p.read_bytes() in (b"", data), "an earlier params check's output")


def _cmd(args: argparse.Namespace) -> None:
    params = load(args.params)
    if args.out is not None:
        _write_checked(args.out)
    print(f"params: {args.params}: valid ({len(params.targets)} targets: {', '.join(params.targets)})"
          + (f" -> {args.out}" if args.out is not None else ""))


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--out", help="write the check's constant record here, once the file passed")


COMMAND = Command("params", "check params.yaml, before any stage runs", """\
    Check the whole params file: every namespace against its schema, the device
    tags (the one pattern of stage names, image tags and release tags), the
    weight paths listed, and that each captured profile is a file inside the
    repository. The pipeline's first stage: every stage whose command DVC
    builds from a params value (a tag, a path) depends on its --out, so a bad
    value stops `dvc repro` here, before any shell sees it. --out's content is
    constant, so a change to the params re-runs only the stages that read it.

    examples: edgepath params
              edgepath params --params params.yaml --out build/params.json""", _arguments, _cmd)
