"""The select stage: one target's weight path, with the reason, as a ``selection`` record.

The decision is ``edgepath.rules.select.select_weight_path``; this module reads the
target's profile and the model record, checks the container platform, and writes
what the manifest needs of the target.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..core.command import Command
from ..core.errors import EdgepathError
from ..rules.memory import DEFAULT_CONTEXT, ModelShape
from ..rules.profile import HardwareProfile
from ..rules.select import AUTO, ENGINES, RULES, WeightPath, select_weight_path


def selection_record(
    tag: str, priority: str, platform: str, profile: HardwareProfile, model_fingerprint: str,
    path: WeightPath, engine: str = AUTO,
) -> dict[str, Any]:
    """The select stage's output: what the manifest needs of one target. ``engine``: the
    engine the target asked for (``path`` names the one it got)."""
    from ..core.records import envelope

    return {
        **envelope("selection"),
        "tag": tag,
        "priority": priority,
        "engine": engine,
        "platform": platform,
        "profile": {"digest": profile.digest(), "summary": profile.summary()},
        "model": {"fingerprint": model_fingerprint},
        "path": path.to_dict(),
    }


def _cmd(args: argparse.Namespace) -> None:
    from ..core import files, records
    from ..rules import fleet, shapes

    tag, priority, platform, engine, context = args.tag, args.priority, args.platform, args.engine, args.context
    if args.target:
        target = fleet.load(args.params).target(args.target)
        tag, priority, platform, engine, context = (target.tag, target.priority, target.platform, target.engine,
                                                    target.context)
    profile = HardwareProfile.from_dict(records.read(files.path_of(args.profile, "--profile"), "profile"))
    linears, fingerprint, model = None, None, None
    if args.model is not None:
        model_record = records.read(files.path_of(args.model, "--model"), "model")
        model = ModelShape.from_record(model_record)
        linears = shapes.block_linears(model.tensors)
        fingerprint = model_record["fingerprint"]
    path = select_weight_path(profile, priority, linears=linears, engine=engine, model=model, context=context)
    chosen = path.to_dict()
    platform = fleet.Target(tag, "", priority, platform, engine).resolve_platform(profile)
    fleet.check_platform(tag, platform, chosen, profile)
    if args.out is not None and fingerprint is None:
        raise EdgepathError("select --out writes a selection record, which needs --model")
    if args.out is not None:
        record = selection_record(tag, priority, platform, profile, fingerprint, path, engine)
        records.write(args.out, "selection", record)
        need = chosen["memory"]
        print(f"select@{tag}: {path.name} (in {chosen['engine']}{f', group {path.group_size}' if path.group_size else ''}"
              f", needs {need['need_bytes'] / 2**30:.2f} of {need['have_bytes'] / 2**30:.2f} GiB {need['have']})"
              f" -> {args.out}")
    else:
        sys.stdout.write(records.dumps(chosen))


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, help="profile record (from `edgepath probe`)")
    p.add_argument("--priority", default="speed", help="speed (default) or fidelity")
    p.add_argument("--engine", default=AUTO, help=f"{', '.join(ENGINES)} (default: {AUTO})")
    p.add_argument("--platform", default="auto", help="container platform (default: from the profile)")
    p.add_argument("--tag", default="device", help="device tag recorded in the selection")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help=f"tokens per sequence the build must fit in memory with --model (default: {DEFAULT_CONTEXT})")
    p.add_argument("--target", help="take tag, priority, engine and platform from this target in the params file")
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--model", help="model record (from `edgepath model`)")
    p.add_argument("--out", help="write the selection record here (default: print the path)")


COMMAND = Command("select", "choose a device's weight path", f"""\
    Choose the weight path for a device profile, with the reason.

{RULES}

    --model fixes the group size from the model's layer shapes and makes the build fit
    the device's memory at --context tokens (a path that does not fit gives way to a
    smaller one, or the device is refused with the figures); --out writes the
    selection record the manifest reads.

    examples: edgepath select --profile profiles/x86-avx2.json
              edgepath select --target host --profile build/profiles/host.json \\
                  --model build/model/model.json --out build/selections/host.json""", _arguments, _cmd)
