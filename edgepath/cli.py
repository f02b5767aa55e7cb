"""The ``edgepath`` command: every pipeline stage, usable with or without DVC.

Each command (its arguments and its handler) lives in the module of its stage, as
that module's ``COMMAND`` (``edgepath.core.command.Command``); this module only composes
them under one parser. A stage's DVC entry point (``stages/<name>.py``) runs its
own module's ``COMMAND`` and does not import this one.
"""

from __future__ import annotations

import argparse

from . import __version__
from .core import command
from .delivery import container, images, pull, release, serve
from .stages import (benchmark, bundle, calibrate, control, engine_check, export, manifest, model, params,
                     patch_verify, probe, quantize, select)

_DESCRIPTION = """\
edgepath builds, for every device of a fleet, the fastest faithful build of one
language model it can run, and a manifest that says which weight path each
device gets and why. `dvc repro` runs the stages below for every target in
params.yaml; each stage is also a command of its own."""

STAGES = (params.COMMAND, model.COMMAND, probe.COMMAND, select.COMMAND, calibrate.COMMAND, quantize.COMMAND,
          engine_check.COMMAND, patch_verify.COMMAND, control.COMMAND, export.COMMAND, benchmark.COMMAND,
          manifest.COMMAND, bundle.COMMAND)
"""The pipeline's commands, in pipeline order: `edgepath run` runs any of them."""
AROUND = (images.COMMAND, container.run_command(STAGES), *pull.COMMANDS, serve.COMMAND, release.COMMAND)
"""The commands around the stages: images, containers, remotes, versions."""
COMMANDS = (*STAGES, *AROUND)
"""Every command, in the order `edgepath --help` lists them."""


def _epilog() -> str:
    return (f"the pipeline's stages, in order: {', '.join(c.name for c in STAGES)}; around them: "
            f"{', '.join(c.name for c in AROUND)}. Run `edgepath <command> --help` for each.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command.PROG, description=_DESCRIPTION, epilog=_epilog(),
                                     formatter_class=command.formatter)
    parser.add_argument("--version", action="version", version=f"edgepath {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<stage>", required=True)
    for c in COMMANDS:
        c.add_to(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return command.call(args.command, args)


if __name__ == "__main__":
    raise SystemExit(main())
