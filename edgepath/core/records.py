"""Typed, versioned records: the only data that crosses a stage boundary.

Each record is a JSON object with ``kind`` (``edgepath.<name>``) and
``schema_version``, checked against ``edgepath/schemas/<name>.schema.json``
when written and when read. A reader accepts only the schema version it was
built for; a record from another version is refused with the file named,
never half-understood.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from . import atomic, files
from .errors import EdgepathError

SCHEMA_VERSIONS = {"profile": 1, "model": 1, "calibration": 1, "selection": 6, "manifest": 10, "quantization": 2,
                   "engine_check": 3, "gguf_check": 1, "patch_verify": 3, "control": 1, "benchmark": 2,
                   "export": 2, "pull": 2, "releases": 1, "device": 1}
# Where a command puts its record in its output directory: read by the stage after it
# (the manifest, the bundle) without importing the stage that wrote it, and the mark
# that the directory is that command's own output (``output_directory``).
FILE_NAMES = {"model": "model.json", "calibration": "calibration.json", "quantization": "quantization_report.json",
              "engine_check": "engine_check.json", "gguf_check": "gguf_check.json", "export": "export.json",
              "control": "control.json",
              "benchmark": "benchmark.json", "device": "edgepath-device.json", "pull": "edgepath-pull.json"}
# Documents checked against a schema of their own that are not records (no kind, no
# schema_version): params.yaml.
DOCUMENT_SCHEMAS = ("params",)
# Arrays whose items a key names, which JSON Schema cannot make unique: (array, key).
UNIQUE_ITEMS = {"manifest": ("targets", "tag")}
# Kinds a reader accepts from a newer writer, ignoring the keys it does not know:
# profiles are captured on devices that may run a newer edgepath.
FORWARD_COMPATIBLE = frozenset({"profile"})


@functools.cache
def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of record ``name`` (one of ``SCHEMA_VERSIONS``), or of a
    document that is not a record (one of ``DOCUMENT_SCHEMAS``)."""
    if name not in SCHEMA_VERSIONS and name not in DOCUMENT_SCHEMAS:
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
        if isinstance(got[0], str) and got[0] != want[0]:
            raise EdgepathError(f"{where}: a record of kind {got[0]!r}, not an edgepath {name} record")
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
    if name in UNIQUE_ITEMS:
        array, key = UNIQUE_ITEMS[name]
        seen = [item[key] for item in record[array]]
        twice = sorted({k for k in seen if seen.count(k) > 1})
        if twice:
            raise EdgepathError(f"{where}: not a valid {name} record: {array} has {key} {', '.join(twice)} more "
                                f"than once")


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def write(path: str | os.PathLike, name: str, record: dict[str, Any]) -> None:
    """Validate ``record`` as ``name`` and write it atomically to ``path``. An existing
    ``path`` is replaced only when it is an earlier record of ``name`` (or empty):
    never a directory, a user's file, or another kind of record."""
    validate(name, record, where=str(path))
    write_over_own(path, dumps(record), lambda p: _is_own(p, name, allow_empty=True),
                   f"an edgepath {name} record", argument="output file")


def write_over_own(out: str | os.PathLike, text: str, is_own: Callable[[Path], bool], what: str,
                   argument: str = "--out") -> None:
    """Write ``text`` atomically to the file ``out`` (named ``argument`` where it is
    empty). An existing ``out`` is replaced only when it is a regular file, not a link,
    that ``is_own`` recognises as an earlier ``what``: a user's file, a directory or a
    link is refused, naming it, and left as it was."""
    path = files.path_of(out, argument)
    if (path.exists() or path.is_symlink()) and (path.is_symlink() or not path.is_file() or not is_own(path)):
        raise EdgepathError(f"{out}: exists and is not {what}; not replaced (remove it, or write elsewhere)")
    atomic.write_text(path, text)


def read(path: str | os.PathLike, name: str, missing: str = "has the stage that writes it run?") -> dict[str, Any]:
    """Read and validate a record of ``name``; errors name the file, and a missing
    one says ``missing`` (how to make it)."""
    record = files.read_json(path, missing=missing)
    validate(name, record, where=str(path))
    return record


def _is_own(path: Path, name: str, allow_empty: bool = False) -> bool:
    """Whether ``path`` is a regular file holding a record of kind ``name`` (any
    schema version: a stage rewrites its own older output)."""
    if path.is_symlink() or not path.is_file():
        return False
    if allow_empty and path.stat().st_size == 0:
        return True
    try:
        data = files.read_json(path)
    except EdgepathError:
        return False
    return data.get("kind") == f"edgepath.{name}"


def check_output_directory(out: str | os.PathLike, name: str, sources: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse ``out`` as the output directory of a command whose record of kind ``name``
    sits in it (as ``FILE_NAMES[name]``), naming why, before anything is written; the
    absolute path to write where it may be replaced. That record marks the directory
    as the command's own: ``out`` may be missing, empty, or hold that record. A
    directory of anything else, a file, the current directory or one above it, and an
    ``out`` that is, holds or lies inside one of ``sources`` (what the command reads)
    are refused. A long stage calls this first, so a bad ``--out`` costs no time."""
    out = files.path_of(out, "--out")
    return files.check_replaceable_directory(
        out, lambda place: _is_own(place / FILE_NAMES[name], name),
        f"edgepath did not write there ({{shown}}): not the {name} stage's output (no {FILE_NAMES[name]})",
        reads=sources)


@contextlib.contextmanager
def output_directory(out: str | os.PathLike, name: str,
                     sources: Iterable[str | os.PathLike] = ()) -> Iterator[Path]:
    """``atomic.directory(out)`` once ``check_output_directory`` accepts ``out``."""
    place = check_output_directory(out, name, sources)
    with atomic.directory(place) as scratch:
        yield scratch


def model_directory(record_path: str | os.PathLike, record: dict[str, Any]) -> Path:
    """The Hugging Face directory a model record (read from ``record_path``) describes."""
    return (Path(record_path).parent / record["directory"]).resolve()


@functools.cache
def _strict_validator(name: str):
    """A validator of schema ``name`` whose integers are ints: not floats without a
    fraction (YAML's ``3.0``, which JSON Schema counts as an integer), never bools."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    types = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(base, type_checker=types)(schema(name), registry=_registry())


def problem(name: str, data: Any, skip: Callable[[Any], bool] | None = None) -> str | None:
    """Why ``data`` fails schema ``name``, as one line that starts with the key path
    (``quantize.gptq.damp: 'x' is not of type 'number'``), or None where it passes.
    ``skip(error)``: errors to leave out (a ``jsonschema.ValidationError``)."""
    from jsonschema.exceptions import best_match

    errors = (e for e in _strict_validator(name).iter_errors(data) if skip is None or not skip(e))
    error = best_match(errors)
    return None if error is None else _describe(error)


def _describe(error) -> str:
    path = [str(p) for p in error.absolute_path]
    subschema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = list(subschema.get("properties", {}))
        patterns = list(subschema.get("patternProperties", {}))
        extra = sorted(str(k) for k in error.instance
                       if k not in known and not any(re.search(p, str(k)) for p in patterns))
        known_text = f" (known: {', '.join(known)})" if known else ""
        if len(extra) == 1:
            return f"{_key_path([*path, extra[0]])}: unknown key{known_text}"
        return f"{_key_path(path)}: unknown keys {', '.join(extra)}{known_text}"
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        if len(missing) == 1:
            return f"{_key_path([*path, missing[0]])}: missing (required)"
        return f"{_key_path(path)}: missing required keys {', '.join(missing)}"
    if "propertyNames" in error.relative_schema_path:
        path.append(str(error.instance))  # a key that is not a valid name: the key is the place
    hint = subschema.get("hint")
    return f"{_key_path(path)}: {error.message}" + (f" ({hint})" if hint else "")


def _key_path(parts: list[str]) -> str:
    return ".".join(parts) or "(top level)"


def versions(*distributions: str) -> dict[str, str | None]:
    """What made a record: edgepath's version, then each installed distribution's (None
    where one is not installed), in the order given."""
    from .. import __version__

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"edgepath": __version__, **{name: version(name) for name in distributions}}


def tool(distribution: str) -> str:
    """``"<distribution> <version>"``, as a record names the engine that produced a figure."""
    return f"{distribution} {importlib.metadata.version(distribution)}"
