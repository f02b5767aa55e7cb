"""The export stage: a phone's build, an ExecuTorch program for one weight path.

vLLM does not run on phones; a phone gets a program. The paths the registry says
this stage builds (``PATHS``) are the ExecuTorch family's (``paths.executorch``,
which says what each program is and how it is checked).

Lifecycle of ``run(path, model_dir, out, settings, calibrated)``:

1. Refuse what cannot work before any slow step: an unknown path, an unknown SoC,
   widths XNNPACK's 4-bit group does not divide, a KV cache shorter than the check,
   a checkpoint or tokenizer that is missing or corrupt (``hf_model.inspect``), a
   corpus too short, a 4-bit program without the calibrate stage's output
   (``calibrated``: its GPTQ runs from the Hessians every path shares) or with one of
   another model.
2. Build the program and measure it against its references (its family's
   ``build_program``).
3. Gate: a program below its parity gates against fp32 (``export.qnn``'s
   ``min_top1`` and ``min_sqnr_db``, set from benchmarks/phone_calibration.py;
   ``export.xnnpack``'s ``min_top1`` against the eager model and
   ``min_top1_fp32``) is refused by its family. An export without a calibration
   record and a passed parity gate is never written: the record's schema requires
   both.
4. Write atomically (``records.output_directory``): the program(s), the tokenizer,
   chat template and generation settings the app needs with it, and ``export.json``
   (schema ``export`` v2). An interrupted or refused run leaves ``out`` as it was;
   ``out`` replaces only an earlier export (never the model directory or a folder
   of anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..core import files, records, usage
from ..core.command import Command
from ..formats import hf_model
from ..rules import weight_paths
from ..rules.fleet import Calibration, Gptq, check_namespace, namespace
from ..rules.select import PHONE_MIN_TOP1
from ..rules.weight_paths import Stage
from .calibrate import SharedCalibration

RECORD_NAME = records.FILE_NAMES["export"]
PATHS = tuple(weight_paths.built_by(Stage.EXPORT))
_SIDE_FILES = ("generation_config.json", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class QnnSettings:
    """``export.qnn`` in params.yaml."""

    soc: str = "SM8650"
    window: int = 128
    samples: int = 32
    chat_fraction: float = 0.25
    parity_windows: int = 16
    min_top1: float = 0.85
    min_sqnr_db: float = 15.0


@dataclasses.dataclass(frozen=True)
class XnnpackSettings:
    """``export.xnnpack`` in params.yaml."""

    max_seq_len: int = 512
    threads: int = 2
    check_tokens: int = 256
    greedy_tokens: int = 32
    decode_tokens: int = 64
    prefill_tokens: int = 128
    rounds: int = 3
    min_top1: float = 0.7
    min_top1_fp32: float = PHONE_MIN_TOP1


@dataclasses.dataclass(frozen=True)
class Settings:
    qnn: QnnSettings = QnnSettings()
    xnnpack: XnnpackSettings = XnnpackSettings()
    calibration: Calibration = Calibration()
    gptq: Gptq = Gptq()
    """``quantize.gptq``: the XNNPACK program's GPTQ runs as the quantize stage's does."""

    @classmethod
    def from_params(cls, export: dict[str, Any] | None, calibration: dict[str, Any] | None,
                    quantize: dict[str, Any] | None = None, where: str = "params") -> "Settings":
        """``export``: params.yaml's ``export`` namespace (``paths``, ``qnn``, ``xnnpack``);
        ``calibration``: its ``calibration`` namespace, whose text every build shares;
        ``quantize``: its ``quantize`` namespace, whose ``gptq`` settings the XNNPACK
        program's GPTQ takes. All are checked against params.yaml's schema (unknown keys
        and wrong types refused, naming ``where`` and the key)."""
        export = check_namespace("export", export, where)
        return cls(QnnSettings(**(export.get("qnn") or {})), XnnpackSettings(**(export.get("xnnpack") or {})),
                   Calibration.from_params(calibration, where), Gptq.from_params(quantize, where))

    @classmethod
    def from_file(cls, params: str | Path) -> "Settings":
        """``from_params`` on a params file's ``export``, ``calibration`` and ``quantize`` namespaces."""
        return cls.from_params(namespace(params, "export"), namespace(params, "calibration"),
                               namespace(params, "quantize"), str(params))


def _generation(model_dir: Path, tokenizer) -> dict[str, Any]:
    """What an app needs to run the program as the model stage's checkpoint runs."""
    config = model_dir / "generation_config.json"
    settings = files.read_json(config) if config.is_file() else {}
    return {"bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": settings.get("eos_token_id", tokenizer.eos_token_id),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "sampling": {k: settings[k] for k in ("do_sample", "temperature", "top_p", "top_k") if k in settings}}


def check_path(path: str, settings: Settings, info: dict[str, Any], shared: SharedCalibration | None) -> None:
    """Step 1 for ``path`` on the checkpoint described by ``info`` (``hf_model.inspect``):
    an export path, and settings (and the calibrate stage's output, ``shared``) its
    family can build it with."""
    paths.of(weight_paths.require(path, Stage.EXPORT)).check_settings(settings, info, shared)


def run(path: str, model_dir: str | Path, out: str | Path, settings: Settings = Settings(),
        calibrated: str | Path | None = None) -> dict[str, Any]:
    """Build ``out`` for ``path`` (module docstring) from the model in ``model_dir`` and,
    where its program's GPTQ needs them, the calibrate stage's output ``calibrated``;
    returns the record written there."""
    model_dir, out = Path(model_dir), files.path_of(out, "--out")
    records.check_output_directory(out, "export", sources=[model_dir])  # before minutes of lowering
    info = hf_model.inspect(model_dir, with_file_digests=False)
    shared = SharedCalibration(calibrated, info["fingerprint"]) if calibrated is not None else None
    check_path(path, settings, info, shared)

    from transformers import AutoTokenizer

    from ..text import calibration

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    corpus = calibration.load_corpus(settings.calibration.corpus, list(settings.calibration.holdout))
    with records.output_directory(out, "export", sources=[model_dir]) as scratch:
        sections = paths.of(path).build_program(model_dir, tokenizer, corpus, settings, scratch, shared)
        for name in [*info["tokenizer_files"], *_SIDE_FILES]:
            if (model_dir / name).is_file():
                (scratch / name).write_bytes((model_dir / name).read_bytes())
        record = {
            **records.envelope("export"),
            "path": path,
            "model": {"directory": str(model_dir.resolve()), "fingerprint": info["fingerprint"]},
            **sections,
            "generation": _generation(model_dir, tokenizer),
            "files": [hf_model.file_entry(f, scratch) for f in sorted(scratch.iterdir()) if f.is_file()],
            "versions": records.versions("torch", "transformers", "executorch", "torchao"),
            **usage.cost(started),
        }
        records.write(scratch / RECORD_NAME, "export", record)
    return record


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: export the directory it names
        model_dir = records.model_directory(model_dir, records.read(model_dir, "model"))
    record = run(args.path, model_dir, args.out, Settings.from_file(args.params), args.calibration)
    parity = record["parity"]
    check = record.get("runtime_check")
    ran = (f", in ExecuTorch {check['decode_tok_s']['median']:.1f} tok/s on {check['threads']} threads, top-1 "
           f"{check['against_eager']['top1_agreement']:.3f} against eager" if check else "")
    print(f"export: {args.path}: top-1 {parity['top1_agreement']:.3f} and logit SQNR {parity['logit_sqnr_db']} dB "
          f"against fp32{ran}; .pte {record['pte']['state']}"
          f"{'' if record['pte']['state'] == 'built' else ': ' + record['pte']['detail']} -> {args.out}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", required=True, help=", ".join(PATHS))
    p.add_argument("--model", default="build/model/model.json", help="the model record, or a Hugging Face directory")
    p.add_argument("--params", default="params.yaml", help="export settings, calibration's text, quantize.gptq")
    p.add_argument("--calibration", help="the calibrate stage's output directory, of the same model (a 4-bit "
                                         "program's GPTQ reads its Hessians)")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier export)")


def _help() -> str:
    programs = "\n".join(f"    {name}: {weight_paths.get(name).summary}" for name in PATHS)
    return f"""\
    Export the model as the ExecuTorch program a phone runs:

{programs}

    Each is calibrated on real text where its weights need it, checked against
    fp32 on every held-out genre and refused below its gate (export.qnn,
    export.xnnpack); an XNNPACK program is lowered (minutes, one core) and run here
    in ExecuTorch's runtime against the eager model quantized the same way; a QNN
    model.pte is lowered only where QNN_SDK_ROOT points to Qualcomm's SDK,
    otherwise the record says why not. OUT also holds the tokenizer and generation
    settings, and export.json.

    example:  edgepath export --path {PATHS[-1]} --out build/exports/{PATHS[-1]}"""


COMMAND = Command("export", "a phone's build: an ExecuTorch program", _help(), _arguments, _cmd)
