"""The patch-verify stage: a weight path's artifact in its real engine, patched.

``run(path_name, artifact, model_dir, out, host)`` runs once per quantize-stage
path (the artifact is shared by every target that selects it) and writes the
``patch_verify`` record. What verifying a build means is its family's
(``paths.WeightPath.verify``): a vLLM checkpoint starts twice in vLLM with
edgepath's plugin and is compared with its own weights dequantized
(``paths.vllm_checkpoint``); a GGUF runs in llama.cpp against the file's own
weights read back, and a copy with its nibbles swapped must fail (``paths.gguf``).

Which targets the record verifies is the manifest's decision
(``coverage.why_host_does_not_stand_for``): those whose CPU has this host's kernel ISA
tier (``kernel_isa``), since that is what selects the kernels that ran.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..core import records, usage
from ..core.command import Command
from ..core.errors import EdgepathError
from ..rules import weight_paths
from ..rules.fleet import Calibration
from ..rules.profile import HardwareProfile
from ..rules.weight_paths import Stage


def run(path_name: str, artifact: str | os.PathLike, model_dir: str | os.PathLike,
        out: str | os.PathLike, host: HardwareProfile, corpus: str = Calibration.corpus,
        holdout: tuple[str, ...] = Calibration.holdout) -> dict[str, Any]:
    """Verify ``artifact``, the checkpoint of ``path_name`` (module docstring), on
    ``host``, this machine's profile; writes and returns the record. ``corpus`` and
    ``holdout``: the checkpoint's calibration, whose calibration documents the
    held-out text of the comparison leaves out (``calibration.held_out_genres``)."""
    started = time.monotonic()
    spec = weight_paths.get(path_name)
    if not spec.verifiable_by_patch_verify:
        raise EdgepathError(f"{path_name} is not a quantize stage's path; patch-verify runs "
                            f"{', '.join(n for n, p in weight_paths.PATHS.items() if p.verifiable_by_patch_verify)}")
    record = {**paths.of(spec).verify(Path(artifact), Path(model_dir), host, corpus, holdout), **usage.cost(started)}
    records.write(out, "patch_verify", record)
    return record


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet
    from . import probe

    calibration = fleet.calibration(args.params)
    model_dir = records.model_directory(args.model, records.read(args.model, "model"))
    record = run(args.path, Path(args.weights) / args.path, model_dir, args.out, probe.probe(),
                 calibration.corpus, calibration.holdout)
    if record["not_run"]:
        print(f"patch-verify@{args.path}: not run here: {record['not_run']} -> {args.out}")
        return
    print(f"patch-verify@{args.path}: {'passed' if record['passed'] else 'FAILED'}; "
          f"{paths.of(args.path).verify_line(record)} -> {args.out}")
    if not record["passed"]:
        raise EdgepathError(f"{args.path} failed verification: {'; '.join(record['failures'])}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", required=True, help=f"weight path: {', '.join(weight_paths.built_by(Stage.QUANTIZE))}")
    p.add_argument("--params", default="params.yaml",
                   help="the checkpoints' calibration: the held-out text leaves out what it calibrates on")
    p.add_argument("--weights", default="build/weights", help="where quantize@<path> wrote its checkpoints")
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--out", required=True, help="the record to write")


COMMAND = Command("patch-verify", "prove a path's artifact runs patched in its real engine", """\
    Start a weight path's artifact twice in real vLLM with edgepath's plugin (cold,
    then warm from the compile cache, each in a fresh process), with the path's
    engine kwargs and environment, and record per patch applied / not needed /
    not applicable / off with its evidence: the kernel each quantized layer ran,
    both start times and whether the warm one loaded the compiled graph, and the
    engine's output against the checkpoint's dequantized weights and bf16.
    Where this host cannot run the path, the record says why. A GGUF path
    runs in llama.cpp instead: its teacher-forced top-1 against the
    file's own weights read back in PyTorch, and a nibble-swapped copy that must
    fail. Exit status 2 when a path that ran fails.

    example:  edgepath patch-verify --path PATH --out build/verify/PATH.json""",
                  _arguments, _cmd)
