"""The export stage: a phone's build, an ExecuTorch program for one weight path.

vLLM does not run on phones; a phone gets a program. Two paths (``PATHS``):

- ``w8a16-qnn`` (a Qualcomm NPU): the reference model traced at a fixed window,
  annotated for QNN 16a8w, calibrated on real text run through the reference
  model, converted (``phone.qnn_w8a16``). Its deliverable is the converted
  program (``program.pt2``), its calibration record and its parity against the
  fp32 reference over held-out text; the QNN ``model.pte`` is lowered from it
  where Qualcomm's SDK is installed, and otherwise the record says it was not
  built and why.
- ``w4a8-xnnpack`` (any phone's CPU): 8-bit dynamic activations, 4-bit weights, an
  8-bit embedding, a KV cache (``phone.xnnpack_8da4w``), lowered to XNNPACK and run
  here in ExecuTorch's runtime (``engines.executorch_runtime``) against the eager
  model quantized the same way.

Lifecycle of ``run(path, model_dir, out, settings)``:

1. Refuse what cannot work before any slow step: an unknown path, an unknown SoC,
   widths the group size does not divide, a KV cache shorter than the check, a
   checkpoint or tokenizer that is missing or corrupt (``hf_model.inspect``), a
   corpus too short.
2. Build the program and measure it against its reference (per path, above).
3. Gate: a QNN program whose parity against fp32 is below ``export.qnn``'s
   ``min_top1`` or ``min_sqnr_db`` (set from benchmarks/phone_calibration.py), or an
   XNNPACK program that disagrees with its eager model (``export.xnnpack.min_top1``),
   is refused. An export without a calibration record and a parity figure is
   never written: the record's schema requires both.
4. Write atomically (``records.output_directory``): the program(s), the tokenizer,
   chat template and generation settings the app needs with it, and ``export.json``
   (schema ``export`` v1). An interrupted or refused run leaves ``out`` as it was;
   ``out`` replaces only an earlier export (never the model directory or a folder
   of anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from . import __version__, files, hf_model, records, weight_paths
from .command import Command
from .errors import EdgepathError
from .fleet import Calibration, check_namespace, namespace
from .weight_paths import XNNPACK_GROUP_SIZE, Stage

RECORD_NAME = records.FILE_NAMES["export"]
QNN = "w8a16-qnn"
XNNPACK = "w4a8-xnnpack"
PATHS = tuple(weight_paths.built_by(Stage.EXPORT))
assert set(PATHS) == {QNN, XNNPACK}, "every export path of the registry has its builder here"
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

    group_size: int = XNNPACK_GROUP_SIZE
    max_seq_len: int = 512
    threads: int = 2
    check_tokens: int = 256
    greedy_tokens: int = 32
    decode_tokens: int = 64
    rounds: int = 3
    min_top1: float = 0.7


@dataclasses.dataclass(frozen=True)
class Settings:
    qnn: QnnSettings = QnnSettings()
    xnnpack: XnnpackSettings = XnnpackSettings()
    corpus: str = Calibration.corpus
    holdout: tuple[str, ...] = Calibration.holdout
    seed: int = 0

    @classmethod
    def from_params(cls, export: dict[str, Any] | None, calibration: dict[str, Any] | None,
                    where: str = "params") -> "Settings":
        """``export``: params.yaml's ``export`` namespace (``paths``, ``qnn``, ``xnnpack``);
        ``calibration``: its ``calibration`` namespace, whose corpus, held-out documents and
        seed every build shares. Both are checked against params.yaml's schema (unknown
        keys and wrong types refused, naming ``where`` and the key)."""
        export = check_namespace("export", export, where)
        shared = Calibration.from_params(calibration, where)
        return cls(QnnSettings(**(export.get("qnn") or {})), XnnpackSettings(**(export.get("xnnpack") or {})),
                   shared.corpus, shared.holdout, shared.seed)

    @classmethod
    def from_file(cls, params: str | Path) -> "Settings":
        """``from_params`` on a params file's ``export`` and ``calibration`` namespaces."""
        return cls.from_params(namespace(params, "export"), namespace(params, "calibration"), str(params))


def _progress(message: str) -> None:
    print(f"export: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def _versions() -> dict[str, str]:
    names = ("torch", "transformers", "executorch", "torchao")
    return {"edgepath": __version__, **{n: importlib.metadata.version(n) for n in names}}


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
        from .phone.qnn_w8a16 import soc_known

        if not soc_known(settings.qnn.soc):
            raise EdgepathError(f"export.qnn.soc: {settings.qnn.soc!r} is not a Qualcomm SoC ExecuTorch knows "
                                f"(QcomChipset, e.g. SM8650 for a Snapdragon 8 Gen 3)")
        if settings.qnn.window < 8 or settings.qnn.samples < 1 or settings.qnn.parity_windows < 1:
            raise EdgepathError("export.qnn: window >= 8, samples >= 1 and parity_windows >= 1 are needed")
    else:
        x = settings.xnnpack
        config = info["config"]
        widths = {config["hidden_size"], config["intermediate_size"]}
        bad = sorted(w for w in widths if x.group_size < 1 or w % x.group_size)
        if bad:
            raise EdgepathError(f"export.xnnpack.group_size {x.group_size} does not divide the model's linear "
                                f"input widths {bad}")
        if x.threads < 1 or x.rounds < 3 or x.check_tokens < 2:
            raise EdgepathError("export.xnnpack: threads >= 1, rounds >= 3 (medians) and check_tokens >= 2 are needed")


def run(path: str, model_dir: str | Path, out: str | Path, settings: Settings = Settings()) -> dict[str, Any]:
    """Build ``out`` for ``path`` (module docstring); returns the record written there."""
    model_dir, out = Path(model_dir), files.path_of(out, "--out")
    records.check_output_directory(out, "export", sources=[model_dir])  # before minutes of lowering
    info = hf_model.inspect(model_dir, with_file_digests=False)
    check_path(path, settings, info)

    from transformers import AutoTokenizer

    from . import calibration

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    corpus = calibration.load_corpus(settings.corpus, list(settings.holdout))
    build = _build_qnn if path == QNN else _build_xnnpack
    with records.output_directory(out, "export", sources=[model_dir]) as scratch:
        sections = build(model_dir, tokenizer, corpus, settings, scratch)
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
            "versions": _versions(),
            "wall_time_s": round(time.monotonic() - started, 1),
        }
        records.write(scratch / RECORD_NAME, "export", record)
    return record


def _build_qnn(model_dir: Path, tokenizer, corpus, settings: Settings, scratch: Path) -> dict[str, Any]:
    from .phone import graph, qnn_w8a16
    from . import calibration

    s = settings.qnn
    calib = calibration.calibration_set(tokenizer, corpus, s.samples, s.window, s.chat_fraction, settings.seed)
    held_out = calibration.evaluation_set(tokenizer, corpus, s.parity_windows, s.window)
    model = graph.load_reference(model_dir)
    _progress(f"{QNN}: calibrating QNN 16a8w for {s.soc} on {s.samples} x {s.window} tokens of real text")

    def calibrated(i: int, n: int) -> None:
        if i % 8 == 0 or i == n:
            _progress(f"{QNN}: calibrated on {i}/{n} windows")

    converted = qnn_w8a16.calibrate(model, calib.tokens, "w8a16", s.soc, progress=calibrated)
    figures = qnn_w8a16.parity(model, converted, held_out)
    sqnr = figures["logit_sqnr_db"]
    passed = figures["top1_agreement"] >= s.min_top1 and (sqnr is None or sqnr >= s.min_sqnr_db)
    _progress(f"{QNN}: parity against fp32: top-1 {figures['top1_agreement']:.3f}, KL {figures['kl_nats']:.4f}, "
              f"SQNR {sqnr} dB")
    if not passed:
        raise EdgepathError(
            f"{QNN}: the calibrated program's parity against fp32 is below the gate (top-1 "
            f"{figures['top1_agreement']:.3f} < {s.min_top1} or logit SQNR {sqnr} dB < {s.min_sqnr_db} dB, "
            f"export.qnn); nothing was written")
    qnn_w8a16.save(converted, s.window, scratch / PROGRAM_NAME)
    missing = qnn_w8a16.sdk_missing()
    if missing is None:
        _progress(f"{QNN}: lowering to a QNN .pte for {s.soc}")
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


def _build_xnnpack(model_dir: Path, tokenizer, corpus, settings: Settings, scratch: Path) -> dict[str, Any]:
    import torch

    from .engines import executorch_runtime
    from .phone import graph, xnnpack_8da4w
    from .phone.parity import Parity
    from .prompts import fixed_prompt_ids
    from . import calibration
    from .gptq.evaluate import common_prefix

    x = settings.xnnpack
    ids = calibration.evaluation_set(tokenizer, corpus, 1, x.check_tokens)[0]
    prompts = fixed_prompt_ids(tokenizer)
    need = max(x.check_tokens, max(map(len, prompts)) + max(x.greedy_tokens, x.decode_tokens))
    if x.max_seq_len < need:
        raise EdgepathError(f"export.xnnpack.max_seq_len {x.max_seq_len} holds fewer positions than the check "
                            f"uses ({need}); nothing was built")
    model = graph.load_reference(model_dir)
    with torch.no_grad():
        fp32 = model(input_ids=ids[None], use_cache=False).logits[0]
        xnnpack_8da4w.quantize(model, x.group_size)
        eager = model(input_ids=ids[None], use_cache=False).logits[0]
    _progress(f"{XNNPACK}: lowering to XNNPACK (8da4w, group {x.group_size}, KV cache {x.max_seq_len}); "
              f"single-threaded, minutes")
    lowering_started = time.monotonic()
    (scratch / PTE_NAME).write_bytes(xnnpack_8da4w.export(model, x.max_seq_len))
    lowering_s = time.monotonic() - lowering_started

    executorch_runtime.set_threads(x.threads)
    program = executorch_runtime.PteDecoder(scratch / PTE_NAME, x.max_seq_len)
    _progress(f"{XNNPACK}: lowered in {lowering_s:.0f} s; checking in ExecuTorch's runtime")
    pte_logits = program.logits(ids.tolist())
    vs_eager, vs_fp32, eager_vs_fp32 = Parity(), Parity(), Parity()
    vs_eager.add(eager[:-1], pte_logits[:-1])
    vs_fp32.add(fp32[:-1], pte_logits[:-1])
    eager_vs_fp32.add(fp32[:-1], eager[:-1])
    # the .pte's greedy continuation, checked by one teacher-forced pass of the eager model
    # over it: greedy decoding agrees up to the first position where the eager model's
    # argmax differs from the token the .pte chose
    prefixes = []
    for prompt in prompts:
        continuation = program.greedy(prompt, x.greedy_tokens)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + continuation[:-1]]), use_cache=False).logits[0]
        prefixes.append(common_prefix(logits[len(prompt) - 1:].argmax(-1).tolist(), continuation))
    del model
    rates = program.decode_seconds_per_token(prompts[0], x.decode_tokens, x.rounds)
    against_eager = vs_eager.result()
    passed = against_eager["top1_agreement"] >= x.min_top1
    _progress(f"{XNNPACK}: top-1 against eager {against_eager['top1_agreement']:.3f}, greedy "
              f"{sum(p == x.greedy_tokens for p in prefixes)}/{len(prompts)} prompts reproduced, decode "
              f"{statistics.median(1 / r for r in rates):.1f} tok/s on {x.threads} threads")
    if not passed:
        raise EdgepathError(
            f"{XNNPACK}: the .pte disagrees with the eager model quantized the same way (teacher-forced top-1 "
            f"{against_eager['top1_agreement']:.3f} < {x.min_top1}, export.xnnpack.min_top1): a lowering or "
            f"runtime fault; nothing was written")
    return {
        "program": {"file": PTE_NAME, "format": "ExecuTorch .pte, XNNPACK delegate",
                    "inputs": f"input_ids [1, 1] int64, cache_position [1] int64; KV cache of {x.max_seq_len} "
                              f"positions in the program's mutable buffers",
                    "precision": f"8da4w: int4 symmetric weights in groups of {x.group_size} (head included), "
                                 f"int8 dynamic per-token activations, int8 per-row embedding",
                    "lowering_s": round(lowering_s, 1)},
        "calibration": {"inputs": "none needed: activations are quantized per token at run time, weights from "
                                  "their own ranges"},
        "parity": {"against": "the fp32 reference", "windows": 1, "length": x.check_tokens, **vs_fp32.result()},
        "pte": {"state": "built", "detail": "lowered to XNNPACK here and run in ExecuTorch's runtime"},
        "runtime_check": {
            "engine": f"executorch {importlib.metadata.version('executorch')} runtime, XNNPACK, this host's CPU",
            "threads": x.threads,
            "against_eager": {"what": "the eager model quantized the same way (torchao, PyTorch)",
                              **against_eager, "min_top1": x.min_top1},
            # the yardstick: how far quantization itself moved the eager model from fp32
            "eager_against_fp32": eager_vs_fp32.result(),
            "greedy": {"prompts": len(prompts), "tokens": x.greedy_tokens,
                       "reproduced": sum(p == x.greedy_tokens for p in prefixes),
                       "mean_common_prefix": round(statistics.mean(prefixes), 2)},
            "decode_tok_s": executorch_runtime.median_tok_s(rates),
            "decode": {"tokens": x.decode_tokens, "rounds": x.rounds, "batch": 1},
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
    p.add_argument("--path", required=True, help="w8a16-qnn or w4a8-xnnpack")
    p.add_argument("--model", default="build/model/model.json", help="the model record, or a Hugging Face directory")
    p.add_argument("--params", default="params.yaml", help="export settings and calibration's corpus")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier export)")


COMMAND = Command("export", "a phone's build: an ExecuTorch program", """\
    Export the model as the ExecuTorch program a phone runs.

    w8a16-qnn (a Qualcomm NPU): QNN 16a8w, calibrated on real text run through
    the reference model, saved as a torch.export program (program.pt2) with its
    calibration record and its parity against fp32 (top-1, KL, logit SQNR),
    refused below export.qnn's gate; lowered to a QNN model.pte only where
    QNN_SDK_ROOT points to Qualcomm's SDK, otherwise the record says why not.
    w4a8-xnnpack (any phone's CPU): int4 weights, int8 dynamic activations, int8
    embedding, a KV cache, lowered to XNNPACK (slow: minutes, one core) and run
    here in ExecuTorch's runtime against the eager model quantized the same way.
    OUT also holds the tokenizer and generation settings, and export.json.

    example:  edgepath export --path w4a8-xnnpack --out build/exports/w4a8-xnnpack""", _arguments, _cmd)
