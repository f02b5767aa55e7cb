"""The control stage: the model's own bf16 checkpoint as the GGUF files llama.cpp runs.

Lifecycle of ``run(model_record_path, out, types, threads)``:

1. Convert the model stage's bf16 directory to an F16 GGUF with llama.cpp's own
   converter (``formats.gguf_file.convert_to_gguf``): F16 holds bf16's values
   up to rounding, and is what llama.cpp's quantizer starts from.
2. Quantize the F16 file to each type of ``types`` (``Q4_K_M``, llama.cpp's
   usual 4-bit choice, and ``Q4_0``, its plain 4-bit format) with
   ``llama_model_quantize``. A type ``<type>-imatrix`` (``Q4_0-imatrix``: the
   strongest baseline llama.cpp offers at Q4_0's size) is quantized by
   ``llama-quantize`` with an importance matrix that ``llama-imatrix`` computed
   over the quantize stage's calibration text: the same windows (``calibration``
   settings), decoded to text, in chunks of their length.
3. Load each file once in llama.cpp and record what it is: bits per weight as
   llama.cpp counts them (tensor bytes x 8 / parameters: on a model whose rows
   are not a multiple of 256 wide, "Q4_K_M" falls back to Q5_0/Q8_0 for most
   tensors), size, sha256, and the llama.cpp build's ISA features.

Everything is written into a scratch directory that becomes ``out`` only when
all files and ``control.json`` are complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ..core import records, usage
from ..core.command import Command
from ..core.errors import EdgepathError
from ..core.files import sha256_file
from ..rules.fleet import Calibration

RECORD_NAME = records.FILE_NAMES["control"]
RECORD_KIND = "control"
SOURCE_TYPE = "F16"
IMATRIX = "-imatrix"
# Q4_K_M: llama.cpp's usual 4-bit choice; Q4_0: its plain 4-bit format; Q4_0-imatrix:
# Q4_0 weighted by an importance matrix from the calibration text; F16: the unquantized
# reference, whose perplexity checks the benchmark's scoring against vLLM's.
DEFAULT_TYPES = ("Q4_K_M", "Q4_0", "Q4_0-imatrix", "F16")


def gguf_name(ftype: str) -> str:
    return f"model-{ftype.lower()}.gguf"


def run(model_record_path: str | os.PathLike, out: str | os.PathLike, types: list[str],
        threads: int, calibration: Calibration = Calibration()) -> dict[str, Any]:
    """Make the control GGUFs (module docstring); returns the record written to ``out/control.json``."""
    started = time.monotonic()
    from ..engines.llama_cpp import FTYPES, LlamaCpp, quantize_gguf, quantize_with_imatrix
    from ..formats.gguf_file import convert_to_gguf

    known = [*FTYPES, *(f"{t}{IMATRIX}" for t in FTYPES if t != SOURCE_TYPE)]
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise EdgepathError(f"control.types: unknown llama.cpp type(s) {unknown}; known: {sorted(known)}")
    model_record = records.read(model_record_path, "model")
    model_dir = records.model_directory(model_record_path, model_record)
    files = []
    with records.output_directory(out, RECORD_KIND, sources=[model_dir, model_record_path]) as scratch:
        source = scratch / gguf_name(SOURCE_TYPE)
        print(f"control: converting {model_dir} to {SOURCE_TYPE} GGUF", file=sys.stderr, flush=True)
        convert_to_gguf(model_dir, source)
        imatrix = None
        for ftype in dict.fromkeys([SOURCE_TYPE, *types]):
            path = scratch / gguf_name(ftype)
            if ftype.endswith(IMATRIX):
                if imatrix is None:
                    imatrix = _importance_matrix(model_dir, source, scratch, calibration, threads)
                print(f"control: quantizing to {ftype}", file=sys.stderr, flush=True)
                quantize_with_imatrix(source, path, ftype.removesuffix(IMATRIX), imatrix["file"], threads)
            elif ftype != SOURCE_TYPE:
                print(f"control: quantizing to {ftype}", file=sys.stderr, flush=True)
                quantize_gguf(source, path, ftype, threads)
            engine = LlamaCpp(path, threads=threads, n_ctx=64)
            info = engine.info()
            engine.close()
            files.append({"type": ftype, "file": path.name, "size": path.stat().st_size,
                          "sha256": sha256_file(path), "bits_per_weight": info["bits_per_weight"],
                          "parameters": info["parameters"], "desc": info["desc"],
                          **({"imatrix": imatrix["record"]} if ftype.endswith(IMATRIX) else {})})
        if imatrix:
            imatrix["file"].unlink()
        if SOURCE_TYPE not in types:
            files = [f for f in files if f["type"] != SOURCE_TYPE]
            source.unlink()
        record = {
            **records.envelope(RECORD_KIND),
            "model": {"fingerprint": model_record["fingerprint"]},
            "llama_cpp": {"bindings": records.tool("llama-cpp-python"),
                          "system_info": info["system_info"]},
            "files": files,
            **usage.cost(started),
        }
        records.write(scratch / RECORD_NAME, RECORD_KIND, record)
    return record


def _importance_matrix(model_dir, source, scratch, calibration: Calibration, threads: int) -> dict[str, Any]:
    """llama-imatrix over the quantize stage's calibration windows (``calibration``),
    decoded to text: {"file": the matrix, "record": what it was computed from}."""
    from transformers import AutoTokenizer

    from ..engines.llama_cpp import importance_matrix
    from ..text import calibration as text

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    corpus = text.load_corpus(calibration.corpus, list(calibration.holdout))
    calib = text.calibration_set(tokenizer, corpus, calibration.samples, calibration.length,
                                 calibration.chat_fraction, calibration.seed)
    windows = scratch / "calibration.txt"
    windows.write_text("".join(tokenizer.decode(w) for w in calib.tokens.tolist()))
    matrix = scratch / "imatrix.gguf"
    print(f"control: llama-imatrix over {calibration.samples} x {calibration.length} calibration tokens",
          file=sys.stderr, flush=True)
    importance_matrix(source, windows, matrix, calibration.length, threads)
    windows.unlink()
    return {"file": matrix, "record": {"tool": "llama-imatrix", "context": calibration.length,
                                       "calibration": calib.record}}


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet

    types = args.types or fleet.namespace(args.params, "control").get("types") or list(DEFAULT_TYPES)
    record = run(args.model, args.out, list(types), args.threads or os.cpu_count() or 1,
                 fleet.calibration(args.params))
    files = ", ".join(f"{f['type']} {f['bits_per_weight']:.2f} bits/weight" for f in record["files"])
    print(f"control: {files} -> {args.out}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="build/model/model.json", help="the model record")
    p.add_argument("--params", default="params.yaml", help="control.types and calibration come from here")
    p.add_argument("--types", nargs="+", help="llama.cpp types to make (default: control.types)")
    p.add_argument("--threads", type=int, default=0, help="quantizer threads (default: all cores)")
    p.add_argument("--out", required=True,
                   help="output directory (replaced atomically; only an earlier control output)")


COMMAND = Command("control", "the model as llama.cpp GGUF files (the benchmark's control)", """\
    Convert the model stage's bf16 checkpoint to an F16 GGUF with llama.cpp's own
    converter and quantize it with llama.cpp's quantizer (control.types: Q4_K_M,
    Q4_0, Q4_0-imatrix and F16 by default; an -imatrix type is weighted by an
    importance matrix that llama-imatrix computes over the calibration text of
    params.yaml's calibration namespace), then load each file once in llama.cpp
    and record its bits per weight as llama.cpp counts them. OUT appears whole
    or not at all.

    example:  edgepath control --model build/model/model.json --out build/control""", _arguments, _cmd)
