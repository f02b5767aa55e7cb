"""``edgepath run``: one stage here, or inside its container image.

Inside an image (``--in-image``) the stage runs with the current directory mounted
at /work and the caller's uid (``images.container_command``), in the image
``images.image_for_stage`` picks for it: a device stage in its device's image,
export in the export image, every other stage in cpu-vllm. The stages ``run``
can run are given to ``run_command`` by whoever composes the commands (``cli``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from ..core import command as commands
from ..core.command import Command
from ..core.errors import EdgepathError


def run_in_image(stage: str, stage_args: list[str], *, image_name: str | None, tool: str | None,
                 params: str | os.PathLike, registry: str, version: str) -> None:
    """Run ``edgepath <stage> <stage_args>`` in its container image (``image_name``
    instead, where given) with ``tool`` (default: podman, else docker); refuse with
    the reason where the container could not start or the stage failed in it."""
    import shlex
    import shutil
    import subprocess
    import sys

    from ..rules import fleet
    from . import images

    images.check_registry(registry)
    if image_name:
        if image_name not in images.IMAGES:
            raise EdgepathError(f"unknown image {image_name!r}; images: {', '.join(images.IMAGES)}")
        image = images.IMAGES[image_name]
    else:
        image = images.image_for_stage(stage, stage_args, fleet.load(params), Path(params).parent)
    tool = tool or next((t for t in ("podman", "docker") if shutil.which(t)), None)
    if tool is None or not shutil.which(tool):
        raise EdgepathError(f"no container tool ({tool or 'podman or docker'}) on PATH; "
                            f"without --in-image the stage runs here")
    command = images.container_command(tool, image.reference(registry, version), image.platforms[0], Path.cwd(),
                                       stage, stage_args)
    print(f"run: {shlex.join(command)}", file=sys.stderr, flush=True)
    code = subprocess.call(command)
    if code:
        # 125-127: the container tool could not start the container (an image neither
        # built here nor pullable, most often), not the stage failing
        hint = "; build it with images/build, or set --registry/--version" if code in (125, 126, 127) else ""
        raise EdgepathError(f"{stage} in {image.reference(registry, version)} exited with {code}{hint}")


def run_command(stages: Sequence[Command]) -> Command:
    """``edgepath run``, over ``stages`` (the commands it may run)."""
    by_name = {stage.name: stage for stage in stages}

    def handler(args: argparse.Namespace) -> None:
        if not args.in_image:
            code = commands.run(by_name[args.stage], args.stage_args)
            if code:
                raise SystemExit(code)
            return
        run_in_image(args.stage, args.stage_args, image_name=args.image, tool=args.tool, params=args.params,
                     registry=args.registry, version=args.version)

    def arguments(p: argparse.ArgumentParser) -> None:
        from .images import add_reference_options

        p.add_argument("--in-image", action="store_true", help="run inside the stage's container image")
        p.add_argument("--image", help="this image instead (names: `edgepath images plan`)")
        p.add_argument("--tool", choices=("podman", "docker"), help="container tool (default: podman, else docker)")
        add_reference_options(p)
        p.add_argument("--params", default="params.yaml", help="the fleet (default: params.yaml)")
        p.add_argument("stage", choices=list(by_name), metavar="stage",
                       help=f"the stage to run: {', '.join(by_name)}")
        p.add_argument("stage_args", nargs=argparse.REMAINDER, help="its arguments")

    return Command("run", "run a stage here, or inside its image", """\
        Run one stage: here (the default, as `edgepath <stage>`), or with --in-image
        inside its container image, with the current directory mounted at /work (so
        the stage's paths must lie inside it) and the caller's uid. A device stage (probe, select with --target) runs in its
        device's image (a Graviton target in cpu-arm64, under emulation on an x86
        host); export in the export image; every other stage in cpu-vllm. Host-
        specific runtime flags go in $EDGEPATH_RUN_ARGS.

        examples: edgepath run --in-image select --target arm64-server \\
                      --profile build/profiles/arm64-server.json
                  edgepath run --in-image --image cpu-vllm probe""", arguments, handler)
