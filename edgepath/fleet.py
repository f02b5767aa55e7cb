"""The fleet and model settings in ``params.yaml``, validated.

``targets`` is a mapping keyed by device tag (DVC then names stages
``select@<tag>``, stable when targets are added or reordered). Every target has:

- ``profile``: ``probe`` (probe the build host) or a path to a captured profile JSON;
- ``priority``: ``speed`` or ``fidelity``;
- ``platform``: the container platform its stages run on (``linux/amd64``,
  ``linux/arm64``) or ``auto`` (from the probed architecture).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from .errors import EdgepathError
from .select import PRIORITIES

PROBE = "probe"
PLATFORMS = ("linux/amd64", "linux/arm64")
AUTO = "auto"
PLATFORM_OF_ARCH = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}
# a tag names DVC stages, an image tag and a DVC artifact, versioned as git tags
# <tag>@vX.Y.Z: GTO's artifact names end in a letter or digit and hold no "."
TAG_PATTERN = re.compile(r"^[a-z0-9](?:[a-z0-9_-]{0,61}[a-z0-9])?$")
_TARGET_FIELDS = ("profile", "priority", "platform")


@dataclasses.dataclass(frozen=True)
class Target:
    tag: str
    profile: str
    priority: str
    platform: str

    def resolve_platform(self, arch: str) -> str:
        if self.platform != AUTO:
            return self.platform
        if arch not in PLATFORM_OF_ARCH:
            raise EdgepathError(f"target {self.tag}: no container platform for architecture {arch!r}")
        return PLATFORM_OF_ARCH[arch]


@dataclasses.dataclass(frozen=True)
class Params:
    model_source: str
    targets: dict[str, Target]
    quantize: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The ``quantize`` namespace as written; ``quantize.Settings.from_params`` checks it."""

    def target(self, tag: str) -> Target:
        if tag not in self.targets:
            raise EdgepathError(f"unknown device tag {tag!r}; the fleet has: {', '.join(self.targets)}")
        return self.targets[tag]


def _target(tag: Any, spec: Any, root: Path) -> Target:
    where = f"params targets.{tag}"
    if not isinstance(tag, str) or not TAG_PATTERN.match(tag):
        raise EdgepathError(
            f"{where}: a device tag is lower-case letters, digits, '_' or '-' (at most 63), starting "
            f"and ending with a letter or digit (it names stages, a DVC artifact and git tags)"
        )
    if not isinstance(spec, dict):
        raise EdgepathError(f"{where}: expected a mapping with {', '.join(_TARGET_FIELDS)}")
    unknown = sorted(set(spec) - set(_TARGET_FIELDS))
    if unknown:
        raise EdgepathError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; known: {', '.join(_TARGET_FIELDS)}")
    missing = [f for f in _TARGET_FIELDS if f not in spec]
    if missing:
        raise EdgepathError(f"{where}: missing field(s) {', '.join(missing)}")
    profile, priority, platform = spec["profile"], spec["priority"], spec["platform"]
    if not isinstance(profile, str) or not profile:
        raise EdgepathError(f"{where}.profile: expected 'probe' or a path to a profile JSON")
    if profile != PROBE and not (root / profile).is_file():
        raise EdgepathError(f"{where}.profile: no such profile file {profile!r}")
    if priority not in PRIORITIES:
        raise EdgepathError(f"{where}.priority: {priority!r} is not one of {', '.join(PRIORITIES)}")
    if platform not in (*PLATFORMS, AUTO):
        raise EdgepathError(f"{where}.platform: {platform!r} is not one of {', '.join((*PLATFORMS, AUTO))}")
    return Target(tag=tag, profile=profile, priority=priority, platform=platform)


def parse(data: Any, root: str | Path = ".") -> Params:
    """Validate the parsed ``params.yaml``; file paths are relative to ``root``."""
    root = Path(root)
    if not isinstance(data, dict):
        raise EdgepathError("params: expected a mapping with 'model' and 'targets'")
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("source"), str):
        raise EdgepathError("params model.source: expected 'embedded' or a path to a Hugging Face directory")
    targets = data.get("targets")
    if not isinstance(targets, dict) or not targets:
        raise EdgepathError(
            "params targets: expected a mapping of device tag -> {profile, priority, platform} "
            "(a mapping, not a list, so DVC's stage names stay stable)"
        )
    quantize = data.get("quantize") or {}
    if not isinstance(quantize, dict):
        raise EdgepathError("params quantize: expected a mapping (see params.yaml's comments)")
    return Params(
        model_source=model["source"],
        targets={tag: _target(tag, spec, root) for tag, spec in targets.items()},
        quantize=quantize,
    )


def _read(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgepathError(f"{path}: no such params file") from None
    except yaml.YAMLError as e:
        raise EdgepathError(f"{path}: not valid YAML ({e})") from None


def load(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    return parse(_read(path), root=path.parent)


def check_keys(where: str, mapping: Any, known: set[str]) -> None:
    """Refuse a settings section that is not a mapping or has keys no stage reads."""
    if not isinstance(mapping, dict):
        raise EdgepathError(f"{where} must be a mapping, got {mapping!r}")
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise EdgepathError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")


def namespace(path: str | Path, name: str) -> dict[str, Any]:
    """Only the ``name`` namespace of a params file (``quantize``, ``benchmark``, ...):
    a stage that needs no fleet reads no fleet; {} where the file lacks it."""
    data = _read(Path(path))
    section = data.get(name) if isinstance(data, dict) else None
    if not isinstance(section or {}, dict):
        raise EdgepathError(f"{path}: {name}: expected a mapping")
    return section or {}
