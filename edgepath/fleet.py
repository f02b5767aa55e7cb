"""The settings in ``params.yaml``, validated against one JSON Schema.

``edgepath/schemas/params.schema.json`` is the one description of the file: every
namespace, every key, its type and range. ``load`` checks the whole file against it;
``namespace`` checks the one namespace a stage reads (a stage that needs no fleet
reads no fleet). A file that does not conform is refused with one line naming the
file and the key path, e.g. ``params.yaml: quantize.gptq.damp: 'x' is not of type
'number'``. What a schema cannot say is checked here: a target's profile file exists.

``targets`` is a mapping keyed by device tag (DVC then names stages
``select@<tag>``, stable when targets are added or reordered). Every target has:

- ``profile``: ``probe`` (probe the build host) or a path to a captured profile JSON;
- ``priority``: ``speed`` or ``fidelity``;
- ``platform``: the container platform its stages run on (``linux/amd64``,
  ``linux/arm64``) or ``auto`` (from the probed architecture).

``calibration`` is the real text that quantize and export calibrate on and that
quantize, patch-verify and benchmark score on (``Calibration``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import records, weight_paths
from .errors import EdgepathError
from .weight_paths import Stage

SCHEMA = "params"
"""``records.schema(SCHEMA)`` is params.yaml's JSON Schema."""
PROBE = "probe"
PLATFORMS = ("linux/amd64", "linux/arm64")
AUTO = "auto"
PLATFORM_OF_ARCH = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}


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


def check_platform(tag: str, platform: str, path: Mapping[str, Any], profile) -> None:
    """Refuse a container platform that the device's build cannot run on: a build that
    runs in vLLM on the device's own CPU (``path``: a selection record's ``path``, with
    ``name`` and ``runs_in_vllm``; ``profile``: the device's ``HardwareProfile``) needs
    the platform native to that CPU (an arm64 server's vLLM build is linux/arm64)."""
    native = PLATFORM_OF_ARCH.get(profile.arch)
    if path["runs_in_vllm"] and profile.accelerator == "none" and platform != native:
        raise EdgepathError(
            f"target {tag}: its {path['name']} build runs on the device's {profile.arch} CPU, so its "
            f"platform must be {native}, not {platform}"
        )


@dataclasses.dataclass(frozen=True)
class Params:
    model_source: str
    targets: dict[str, Target]
    quantize: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The ``quantize`` namespace as written (schema-checked)."""

    def target(self, tag: str) -> Target:
        if tag not in self.targets:
            raise EdgepathError(f"unknown device tag {tag!r}; the fleet has: {', '.join(self.targets)}")
        return self.targets[tag]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The ``calibration`` namespace: absent keys keep these defaults."""

    corpus: str = "austen"
    """``austen`` (Jane Austen's novels) or a directory of ``.txt`` files."""
    holdout: tuple[str, ...] = ("persuasion",)
    """Documents scored on, never calibrated on."""
    samples: int = 128
    length: int = 256
    chat_fraction: float = 0.25
    seed: int = 0

    @classmethod
    def from_params(cls, section: Mapping[str, Any] | None, where: str = "params") -> Calibration:
        section = check_namespace("calibration", section, where)
        return cls(**{**section, **({"holdout": tuple(section["holdout"])} if "holdout" in section else {})})


# Namespaces that list weight paths, and the stage that must build each: the names are
# the registry's (``weight_paths``), so a new path needs no edit of the schema.
_PATH_LISTS = {"quantize": Stage.QUANTIZE, "export": Stage.EXPORT}


def _check_paths(name: str, section: Mapping[str, Any], where: str) -> None:
    stage = _PATH_LISTS.get(name)
    if stage is None:
        return
    for i, path in enumerate(section.get("paths") or []):
        if path not in weight_paths.built_by(stage):
            raise EdgepathError(f"{where}: {name}.paths.{i}: {path!r} is not one of the paths the {stage.value} "
                                f"stage builds ({', '.join(weight_paths.built_by(stage))})")


def validate(data: Any, where: str = "params") -> None:
    """Refuse ``data`` (a parsed params file) unless it conforms to the schema and its
    path lists name paths of the registry, naming ``where`` and the key path."""
    found = records.problem(SCHEMA, data)
    if found is not None:
        raise EdgepathError(f"{where}: {found}")
    for name in _PATH_LISTS:
        _check_paths(name, data.get(name) or {}, where)


def _top_level_required(error) -> bool:
    return error.validator == "required" and not error.absolute_path


def check_namespace(name: str, section: Any, where: str = "params") -> dict[str, Any]:
    """``section``, the ``name`` namespace of a params file, checked against its part of
    the schema; ``{}`` for an absent (None) namespace."""
    if name not in records.schema(SCHEMA)["properties"]:
        raise KeyError(f"params.yaml has no namespace {name!r}")
    if section is None:
        return {}
    found = records.problem(SCHEMA, {name: section}, skip=_top_level_required)
    if found is not None:
        raise EdgepathError(f"{where}: {found}")
    _check_paths(name, section, where)
    return dict(section)


def parse(data: Any, root: str | Path = ".", where: str = "params") -> Params:
    """Validate the parsed ``params.yaml`` (``where`` names it in errors); profile
    paths are relative to ``root``."""
    validate(data, where)
    root = Path(root)
    targets = {}
    for tag, spec in data["targets"].items():
        if spec["profile"] != PROBE and not (root / spec["profile"]).is_file():
            raise EdgepathError(f"{where}: targets.{tag}.profile: no such profile file {spec['profile']!r}")
        targets[tag] = Target(tag=tag, **spec)
    return Params(model_source=data["model"]["source"], targets=targets, quantize=dict(data.get("quantize") or {}))


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
    return parse(_read(path), root=path.parent, where=str(path))


def namespace(path: str | Path, name: str) -> dict[str, Any]:
    """Only the ``name`` namespace of a params file (``quantize``, ``benchmark``, ...),
    checked against the schema: a stage that needs no fleet reads no fleet; {} where
    the file lacks it."""
    data = _read(Path(path))
    if data is None:  # an empty file: every namespace absent
        data = {}
    if not isinstance(data, dict):
        validate(data, str(path))  # refused: not a mapping
    return check_namespace(name, data.get(name), str(path))


def calibration(path: str | Path) -> Calibration:
    """The ``calibration`` namespace of a params file, defaults filled in."""
    return Calibration.from_params(namespace(path, "calibration"), str(path))
