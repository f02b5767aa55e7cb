"""The ExecuTorch family: the phone programs ``w8a16-qnn`` (a Qualcomm NPU) and
``w4a8-xnnpack`` and ``w8a8-xnnpack`` (a phone's CPU), built by the export stage.

What the stages ask of it (``paths.WeightPath``, and the export stage's own two):

- export: ``check_settings`` refuses what cannot work before any work
  (an SoC ExecuTorch does not know, widths XNNPACK's 4-bit group does not divide,
  counts too small for a median); ``build_program`` writes the program into the
  export's scratch folder and returns the record's sections:

  - ``w8a16-qnn``: QNN 16a8w (``phone.qnn_w8a16``), calibrated on activations
    captured from the reference model on real text, its parity against fp32
    gated by ``export.qnn``; saved as a torch.export program, and lowered to a QNN
    ``model.pte`` only where Qualcomm's SDK is installed.
  - ``w4a8-xnnpack``: GPTQ on XNNPACK's grid (positive scales, group
    ``XNNPACK_GROUP_SIZE``), its key and value projections and head at 8 bits;
    ``w8a8-xnnpack``: every linear int8, rounded to nearest. Both lowered to
    XNNPACK with ExecuTorch's custom SDPA and KV cache (``phone.xnnpack``) and run
    here in ExecuTorch's runtime (``engines.executorch_runtime``): against the
    eager model quantized the same way (``export.xnnpack.min_top1``: a lowering
    fault) and against fp32 on every held-out genre (``min_top1_fp32``, checked
    on the eager model before the minutes of lowering, and on the program after).

- manifest: ``export_detail`` (what the record says was built, and its parity)
  and ``verification`` (checked off-device: the build host is not a phone).
- serve: refused: a phone's program runs on the phone.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from ..core import records
from ..core.command import progress
from ..core.errors import EdgepathError
from ..rules.weight_paths import XNNPACK_GROUP_SIZE, Engine, Stage
from . import WeightPath, register

QNN = "w8a16-qnn"
XNNPACK = "w4a8-xnnpack"
XNNPACK_8BIT = "w8a8-xnnpack"
PROGRAM_NAME = "program.pt2"
PTE_NAME = "model.pte"


def _build_qnn(model_dir: Path, tokenizer, corpus, settings, scratch: Path) -> dict[str, Any]:
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


def _quantize_for_xnnpack(path: str, model, settings, shared) -> tuple[dict[str, Any], str]:
    """Quantize ``model`` in place by ``path``'s recipe (``phone.xnnpack``; the 4-bit one
    from ``shared``, the calibrate stage's output); returns the record's ``calibration``
    (which quantization made the weights, on what text) and the program's precision
    in a phrase."""
    from ..phone import xnnpack

    if path == XNNPACK:
        calibrated = shared.record["calibration"]
        progress("export", f"{path}: GPTQ from the calibrate stage's Hessians of {calibrated['samples']} x "
                 f"{calibrated['length']} calibration tokens, XNNPACK's grid (symmetric, group {XNNPACK_GROUP_SIZE}, "
                 f"positive bf16 scales)")
        gptq_started = time.monotonic()
        layers = xnnpack.quantize_8da4w(model, shared.hessians(), **dataclasses.asdict(settings.gptq))
        weights = {"algorithm": "gptq", "grid": f"symmetric int4, group {XNNPACK_GROUP_SIZE}, one positive scale "
                                                f"per group exact in bf16",
                   **dataclasses.asdict(settings.gptq), "signed": False,
                   "int4_weights": sum(q.codes.numel() for q in layers.values()),
                   "gptq_s": round(time.monotonic() - gptq_started, 1),
                   "shared_with_q4_0_gguf": False,
                   "why_own_run": ("q4_0-gguf's GPTQ searches each scale's sign too and stores negative scales, "
                                   "which XNNPACK refuses (the program fails to load: xnn_status_invalid_parameter); "
                                   "the grids differ, so this program runs GPTQ on its own grid, from the Hessians "
                                   "every path shares")}
        calibration_record = {**calibrated, "weights": weights,
                              "inputs": "the calibrate stage's Hessians of the reference model's layer inputs (fp32) "
                                        "over the calibration windows, for GPTQ; activations are quantized per token "
                                        "at run time"}
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


def _build_xnnpack(path: str, model_dir: Path, tokenizer, corpus, settings, scratch: Path,
                   shared) -> dict[str, Any]:
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
    calibration_record, precision = _quantize_for_xnnpack(path, model, settings, shared)
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


def _export_detail(record: dict[str, Any]) -> str:
    parity, pte = record["parity"], record["pte"]
    sqnr = "exact" if parity["logit_sqnr_db"] is None else f"{parity['logit_sqnr_db']:.1f} dB"
    worst = (f" (worst genre {parity['worst']['genre']} {parity['worst']['top1_agreement']:.3f})"
             if "worst" in parity else "")
    against_fp32 = (f"top-1 {parity['top1_agreement']:.3f}{worst}, KL {parity['kl_nats']:.4f} nats, logit SQNR {sqnr} "
                    f"against fp32 on {parity['positions']} held-out positions, passing the gate (top-1 >= "
                    f"{parity['gate']['min_top1']})")
    if "soc" in record["program"]:
        calibration = record["calibration"]
        made = (f"export@{record['path']}: {record['program']['precision']} for {record['program']['soc']}, calibrated "
                f"on {calibration['samples']} x {calibration['length']} tokens of {calibration['corpus']} "
                f"({calibration['chat_samples']} chat turns); {against_fp32}")
    else:
        calibration = record["calibration"]
        on = (f" calibrated on {calibration['samples']} x {calibration['length']} tokens of {calibration['corpus']}"
              if "samples" in calibration else "")
        made = (f"export@{record['path']}: {record['program']['precision']}, weights by "
                f"{calibration['weights']['algorithm']}{on}; {against_fp32}")
    return f"{made}; .pte {pte['state']}" + ("" if pte["state"] == "built" else f": {pte['detail']}")


def _export_verification(name: str, export: dict[str, Any]) -> dict[str, Any]:
    check = export.get("runtime_check")
    if check is None:
        return {"state": "not run here",
                "detail": (f"{name}'s program was checked against fp32 on the build host with its quantization "
                           f"simulated (export record); no NPU ran it")}
    eager, greedy = check["against_eager"], check["greedy"]
    return {"state": "checked off-device",
            "detail": (f"{name}'s .pte ran in {check['engine']} (the build host, not a phone): teacher-forced top-1 "
                       f"{eager['top1_agreement']:.3f} against {eager['what']} (gate {eager['min_top1']}: a "
                       f"lowering fault), {export['parity']['top1_agreement']:.3f} against fp32 (gate "
                       f"{export['parity']['gate']['min_top1']}: the fidelity the phone gets; the eager model "
                       f"{check['eager_against_fp32']['top1_agreement']:.3f}), {greedy['reproduced']}/"
                       f"{greedy['prompts']} prompts reproduced over {greedy['tokens']} tokens; no phone ran it")}


@register
class ExecuTorchProgram(WeightPath):
    """The phone programs (module docstring)."""

    engine = Engine.EXECUTORCH
    built_by = Stage.EXPORT

    def check_settings(self, settings, info: dict[str, Any], shared) -> None:
        """Refuse ``settings`` (``stages.export.Settings``) this program cannot be built
        with, on the checkpoint described by ``info`` (``hf_model.inspect``), and a 4-bit
        program without ``shared``, the calibrate stage's output its GPTQ reads."""
        path = self.spec.name
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
            if path == XNNPACK and shared is None:
                raise EdgepathError(f"{path}: its GPTQ reads the calibrate stage's Hessians: pass --calibration "
                                    "(the output of edgepath calibrate on this model)")

    def build_program(self, model_dir: Path, tokenizer, corpus, settings, scratch: Path,
                      shared=None) -> dict[str, Any]:
        """The program in ``scratch``; returns the export record's ``program``,
        ``calibration``, ``parity`` and ``pte`` (and ``runtime_check`` where it ran).
        ``shared``: the calibrate stage's output (``stages.calibrate.SharedCalibration``)."""
        if self.spec.name == QNN:
            return _build_qnn(model_dir, tokenizer, corpus, settings, scratch)
        return _build_xnnpack(self.spec.name, model_dir, tokenizer, corpus, settings, scratch, shared)

    def export_detail(self, record: dict[str, Any]) -> str:
        return _export_detail(record)

    def verification(self, record: dict[str, Any]) -> dict[str, Any]:
        """The manifest's verification of a program: checked against fp32 on the build
        host, and in ExecuTorch's runtime where it ran there; never on a phone."""
        return _export_verification(self.spec.name, record)

    def served_model(self, build, host) -> Path:
        raise EdgepathError(f"{build.root}: {build.tag}'s build {self._not_served}")

    def server_command(self, model: Path, name: str, host: str, port: int, parallel: int, context: int,
                       engine_args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        raise EdgepathError(f"{self.spec.name} {self._not_served}")

    @property
    def _not_served(self) -> str:
        return (f"({self.spec.name}) is an ExecuTorch program: it runs in the app on the phone, not as a server; "
                f"serve the build of a CPU or GPU target (a vLLM checkpoint or a GGUF) instead")
