"""The export stage: a phone's build, an ExecuTorch program for one weight path.

vLLM does not run on phones; a phone gets a program. Three paths (``PATHS``):

- ``w8a16-qnn`` (a Qualcomm NPU): the reference model traced at a fixed window,
  annotated for QNN 16a8w, calibrated on real text run through the reference
  model, converted (``phone.qnn_w8a16``). Its deliverable is the converted
  program (``program.pt2``), its calibration record and its parity against the
  fp32 reference over held-out text; the QNN ``model.pte`` is lowered from it
  where Qualcomm's SDK is installed, and otherwise the record says it was not
  built and why.
- ``w4a8-xnnpack`` and ``w8a8-xnnpack`` (a phone's CPU; ``phone.xnnpack``): 4-bit
  weights made by GPTQ on XNNPACK's grid (calibration's text, ``quantize.gptq``'s
  settings), or 8-bit weights rounded to nearest; int8 dynamic activations, an
  int8 embedding, a KV cache and attention in ExecuTorch's LLM ops; lowered to
  XNNPACK and run here in ExecuTorch's runtime (``engines.executorch_runtime``)
  against the eager model quantized the same way and against fp32, per held-out
  genre.

Lifecycle of ``run(path, model_dir, out, settings)``:

1. Refuse what cannot work before any slow step: an unknown path, an unknown SoC,
   widths XNNPACK's 4-bit group does not divide, a KV cache shorter than the check,
   a checkpoint or tokenizer that is missing or corrupt (``hf_model.inspect``), a
   corpus too short.
2. Build the program and measure it against its references (per path, above).
3. Gate: a QNN program whose parity against fp32 is below ``export.qnn``'s
   ``min_top1`` or ``min_sqnr_db`` (set from benchmarks/phone_calibration.py) is
   refused. An XNNPACK program is refused where it disagrees with its eager model
   (``export.xnnpack.min_top1``: a lowering or runtime fault) or with fp32
   (``min_top1_fp32``: the fidelity the phone gets; checked on the eager model
   before the minutes of lowering, and on the program after). An export without a
   calibration record and a passed parity gate is never written: the record's
   schema requires both.
4. Write atomically (``records.output_directory``): the program(s), the tokenizer,
   chat template and generation settings the app needs with it, and ``export.json``
   (schema ``export`` v2). An interrupted or refused run leaves ``out`` as it was;
   ``out`` replaces only an earlier export (never the model directory or a folder
   of anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.command import Command, progress
from ..core.errors import EdgepathError
from ..formats import hf_model
from ..rules import weight_paths
from ..rules.fleet import Calibration, Gptq, check_namespace, namespace
from ..rules.select import PHONE_MIN_TOP1
from ..rules.weight_paths import XNNPACK_GROUP_SIZE, Stage

RECORD_NAME = records.FILE_NAMES["export"]
QNN = "w8a16-qnn"
XNNPACK = "w4a8-xnnpack"
XNNPACK_8BIT = "w8a8-xnnpack"
PATHS = tuple(weight_paths.built_by(Stage.EXPORT))
assert set(PATHS) == {QNN, XNNPACK, XNNPACK_8BIT}, "every export path of the registry has its builder here"
PROGRAM_NAME = "program.pt2"
PTE_NAME = "model.pte"
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
    settings = json.loads(config.read_text()) if config.is_file() else {}
    return {"bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": settings.get("eos_token_id", tokenizer.eos_token_id),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "sampling": {k: settings[k] for k in ("do_sample", "temperature", "top_p", "top_k") if k in settings}}


def check_path(path: str, settings: Settings, info: dict[str, Any]) -> None:
    """Step 1 for ``path`` on the checkpoint described by ``info`` (``hf_model.inspect``)."""
    weight_paths.require(path, Stage.EXPORT)
    if path == QNN:
        from ..phone.qnn_w8a16 import soc_known

        if not soc_known(settings.qnn.soc):
            raise EdgepathError(f"export.qnn.soc: {settings.qnn.soc!r} is not a Qualcomm SoC ExecuTorch knows "
                                f"(QcomChipset, e.g. SM8650 for a Snapdragon 8 Gen 3)")
        if settings.qnn.window < 8 or settings.qnn.samples < 1 or settings.qnn.parity_windows < 1:
            raise EdgepathError("export.qnn: window >= 8, samples >= 1 and parity_windows >= 1 are needed")
    else:
        x = settings.xnnpack
        config = info["config"]
        widths = {config["hidden_size"], config["intermediate_size"]}
        bad = sorted(w for w in widths if w % XNNPACK_GROUP_SIZE)
        if path == XNNPACK and bad:
            raise EdgepathError(f"{path}: the model's linear input widths {bad} are not multiples of XNNPACK's "
                                f"4-bit weight group ({XNNPACK_GROUP_SIZE}); no program was built")
        if x.threads < 1 or x.rounds < 3 or x.check_tokens < 2 or x.prefill_tokens < 2:
            raise EdgepathError("export.xnnpack: threads >= 1, rounds >= 3 (medians), check_tokens >= 2 and "
                                "prefill_tokens >= 2 are needed")


def run(path: str, model_dir: str | Path, out: str | Path, settings: Settings = Settings()) -> dict[str, Any]:
    """Build ``out`` for ``path`` (module docstring); returns the record written there."""
    model_dir, out = Path(model_dir), files.path_of(out, "--out")
    records.check_output_directory(out, "export", sources=[model_dir])  # before minutes of lowering
    info = hf_model.inspect(model_dir, with_file_digests=False)
    check_path(path, settings, info)

    from transformers import AutoTokenizer

    from ..text import calibration

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    corpus = calibration.load_corpus(settings.calibration.corpus, list(settings.calibration.holdout))
    with records.output_directory(out, "export", sources=[model_dir]) as scratch:
        sections = (_build_qnn(model_dir, tokenizer, corpus, settings, scratch) if path == QNN
                    else _build_xnnpack(path, model_dir, tokenizer, corpus, settings, scratch))
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
            "wall_time_s": round(time.monotonic() - started, 1),
        }
        records.write(scratch / RECORD_NAME, "export", record)
    return record


def _build_qnn(model_dir: Path, tokenizer, corpus, settings: Settings, scratch: Path) -> dict[str, Any]:
    from ..phone import graph, qnn_w8a16
    from ..text import calibration

    s = settings.qnn
    calib = calibration.calibration_set(tokenizer, corpus, s.samples, s.window, s.chat_fraction,
                                         settings.calibration.seed)
    held_out = calibration.evaluation_set(tokenizer, corpus, s.parity_windows, s.window)
    model = graph.load_reference(model_dir)
    progress("export", f"{QNN}: calibrating QNN 16a8w for {s.soc} on {s.samples} x {s.window} tokens of real text")

    def calibrated(i: int, n: int) -> None:
        if i % 8 == 0 or i == n:
            progress("export", f"{QNN}: calibrated on {i}/{n} windows")

    converted = qnn_w8a16.calibrate(model, calib.tokens, "w8a16", s.soc, progress=calibrated)
    figures = qnn_w8a16.parity(model, converted, held_out)
    sqnr = figures["logit_sqnr_db"]
    passed = figures["top1_agreement"] >= s.min_top1 and (sqnr is None or sqnr >= s.min_sqnr_db)
    progress("export", f"{QNN}: parity against fp32: top-1 {figures['top1_agreement']:.3f}, "
             f"KL {figures['kl_nats']:.4f}, SQNR {sqnr} dB")
    if not passed:
        raise EdgepathError(
            f"{QNN}: the calibrated program's parity against fp32 is below the gate (top-1 "
            f"{figures['top1_agreement']:.3f} < {s.min_top1} or logit SQNR {sqnr} dB < {s.min_sqnr_db} dB, "
            f"export.qnn); nothing was written")
    qnn_w8a16.save(converted, s.window, scratch / PROGRAM_NAME)
    missing = qnn_w8a16.sdk_missing()
    if missing is None:
        progress("export", f"{QNN}: lowering to a QNN .pte for {s.soc}")
        qnn_w8a16.lower(converted, s.window, s.soc, scratch / PTE_NAME)
        pte = {"state": "built", "detail": f"lowered for {s.soc} with the QNN SDK at $QNN_SDK_ROOT"}
    else:
        pte = {"state": "not built", "detail": missing}
    return {
        "program": {"file": PROGRAM_NAME, "format": "torch.export program with quantize/dequantize nodes",
                    "inputs": f"input_ids [1, {s.window}] int64, mask [1, 1, {s.window}, {s.window}] fp32 "
                              f"(0 or -255, causal), position_ids [1, {s.window}] int64",
                    "precision": "w8a16: int8 per-channel weights, int16 static activations (QNN 16a8w)",
                    "soc": s.soc},
        "calibration": {**calib.record, "inputs": "activations of the reference model (fp32) run over the "
                                                  "calibration windows: prose and chat turns of real text"},
        "parity": {"against": "the fp32 reference", "windows": s.parity_windows, "length": s.window, **figures,
                   "gate": {"min_top1": s.min_top1, "min_sqnr_db": s.min_sqnr_db}, "passed": passed},
        "pte": pte,
    }


def _quantize_for_xnnpack(path: str, model, tokenizer, corpus, settings: Settings) -> tuple[dict[str, Any], str]:
    """Quantize ``model`` in place by ``path``'s recipe (``phone.xnnpack``); returns the
    record's ``calibration`` (which quantization made the weights, on what text) and
    the program's precision in a phrase."""
    from ..phone import xnnpack
    from ..text import calibration

    text = settings.calibration
    if path == XNNPACK:
        calib = calibration.calibration_set(tokenizer, corpus, text.samples, text.length, text.chat_fraction,
                                            text.seed)
        progress("export", f"{path}: GPTQ on {text.samples} x {text.length} calibration tokens, XNNPACK's grid "
                 f"(symmetric, group {XNNPACK_GROUP_SIZE}, positive bf16 scales)")
        gptq_started = time.monotonic()
        layers = xnnpack.quantize_8da4w(model, calib.tokens, **dataclasses.asdict(settings.gptq))
        weights = {"algorithm": "gptq", "grid": f"symmetric int4, group {XNNPACK_GROUP_SIZE}, one positive scale "
                                                f"per group exact in bf16",
                   **dataclasses.asdict(settings.gptq), "signed": False,
                   "int4_weights": sum(q.codes.numel() for q in layers.values()),
                   "gptq_s": round(time.monotonic() - gptq_started, 1),
                   "shared_with_q4_0_gguf": False,
                   "why_own_run": ("q4_0-gguf's GPTQ searches each scale's sign too and stores negative scales, "
                                   "which XNNPACK refuses (the program fails to load: xnn_status_invalid_parameter); "
                                   "the grids differ, so this program runs GPTQ on its own grid")}
        calibration_record = {**calib.record, "weights": weights,
                              "inputs": "the reference model's layer inputs (fp32) over the calibration windows, "
                                        "for GPTQ; activations are quantized per token at run time"}
        precision = (f"int4 symmetric GPTQ weights in groups of {XNNPACK_GROUP_SIZE} (bf16 scales) in the decoder "
                     f"but its key and value projections; those and the output head int8 per channel; int8 "
                     f"dynamic per-token activations; int8 per-row embedding")
    else:
        xnnpack.quantize_8da8w(model)
        calibration_record = {"weights": {"algorithm": "round-to-nearest", "grid": "symmetric int8, one scale per "
                                                                                  "output channel"},
                              "inputs": "none needed: 8-bit weights are rounded to nearest, activations are "
                                        "quantized per token at run time"}
        precision = ("int8 per-channel weights in every linear, the output head included; int8 dynamic per-token "
                     "activations; int8 per-row embedding")
    return calibration_record, precision


def _build_xnnpack(path: str, model_dir: Path, tokenizer, corpus, settings: Settings,
                   scratch: Path) -> dict[str, Any]:
    import torch

    from ..engines import executorch_runtime
    from ..phone import graph, xnnpack
    from ..phone.parity import Parity, by_genre
    from ..scoring.agreement import common_prefix
    from ..text import calibration
    from ..text.prompts import fixed_prompt_ids

    x = settings.xnnpack
    genres = {g: w[0] for g, w in calibration.held_out_genres(tokenizer, corpus, 1, x.check_tokens).items()}
    prefill = calibration.evaluation_set(tokenizer, corpus, 1, x.prefill_tokens)[0].tolist()
    prompts = fixed_prompt_ids(tokenizer)
    need = max(x.check_tokens, x.prefill_tokens, max(map(len, prompts)) + max(x.greedy_tokens, x.decode_tokens))
    if x.max_seq_len < need:
        raise EdgepathError(f"export.xnnpack.max_seq_len {x.max_seq_len} holds fewer positions than the check "
                            f"uses ({need}); nothing was built")
    model = graph.load_reference(model_dir)
    with torch.no_grad():
        fp32 = {g: model(input_ids=ids[None], use_cache=False).logits[0] for g, ids in genres.items()}
    calibration_record, precision = _quantize_for_xnnpack(path, model, tokenizer, corpus, settings)
    eager_vs_fp32 = Parity()
    with torch.no_grad():
        eager = {g: model(input_ids=ids[None], use_cache=False).logits[0] for g, ids in genres.items()}
    for genre in genres:
        eager_vs_fp32.add(fp32[genre][:-1], eager[genre][:-1])
    eager_top1 = eager_vs_fp32.result()["top1_agreement"]
    if eager_top1 < x.min_top1_fp32:  # the program can only track its eager model: refuse before the lowering
        raise EdgepathError(
            f"{path}: the quantized model (eager, before lowering) agrees with fp32 on top-1 {eager_top1:.3f} < "
            f"{x.min_top1_fp32} (export.xnnpack.min_top1_fp32); nothing was lowered or written")
    progress("export", f"{path}: lowering to XNNPACK (KV cache {x.max_seq_len}, ExecuTorch's custom SDPA); minutes")
    lowering_started = time.monotonic()
    (scratch / PTE_NAME).write_bytes(xnnpack.export(model, x.max_seq_len))
    lowering_s = time.monotonic() - lowering_started

    executorch_runtime.set_threads(x.threads)
    program = executorch_runtime.PteDecoder(scratch / PTE_NAME, x.max_seq_len)
    progress("export", f"{path}: lowered in {lowering_s:.0f} s; checking in ExecuTorch's runtime on "
             f"{len(genres)} genres x {x.check_tokens} held-out tokens")
    pte_logits = {genre: program.logits(ids.tolist())[:-1] for genre, ids in genres.items()}
    vs_eager = Parity()
    for genre, logits in pte_logits.items():
        vs_eager.add(eager[genre][:-1], logits)
    against_fp32 = by_genre({genre: fp32[genre][:-1] for genre in genres}, pte_logits)
    # the .pte's greedy continuation (its prompt prefilled in one call), checked by one
    # teacher-forced pass of the eager model over it: greedy decoding agrees up to the
    # first position where the eager model's argmax differs from the token the .pte chose
    prefixes = []
    for prompt in prompts:
        continuation = program.greedy(prompt, x.greedy_tokens)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + continuation[:-1]]), use_cache=False).logits[0]
        prefixes.append(common_prefix(logits[len(prompt) - 1:].argmax(-1).tolist(), continuation))
    del model
    decode = program.decode_seconds_per_token(prompts[0], x.decode_tokens, x.rounds)
    prefill_rates = program.prefill_seconds_per_token(prefill, x.rounds)
    against_eager, worst = vs_eager.result(), against_fp32["worst"]
    passed_fp32 = against_fp32["top1_agreement"] >= x.min_top1_fp32
    passed = against_eager["top1_agreement"] >= x.min_top1
    progress("export", f"{path}: top-1 against fp32 {against_fp32['top1_agreement']:.3f} (worst genre {worst['genre']} "
             f"{worst['top1_agreement']:.3f}), against eager {against_eager['top1_agreement']:.3f}; "
             f"greedy {sum(p == x.greedy_tokens for p in prefixes)}/{len(prompts)} prompts reproduced; decode "
             f"{statistics.median(1 / r for r in decode):.1f} tok/s, prefill "
             f"{statistics.median(1 / r for r in prefill_rates):.0f} tok/s on {x.threads} threads")
    if not passed:
        raise EdgepathError(
            f"{path}: the .pte disagrees with the eager model quantized the same way (teacher-forced top-1 "
            f"{against_eager['top1_agreement']:.3f} < {x.min_top1}, export.xnnpack.min_top1): a lowering or "
            f"runtime fault; nothing was written")
    if not passed_fp32:
        raise EdgepathError(
            f"{path}: the .pte's agreement with fp32 is below the gate (teacher-forced top-1 "
            f"{against_fp32['top1_agreement']:.3f} < {x.min_top1_fp32}, export.xnnpack.min_top1_fp32): the "
            f"quantization lost too much; nothing was written")
    return {
        "program": {"file": PTE_NAME, "format": "ExecuTorch .pte, XNNPACK delegate, ExecuTorch's LLM ops",
                    "inputs": f"tokens [1, S] int64 (S from 1 to {x.max_seq_len - 1}), input_pos [1] int64 -> "
                              f"logits [1, 1, vocab] of the last token; KV cache of {x.max_seq_len} positions "
                              f"in the program's mutable buffers (llama::update_cache), attention by "
                              f"llama::custom_sdpa over the filled positions",
                    "precision": precision, "lowering_s": round(lowering_s, 1)},
        "calibration": calibration_record,
        "parity": {"against": "the fp32 reference", "windows": len(genres), "length": x.check_tokens,
                   **against_fp32,
                   "gate": {"min_top1": x.min_top1_fp32}, "passed": passed_fp32},
        "pte": {"state": "built", "detail": "lowered to XNNPACK here and run in ExecuTorch's runtime"},
        "runtime_check": {
            "engine": f"{records.tool('executorch')} runtime, XNNPACK, this host's CPU",
            "threads": x.threads,
            "against_eager": {"what": "the eager model quantized the same way (torchao, PyTorch)",
                              **against_eager, "min_top1": x.min_top1},
            # the yardstick: how far quantization itself moved the eager model from fp32
            "eager_against_fp32": eager_vs_fp32.result(),
            "greedy": {"prompts": len(prompts), "tokens": x.greedy_tokens,
                       "reproduced": sum(p == x.greedy_tokens for p in prefixes),
                       "mean_common_prefix": round(statistics.mean(prefixes), 2)},
            "decode_tok_s": executorch_runtime.median_tok_s(decode),
            "decode": {"tokens": x.decode_tokens, "rounds": x.rounds, "batch": 1},
            "prefill_tok_s": executorch_runtime.median_tok_s(prefill_rates),
            "prefill": {"tokens": x.prefill_tokens, "rounds": x.rounds, "batch": 1},
            "passed": passed,
        },
    }


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: export the directory it names
        model_dir = records.model_directory(model_dir, records.read(model_dir, "model"))
    record = run(args.path, model_dir, args.out, Settings.from_file(args.params))
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
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier export)")


COMMAND = Command("export", "a phone's build: an ExecuTorch program", """\
    Export the model as the ExecuTorch program a phone runs.

    w8a16-qnn (a Qualcomm NPU): QNN 16a8w, calibrated on real text run through
    the reference model, saved as a torch.export program (program.pt2) with its
    calibration record and its parity against fp32 (top-1, KL, logit SQNR),
    refused below export.qnn's gate; lowered to a QNN model.pte only where
    QNN_SDK_ROOT points to Qualcomm's SDK, otherwise the record says why not.
    w4a8-xnnpack (a phone's CPU): int4 weights made by GPTQ on calibration's
    text (minutes), the key and value projections and the head int8; w8a8-xnnpack:
    int8 weights rounded to nearest. Both: int8 dynamic activations, int8
    embedding, a KV cache and attention in ExecuTorch's custom ops, lowered to
    XNNPACK (slow: minutes, one core) and run here in ExecuTorch's runtime against
    the eager model quantized the same way (export.xnnpack.min_top1) and against
    fp32 on every held-out genre (min_top1_fp32), refused below either gate.
    OUT also holds the tokenizer and generation settings, and export.json.

    example:  edgepath export --path w4a8-xnnpack --out build/exports/w4a8-xnnpack""", _arguments, _cmd)
