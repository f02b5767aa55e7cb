"""The settings in ``params.yaml``, validated against one JSON Schema.

``edgepath/schemas/params.schema.json`` is the one description of the file: every
namespace, every key, its type and range. ``load`` checks the whole file against it;
``namespace`` checks the one namespace a stage reads (a stage that needs no fleet
reads no fleet). A file that does not conform is refused with one line naming the
file and the key path, e.g. ``params.yaml: quantize.gptq.damp: 'x' is not of type
'number'``. The file is read as ``files.read_yaml`` reads YAML: a regular file of UTF-8
text, no key twice, every key a string as written (a tag ``on`` stays ``'on'``, and is
refused as a tag). What a schema cannot say is checked here: a target's profile file
exists inside the repository (the params file's directory), where DVC can track it.

``targets`` is a mapping keyed by device tag (DVC then names stages
``select@<tag>``, stable when targets are added or reordered). A tag has one pattern,
the selection record schema's ``tag`` definition (the ``targets`` keys ``$ref`` it):
it names DVC stages, image tags, DVC artifacts and git tags, and it reaches the shell
of DVC's stage commands, so ``check_tag`` refuses anything else wherever a tag
arrives (``--target``). Every target has:

- ``profile``: ``probe`` (probe the build host) or a path to a captured profile JSON;
- ``priority``: ``speed`` or ``fidelity``;
- ``platform``: the container platform its stages run on (``linux/amd64``,
  ``linux/arm64``) or ``auto``: the one its kind of device runs on
  (``PLATFORM_OF_DEVICE``; ``check_platform`` refuses any other);
- ``engine`` (optional): ``vllm``, ``llama.cpp``, ``executorch`` or ``auto`` (the
  default): the engine its build runs in, ``select`` decides ``auto``;
- ``context`` (optional): the tokens per sequence its build must hold in memory beside
  its weights (``memory.DEFAULT_CONTEXT`` by default); ``select`` picks a build that fits.

``calibration`` is the real text that quantize and export calibrate on and that
quantize, patch-verify and benchmark score on (``Calibration``).

``edgepath params`` (``edgepath.stages.params``, the pipeline's first stage) checks the
whole file before any stage whose command DVC builds from its values can run.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from ..core import files, records
from ..core.errors import EdgepathError
from . import weight_paths
from .coverage import DeviceClass, device_class
from .memory import DEFAULT_CONTEXT
from .weight_paths import Stage

SCHEMA = "params"
"""``records.schema(SCHEMA)`` is params.yaml's JSON Schema."""
PROBE = "probe"
PLATFORMS = ("linux/amd64", "linux/arm64")
AUTO = "auto"
# The one platform a device's stages run on, by kind of device (coverage.device_class),
# for ``select`` and ``images`` alike: a CPU's vLLM build runs native to that CPU; a GPU's
# runs in vLLM's CUDA image, built for linux/amd64 only; a phone's build is an export,
# made by a toolchain for linux/amd64 only (Qualcomm's QNN SDK ships x86-64 host tools
# only). images.IMAGES builds each device's image for this platform (tests/test_images.py).
PLATFORM_OF_DEVICE = {DeviceClass.X86_CPU: "linux/amd64", DeviceClass.ARM_CPU: "linux/arm64",
                      DeviceClass.GPU: "linux/amd64", DeviceClass.PHONE: "linux/amd64"}
_WHY_PLATFORM = {DeviceClass.X86_CPU: "runs on the device's x86_64 CPU",
                 DeviceClass.ARM_CPU: "runs on the device's aarch64 CPU",
                 DeviceClass.GPU: "runs in vLLM's CUDA image, built for linux/amd64 only",
                 DeviceClass.PHONE: "is an export, made by a toolchain for linux/amd64 only"}


def _tag_schema() -> dict[str, Any]:
    return records.schema("selection")["$defs"]["tag"]


def check_tag(tag: Any, what: str = "device tag") -> str:
    """``tag`` where it is a device tag (the one pattern: the selection record schema's
    ``tag``, which params.yaml's ``targets`` keys also follow); otherwise refused, one
    line naming ``what`` (``--target``, say) and the rule."""
    schema = _tag_schema()
    if not (isinstance(tag, str) and re.search(schema["pattern"], tag)):
        raise EdgepathError(f"{what}: {tag!r} is not a device tag ({schema['hint']})")
    return tag


@dataclasses.dataclass(frozen=True)
class Target:
    tag: str
    profile: str
    priority: str
    platform: str
    engine: str = AUTO
    """The engine the target wants (``select.ENGINES``); ``auto``: the selector's measured choice."""
    context: int = DEFAULT_CONTEXT
    """Tokens per sequence its build's memory is counted at (``rules.memory``)."""

    def resolve_platform(self, profile) -> str:
        """The platform written, or for ``auto`` the one the device (``profile``, its
        ``HardwareProfile``) runs on: ``PLATFORM_OF_DEVICE`` of its kind."""
        if self.platform != AUTO:
            return self.platform
        return PLATFORM_OF_DEVICE[device_class(profile)]


def check_platform(tag: str, platform: str, path: Mapping[str, Any] | None, profile) -> None:
    """Refuse a container platform other than the one the device's stages run on
    (``PLATFORM_OF_DEVICE``; ``profile``: the device's ``HardwareProfile``; ``path``: its
    selection record's ``path``, named in the message, or None where none is chosen
    yet). ``select`` and ``images`` both ask this, so they accept the same fleet."""
    kind = device_class(profile)
    want = PLATFORM_OF_DEVICE[kind]
    if platform != want:
        build = f"its {path['name']} build" if path else "its build"
        raise EdgepathError(f"target {tag}: {build} {_WHY_PLATFORM[kind]}, so its platform must be {want} "
                            f"(or auto), not {platform}")


@dataclasses.dataclass(frozen=True)
class Params:
    model_source: str
    targets: dict[str, Target]
    quantize: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The ``quantize`` namespace as written (schema-checked)."""

    def target(self, tag: str) -> Target:
        """The target of ``tag`` (a ``--target`` argument): refused, naming the fleet's
        tags, where it is not a device tag or not one of the fleet's."""
        check_tag(tag, "--target")
        if tag not in self.targets:
            raise EdgepathError(f"unknown device tag {tag!r}; the fleet has: {', '.join(self.targets)}")
        return self.targets[tag]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The ``calibration`` namespace: absent keys keep these defaults."""

    corpus: str = "mix"
    """``mix`` (five genres: edgepath/text/genres.py), ``austen`` (Jane Austen's novels) or a
    directory of ``.txt`` files. ``mix`` by default: calibrated on Austen alone, the GPTQ
    builds lost two to three times more on other genres than on an Austen novel
    (benchmarks/results/calibration.md)."""
    holdout: tuple[str, ...] = ()
    """Documents scored on, never calibrated on, besides those the mix holds out itself."""
    samples: int = 256
    length: int = 256
    chat_fraction: float = 0.2
    """In the mix, the dialogue genre's share: one of five genres."""
    seed: int = 0

    @classmethod
    def from_params(cls, section: Mapping[str, Any] | None, where: str = "params") -> Calibration:
        section = check_namespace("calibration", section, where)
        return cls(**{**section, **({"holdout": tuple(section["holdout"])} if "holdout" in section else {})})


@dataclasses.dataclass(frozen=True)
class Gptq:
    """``quantize.gptq``: the settings of every GPTQ run, the quantize stage's and the
    XNNPACK export's (params.yaml gives each value's measurement)."""

    search: str = "output-error"
    damp: float = 0.01
    group_order: bool = True

    @classmethod
    def from_params(cls, quantize: Mapping[str, Any] | None, where: str = "params") -> Gptq:
        """From params.yaml's ``quantize`` namespace, checked against its schema."""
        return cls(**(check_namespace("quantize", quantize, where).get("gptq") or {}))


# Namespaces that list weight paths, and the stage that must build each: the names are
# the registry's (``weight_paths``), so a new path needs no edit of the schema.
_PATH_LISTS = {"quantize": Stage.QUANTIZE, "export": Stage.EXPORT}


def _check_paths(name: str, section: Mapping[str, Any], where: str) -> None:
    stage = _PATH_LISTS.get(name)
    if stage is None:
        return
    for key in ("paths", "true_sequential", "rotate"):
        for i, path in enumerate(section.get(key) or []):
            if path not in weight_paths.built_by(stage):
                raise EdgepathError(f"{where}: {name}.{key}.{i}: {path!r} is not one of the paths the {stage.value} "
                                    f"stage builds ({', '.join(weight_paths.built_by(stage))})"
                                    f"{weight_paths.renamed(path)}")


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
        if spec["profile"] != PROBE:
            _check_profile_path(spec["profile"], root, f"{where}: targets.{tag}.profile")
        targets[tag] = Target(tag=tag, **spec)
    return Params(model_source=data["model"]["source"], targets=targets, quantize=dict(data.get("quantize") or {}))


def _check_profile_path(profile: str, root: Path, where: str) -> None:
    """A captured profile is a file inside the repository: a relative path that stays in
    ``root`` (the params file's directory) once ``..`` and symlinks are resolved. DVC
    tracks no file outside it, and a path like /etc/passwd is no device's profile."""
    if PurePath(profile).is_absolute() or profile.startswith("~"):
        raise EdgepathError(f"{where}: {profile!r} is not a path inside the repository "
                            f"(give it relative to the params file, e.g. profiles/<tag>.json)")
    place = root / profile
    inside = Path(os.path.realpath(root))
    if not Path(os.path.realpath(place)).is_relative_to(inside):
        raise EdgepathError(f"{where}: {profile!r} leads outside the repository ({inside}); "
                            f"a captured profile lives inside it, e.g. profiles/<tag>.json")
    if not place.exists():
        raise EdgepathError(f"{where}: no such profile file {profile!r}")
    if not place.is_file():
        raise EdgepathError(f"{where}: {profile!r} is not a regular file; a profile is a JSON file")


def _read(path: Path) -> Any:
    return files.read_yaml(path, missing="the params file: run in the project's directory, or give --params FILE")


def load(path: str | Path = "params.yaml") -> Params:
    path = files.path_of(path, "--params")
    return parse(_read(path), root=path.parent, where=str(path))


def namespace(path: str | Path, name: str) -> dict[str, Any]:
    """Only the ``name`` namespace of a params file (``quantize``, ``benchmark``, ...),
    checked against the schema: a stage that needs no fleet reads no fleet; {} where
    the file lacks it."""
    data = _read(files.path_of(path, "--params"))
    if data is None:  # an empty file: every namespace absent
        data = {}
    if not isinstance(data, dict):
        validate(data, str(path))  # refused: not a mapping
    return check_namespace(name, data.get(name), str(path))


def calibration(path: str | Path) -> Calibration:
    """The ``calibration`` namespace of a params file, defaults filled in."""
    return Calibration.from_params(namespace(path, "calibration"), str(path))
