"""Typed, versioned records: the only data that crosses a stage boundary.

Each record is a JSON object with ``kind`` (``edgepath.<name>``) and
``schema_version``, checked against ``edgepath/schemas/<name>.schema.json``
when written and when read. A reader accepts only the schema version it was
built for; a record from another version is refused with the file named,
never half-understood.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from . import atomic
from .errors import EdgepathError

SCHEMA_VERSIONS = {"profile": 1, "model": 1, "selection": 3, "manifest": 5, "quantization": 1,
                   "engine_check": 2, "patch_verify": 1, "control": 1, "benchmark": 1,
                   "export": 1, "pull": 2, "releases": 1, "device": 1}
# Kinds a reader accepts from a newer writer, ignoring the keys it does not know:
# profiles are captured on devices that may run a newer edgepath.
FORWARD_COMPATIBLE = frozenset({"profile"})


@functools.cache
def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of record ``name`` (one of ``SCHEMA_VERSIONS``)."""
    if name not in SCHEMA_VERSIONS:
        raise KeyError(f"no record kind {name!r}; known: {sorted(SCHEMA_VERSIONS)}")
    text = resources.files("edgepath.schemas").joinpath(f"{name}.schema.json").read_text()
    return json.loads(text)


@functools.cache
def _registry():
    """All edgepath schemas by ``$id``, so one may ``$ref`` another."""
    from referencing import Registry, Resource

    return Registry().with_resources(
        (schema(n)["$id"], Resource.from_contents(schema(n))) for n in SCHEMA_VERSIONS
    )


def envelope(name: str) -> dict[str, Any]:
    """The two keys every record of ``name`` starts with."""
    return {"kind": f"edgepath.{name}", "schema_version": SCHEMA_VERSIONS[name]}


def validate(name: str, record: Any, where: str = "record") -> None:
    """Raise EdgepathError naming ``where`` and the first failing field."""
    import jsonschema  # pure Python; imported here to keep `edgepath --help` instant

    if isinstance(record, dict):
        got = (record.get("kind"), record.get("schema_version"))
        want = (f"edgepath.{name}", SCHEMA_VERSIONS[name])
        newer_ok = name in FORWARD_COMPATIBLE and isinstance(got[1], int) and got[1] > want[1]
        if got[0] == want[0] and got[1] != want[1] and not newer_ok:
            raise EdgepathError(
                f"{where}: {name} record has schema_version {got[1]!r}; this edgepath "
                f"reads version {want[1]} (re-run the stage that wrote it)"
            )
    validator = jsonschema.Draft202012Validator(schema(name), registry=_registry())
    error = jsonschema.exceptions.best_match(validator.iter_errors(record))
    if error is not None:
        field = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise EdgepathError(f"{where}: not a valid {name} record: at {field}: {error.message}")


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def write(path: str | os.PathLike, name: str, record: dict[str, Any]) -> None:
    """Validate ``record`` as ``name`` and write it atomically to ``path``."""
    validate(name, record, where=str(path))
    atomic.write_text(path, dumps(record))


def read(path: str | os.PathLike, name: str) -> dict[str, Any]:
    """Read and validate a record of ``name``; errors name the file."""
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgepathError(f"{path}: no such file (has the stage that writes it run?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgepathError(f"{path}: not valid JSON ({e})") from None
    validate(name, record, where=str(path))
    return record
