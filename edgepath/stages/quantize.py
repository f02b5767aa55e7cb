"""The quantize stage: a 4-bit checkpoint for one weight path.

Lifecycle of ``run(model_dir, path, out, settings)``:

1. Refuse up front what cannot work: an unknown or not-quantized path, a
   corrupt or truncated checkpoint or missing tokenizer (``hf_model.inspect``),
   shapes no group size fits (the path's ``group_rule``, layer named), a
   calibration corpus too short or a chat template missing.
2. Calibrate: draw the token windows (``calibration``).
3. Quantize layer by layer (``quant.sequential``: GPTQ with a per-group grid
   search on the layer's output error), the output head too when ``head: int4``.
   A GGUF path first rounds what its file stores above 4 bits (the tensor policy,
   ``engines.gguf_gptq.DEFAULT_POLICY``: the embedding, the key and value
   projections) to Q8_0, and GPTQ leaves those matrices alone. A W4A8 path first
   ranks the down projections by what int8 inputs do to the model's output
   (``quant.activation_error``) and keeps the first ``w4a8_bf16_down_proj`` bf16,
   out of GPTQ; the checkpoint's ``quantization_config.dynamic`` tells vLLM so.
4. Pack into the path's format (``formats.gptq_format``, ``formats.cpu_int4_format``; for
   ``q4_0-gguf`` a GGUF of Q4_0 blocks, ``engines.gguf_gptq``), copy config,
   tokenizer and chat template (a GGUF carries its own), and write
   ``quantization_report.json`` beside the weights. Its fidelity: perplexity of
   the unquantized model and of the quantized one on each genre's held-out
   windows (``calibration.held_out_genres``: the multi-genre corpus's held-out
   documents, whatever corpus calibrated), each genre's increase in percent, and
   as headline their mean and the worst genre.
5. Check the written checkpoint in its real engine: in vLLM against its
   dequantized weights and the unquantized model (``engine_check``, into
   ``engine_check.json``); a GGUF in llama.cpp against the same weights in
   PyTorch (``engines.gguf_gptq.check``, into ``gguf_check.json``).
   A checkpoint that fails is not published: ``out`` appears whole and
   checked, or not at all (``records.output_directory``: it replaces only an
   earlier checkpoint of this stage, never the model). Where this host's vLLM has no
   kernel for the format (the AVX2 build has no GPTQ kernel), the check records
   why it did not run and the checkpoint is published unchecked, which the
   manifest shows.

Every path the registry says this stage builds (``weight_paths``, ``built_by``
quantize) shares steps 1-3 and the report; they differ in what their record
names: the grid (``w4a8-gptq``: symmetric, its scale searched, for vLLM's GPTQ
kernels; ``w4a16-tinygemm``: asymmetric, its range searched, for tinygemm
through edgepath's vLLM plugin; ``q4_0-gguf``: symmetric at group 32, for llama.cpp;
``quant.gptq.grid``), the group-size rule, and steps 4-5's packing and engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..core import files, records
from ..core.command import Command
from ..core.errors import EdgepathError
from ..formats import hf_model
from ..rules import shapes, weight_paths
from ..rules.fleet import Calibration, Gptq, check_namespace
from ..rules.weight_paths import Engine, Grid, Stage, WeightPathSpec
from ..scoring.agreement import top1_against
from ..scoring.fidelity import headline, increase_percent
from . import engine_check

REPORT_NAME = records.FILE_NAMES["quantization"]
WEIGHTS_NAME = "model.safetensors"
HEADS = ("int4", "bf16")
SEARCH_NAMES = ("output-error", "weight-mse", "none")
"""The objectives of ``quant.gptq.SEARCHES`` (each grid has all three), here so that
settings are checked without torch."""
OVERRIDES = {"samples": ("calibration", "samples"), "length": ("calibration", "length"),
             "search": ("quantize", "gptq", "search"), "head": ("quantize", "head")}
"""The settings ``edgepath quantize`` takes as flags too: flag -> its key in params.yaml."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """``params.yaml``'s ``quantize`` and ``calibration`` namespaces (``from_params``
    documents the keys)."""

    head: str = "bf16"
    w4a8_bf16_down_proj: int = 4
    """Down projections a W4A8 path keeps bf16 (``quant.activation_error``). Measured in
    vLLM on SmolLM2-135M (16 x 512 held-out tokens per genre): none kept +8.78 % mean
    perplexity, four +7.98 %, each at 0.094 more bits per weight (docs/quantize.md)."""
    calibration: Calibration = Calibration()
    search: str = Gptq.search
    damp: float = Gptq.damp
    group_order: bool = Gptq.group_order
    eval_windows: int = 8
    """Held-out windows per genre (0: no perplexity measured). 8, not the benchmark's 16,
    to keep the stage's time bounded: 8 x 512 tokens on each of five genres is already
    2.5x the 16 x 512 of the single novel measured before, scored by both models."""
    eval_length: int = 512

    @classmethod
    def from_params(cls, quantize: dict[str, Any] | None = None, calibration: dict[str, Any] | None = None,
                    where: str = "params", **overrides: Any) -> "Settings":
        """``quantize``: params.yaml's ``quantize`` namespace (``{paths, head, gptq: {search,
        damp, group_order}, eval: {windows, length}}``); ``calibration``: its
        ``calibration`` namespace (``fleet.Calibration``). Absent keys keep their defaults.
        ``overrides`` (the command line's flags; None: not given) replace their keys:
        ``samples`` and ``length`` (calibration), ``search`` (gptq), ``head``. Both are then
        checked against params.yaml's schema, errors naming ``where`` and the key."""
        unknown = sorted(set(overrides) - set(OVERRIDES))
        if unknown:
            raise TypeError(f"no quantize override {unknown}; overrides: {list(OVERRIDES)}")
        quantize, calibration = dict(quantize or {}), dict(calibration or {})
        for name, value in overrides.items():
            if value is None:
                continue
            namespace, *section, key = OVERRIDES[name]
            target = calibration if namespace == "calibration" else quantize
            for part in section:
                target[part] = dict(target.get(part) or {})
                target = target[part]
            target[key] = value
        quantize = check_namespace("quantize", quantize, where)
        shared = Calibration.from_params(calibration, where)
        flat: dict[str, Any] = {"calibration": shared, **(quantize.get("gptq") or {}),
                                **{f"eval_{k}": v for k, v in (quantize.get("eval") or {}).items()}}
        for key in ("head", "w4a8_bf16_down_proj"):
            if key in quantize:
                flat[key] = quantize[key]
        return cls(**flat)


def _pack(spec: WeightPathSpec, prefix: str, q) -> dict[str, Any]:
    """State-dict entries of the quantized layer ``q`` (a ``QuantizedLayer``) in the path's format."""
    from ..formats.checkpoint import layer_format

    fields = (q.codes, q.scales) if spec.grid is Grid.SYMMETRIC else (q.codes, q.scales, q.offsets)
    return layer_format(spec.checkpoint_format).pack(*fields).tensors(prefix)


def quantized_layers(info: dict[str, Any], head: str) -> dict[str, tuple[int, int]]:
    """``{prefix: (out, in)}`` of every linear the checkpoint stores in 4 bits."""
    linears = {name.removesuffix(".weight"): shape
               for name, shape in shapes.block_linears({n: t["shape"] for n, t in info["tensors"].items()}).items()}
    if head == "int4":
        vocab, hidden = info["config"]["vocab_size"], info["config"]["hidden_size"]
        linears["lm_head"] = (vocab, hidden)
    return linears


def _tensor_report(name: str, weight, q) -> dict[str, Any]:
    from ..quant.gptq import snr_db

    ratios = q.ratios.flatten()
    scales = q.scales.flatten()
    return {
        "shape": list(weight.shape),
        "weight_snr_db": round(snr_db(weight, q.dequantize()), 3),
        "scales": {"min": scales.min().item(), "median": scales.median().item(), "max": scales.max().item()},
        "search_ratio": {"mean": round(ratios.mean().item(), 4), "min": round(ratios.min().item(), 4),
                         "max": round(ratios.max().item(), 4),
                         "widened": round((ratios > 1).float().mean().item(), 4),
                         "shrunk": round((ratios < 1).float().mean().item(), 4)},
        "negative_scales": round((scales < 0).float().mean().item(), 4),
    }


def quantization_config(spec: WeightPathSpec, group: int, head: str, damp: float) -> dict[str, Any]:
    """A checkpoint's ``quantization_config`` in path ``spec``'s format: its group, its
    head (``bf16`` or ``int4``) and GPTQ's damping."""
    common = {"quant_method": spec.checkpoint_format, "bits": 4, "group_size": group,
              "sym": spec.grid is Grid.SYMMETRIC,
              "true_sequential": True, "lm_head": head == "int4", "damp_percent": damp}
    if spec.checkpoint_format == "gptq":
        return {**common, "desc_act": False, "static_groups": False, "checkpoint_format": "gptq"}
    from ..formats.cpu_int4_format import FORMAT_VERSION

    return {**common, "format_version": FORMAT_VERSION}


def _copy_side_files(src: Path, dest: Path, tokenizer_files: list[str]) -> None:
    for name in [*tokenizer_files, "generation_config.json", "chat_template.jinja"]:
        if (src / name).is_file() and not (dest / name).exists():
            shutil.copy2(src / name, dest / name)


def run(model_dir: str | Path, path: str, out: str | Path, settings: Settings = Settings()) -> dict[str, Any]:
    """Build ``out`` (module docstring); returns the report written beside the weights."""
    model_dir, out = Path(model_dir), files.path_of(out, "--out")
    spec = weight_paths.require(path, Stage.QUANTIZE)
    if spec.engine is Engine.LLAMA_CPP and settings.head != "bf16":
        raise EdgepathError(f"quantize.head {settings.head!r}: {path} keeps the output head tied to the embedding "
                            f"table, which its GGUF stores as Q8_0; the head setting 'int4' is for vLLM paths")
    records.check_output_directory(out, "quantization", sources=[model_dir])  # before minutes of GPTQ
    info = hf_model.inspect(model_dir, with_file_digests=False)
    layers = quantized_layers(info, settings.head)
    group, group_reason = spec.group_size(layers)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..quant.gptq import grid as search_grid
    from ..quant.sequential import quantize_model
    from ..text import calibration

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = settings.calibration
    corpus = calibration.load_corpus(text.corpus, list(text.holdout))
    calib = calibration.calibration_set(tokenizer, corpus, text.samples, text.length, text.chat_fraction, text.seed)
    held_out = (calibration.held_out_genres(tokenizer, corpus, settings.eval_windows, settings.eval_length)
                if settings.eval_windows else {})
    held_out_documents = calibration.held_out_record(corpus) if held_out else None
    check_sequences = engine_check.check_sequences(tokenizer, corpus)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()
                if n.removesuffix(".weight") in layers}
    if "lm_head" in layers and "lm_head.weight" not in original:
        original["lm_head.weight"] = model.get_output_embeddings().weight.detach().clone()
    ppl_reference = _perplexities(model, held_out, "reference", started)
    grid = search_grid(spec.grid is Grid.SYMMETRIC, settings.search)
    gguf = spec.engine is Engine.LLAMA_CPP
    kept: list[str] = []
    if gguf:  # what the file stores above 4 bits, rounded first, so GPTQ and the report see the file's weights
        from ..engines import gguf_gptq

        gguf_gptq.DEFAULT_POLICY.round_to_stored(model)
        kept = gguf_gptq.DEFAULT_POLICY.kept_from_gptq(model.config.num_hidden_layers)
    bf16_tensors = None
    if spec.w4a8 and settings.w4a8_bf16_down_proj:
        bf16_tensors = _ranked_bf16_tensors(model, calib.tokens, settings.w4a8_bf16_down_proj, started)
        kept = bf16_tensors["tensors"]
    gptq_started = time.monotonic()
    quantized = quantize_model(model, calib.tokens, group, grid, settings.damp,
                               settings.group_order, quantize_head=settings.head == "int4", keep=kept)
    gptq_time = time.monotonic() - gptq_started
    ppl_quantized = _perplexities(model, held_out, "quantized", started, ppl_reference)

    report = {
        **records.envelope("quantization"),
        "path": path,
        "format": {"quant_method": spec.checkpoint_format, "layout": spec.checkpoint_layout,
                   "kernel": spec.group_rule.kernel, "group_size": group, "group_size_reason": group_reason},
        "model": {"directory": str(model_dir.resolve()), "fingerprint": info["fingerprint"]},
        "head": ({"stored": "q8_0", "tied_embedding_kept": "q8_0"} if gguf
                 else {"stored": settings.head, "tied_embedding_kept": "bf16"}),
        "algorithm": {"name": "gptq", "search": grid.name, "ratios": list(grid.ratios), "signed": grid.signed,
                      "damp": settings.damp, "group_order": settings.group_order, "true_sequential": True},
        "calibration": calib.record,
        "fidelity": fidelity(ppl_reference, ppl_quantized, settings.eval_windows, settings.eval_length,
                             held_out_documents),
        "tensors": {p: _tensor_report(p, original[f"{p}.weight"], q) for p, q in sorted(quantized.items())},
        "versions": records.versions("torch", "transformers", "safetensors"),
        "gptq_time_s": round(gptq_time, 1),
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    if bf16_tensors is not None:
        report["bf16_tensors"] = bf16_tensors
    if gguf:
        policy = gguf_gptq.DEFAULT_POLICY
        report["tensor_policy"] = {"embedding": policy.embedding, "q8_0": list(policy.q8_0),
                                   "q8_0_layers": policy.q8_0_layers, "q8_0_tensors": kept,
                                   "reason": gguf_gptq.DEFAULT_POLICY_REASON}
        q4_0 = sum(q.codes.numel() for q in quantized.values())
        q8_0 = sum(model.get_submodule(p).weight.numel() for p in kept)
        report["bits_per_weight"] = round((q4_0 * spec.bits_per_weight(group) + q8_0 * gguf_gptq.Q8_0_BITS)
                                          / (q4_0 + q8_0), 4)
        _publish_gguf(model, model_dir, out, report, check_sequences)
    else:
        kept_weights = sum(model.get_submodule(p).weight.numel() for p in kept)
        del model
        _publish_checkpoint(spec, settings, model_dir, info, out, report, quantized, group, check_sequences,
                            kept, kept_weights)
    return report


# Calibration samples the W4A8 ranking runs on, spread over the set: SmolLM2-135M's top four
# down projections were the same from 16 and from 32 samples (3 min on 2 cores for 16).
RANKING_SAMPLES = 16


def _ranked_bf16_tensors(model, tokens, count: int, started: float) -> dict[str, Any]:
    """The report's ``bf16_tensors``: the ``count`` down projections whose int8 inputs
    move the model's output most (``quant.activation_error``), measured on
    ``RANKING_SAMPLES`` calibration samples."""
    from ..quant.activation_error import rank_down_projections

    sample = tokens[::max(1, len(tokens) // RANKING_SAMPLES)][:RANKING_SAMPLES]
    ranked = rank_down_projections(model, sample)
    kept = [prefix for prefix, _ in ranked[:count]]
    print(f"quantize: down projections kept bf16 (int8 inputs moved the output most): {', '.join(kept)}, "
          f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return {"tensors": kept, "samples": len(sample),
            "ranking": [{"tensor": p, "kl_nats_per_token": round(kl, 6)} for p, kl in ranked],
            "reason": ("vLLM's W4A8 kernel rounds each token's activations to 8 bits; the down projections' "
                       "inputs lose most, and an early layer's error travels through every later one. Each "
                       "layer's int8 input was ranked by the KL divergence it caused in the model's next-token "
                       "distributions on calibration text; the first quantize.w4a8_bf16_down_proj stay bf16 "
                       "(vLLM's unquantized GEMM)")}


def _publish_checkpoint(spec: WeightPathSpec, settings: Settings, model_dir: Path, info: dict[str, Any], out: Path,
                        report: dict[str, Any], quantized: dict[str, Any], group: int,
                        check_sequences: dict[str, list[list[int]]], kept: list[str], kept_weights: int) -> None:
    """Step 4 and 5 for a vLLM path: the safetensors checkpoint in the path's format,
    checked in vLLM (``engine_check``) before ``out`` is published. ``kept``: linears
    stored bf16 (``kept_weights`` weights), which the config tells vLLM to skip."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors_to_save: dict[str, torch.Tensor] = {}
    for f in hf_model.weight_files(model_dir):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                if name.removesuffix(".weight") not in quantized:
                    tensors_to_save[name] = sf.get_tensor(name)
    stored_bits = 0
    for prefix, q in quantized.items():
        for name, t in _pack(spec, prefix, q).items():
            tensors_to_save[name] = t
            stored_bits += t.numel() * t.element_size() * 8
    report["bits_per_weight"] = round((stored_bits + 16 * kept_weights)
                                      / (sum(q.codes.numel() for q in quantized.values()) + kept_weights), 4)
    records.validate("quantization", report, where=str(out / REPORT_NAME))

    config = files.read_json(model_dir / "config.json")
    config["quantization_config"] = quantization_config(spec, group, settings.head, settings.damp)
    if kept:  # GPTQModel's per-module override, which vLLM reads: "-:" + regex skips the module
        config["quantization_config"]["dynamic"] = {f"-:{re.escape(p)}": {} for p in kept}
    if settings.head == "int4":
        config["tie_word_embeddings"] = False  # the bf16 table stays for lookups
    with records.output_directory(out, "quantization", sources=[model_dir]) as scratch:
        save_file(tensors_to_save, str(scratch / WEIGHTS_NAME), metadata={"format": "pt"})
        (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_side_files(model_dir, scratch, info["tokenizer_files"])
        (scratch / REPORT_NAME).write_text(records.dumps(report))
        checked = engine_check.check(scratch, model_dir, check_sequences, w4a8=spec.w4a8)
        records.write(scratch / engine_check.CHECK_NAME, "engine_check",
                      {**records.envelope("engine_check"), **checked})
        if not checked["passed"] and checked["not_run"] is None:
            raise EdgepathError(_failed(checked))


def _publish_gguf(model, model_dir: Path, out: Path, report: dict[str, Any],
                  check_sequences: dict[str, list[list[int]]]) -> None:
    """Step 4 and 5 for a llama.cpp path: the GGUF of GPTQ's blocks
    (``engines.gguf_gptq.write``), checked in llama.cpp against ``model`` (the same
    weights in PyTorch) before ``out`` is published."""
    import os
    import tempfile

    from ..engines import gguf_gptq

    records.validate("quantization", report, where=str(out / REPORT_NAME))
    with records.output_directory(out, "quantization", sources=[model_dir]) as scratch:
        with tempfile.TemporaryDirectory(dir=scratch, prefix=".hf-") as hf:
            gguf_gptq.write(gguf_gptq.save_dequantized(model, model_dir, hf), scratch / gguf_gptq.FILE_NAME)
        (scratch / REPORT_NAME).write_text(records.dumps(report))
        print("quantize: checking the GGUF in llama.cpp against the same weights in PyTorch",
              file=sys.stderr, flush=True)
        checked = gguf_gptq.check(scratch / gguf_gptq.FILE_NAME, model, gguf_gptq.REFERENCE_IS, check_sequences,
                                  threads=os.cpu_count() or 1)
        records.write(scratch / records.FILE_NAMES["gguf_check"], "gguf_check", checked)
        if not checked["passed"]:
            agreement = top1_against(checked, "reference")
            raise EdgepathError(f"llama.cpp's output disagrees with the GPTQ weights it was written from: top-1 "
                                f"agreement {agreement:.3f} < {gguf_gptq.AGREEMENT_PASS} (a packing or "
                                f"tensor-order mistake); the GGUF was not written")


def _perplexities(model, held_out: dict[str, Any], arm: str, started: float,
                  reference: dict[str, float] | None = None) -> dict[str, float]:
    """Genre -> ``model``'s perplexity on its held-out windows, a progress line each
    (with the increase over ``reference``'s, where given)."""
    from ..scoring.evaluate import perplexity

    result = {}
    for i, (genre, windows) in enumerate(held_out.items()):
        result[genre] = perplexity(model, windows)
        increase = f" ({increase_percent(result[genre], reference[genre]):+.1f} %)" if reference else ""
        print(f"quantize: {arm} perplexity on held-out {genre} ({i + 1}/{len(held_out)}): {result[genre]:.2f}"
              f"{increase}, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return result


def fidelity(reference: dict[str, float], quantized: dict[str, float], windows: int, length: int,
             held_out: dict[str, Any] | None) -> dict[str, Any]:
    """The report's fidelity: per genre both perplexities and the increase; the
    headline, the mean increase over the genres and the worst genre (null where
    nothing was measured, ``windows`` 0). ``held_out``: ``calibration.held_out_record``."""
    increases = {g: increase_percent(quantized[g], reference[g]) for g in reference}
    by_genre = {g: {"perplexity_reference": reference[g], "perplexity_quantized": quantized[g],
                    "increase_pct": round(increases[g], 2)} for g in reference}
    return {"windows_per_genre": windows, "length": length, "held_out": held_out, "genres": by_genre,
            **headline(increases)}


def _failed(checked: dict[str, Any]) -> str:
    agreement = top1_against(checked, "dequantized")
    threshold = checked["threshold"]["teacher_forced_top1_vs_dequantized"]
    if not checked["ran_kernel"]:
        return (f"the engine did not run {checked['kernel_op']} on every quantized layer "
                f"(layers: {checked['layer_modes']}); the checkpoint was not written")
    return (f"vLLM's output disagrees with the checkpoint's own dequantized weights: top-1 agreement "
            f"{agreement:.3f} < {threshold} (a layout convention mismatch); the checkpoint was not written")


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet

    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: quantize the directory it names
        model_dir = records.model_directory(model_dir, records.read(model_dir, "model"))
    given = Path(args.params).is_file()
    settings = Settings.from_params(fleet.namespace(args.params, "quantize") if given else {},
                                    fleet.namespace(args.params, "calibration") if given else {},
                                    where=f"{args.params} with the command line's flags", samples=args.samples,
                                    length=args.length, search=args.search, head=args.head)
    report = run(model_dir, args.path, args.out, settings)
    fid = report["fidelity"]
    ppl = (f", held-out perplexity {fid['mean_increase_pct']:+.1f} % over the unquantized model on average "
           f"over {len(fid['genres'])} genres, worst {fid['worst']['genre']} {fid['worst']['increase_pct']:+.1f} %"
           if fid["worst"] else "")
    if weight_paths.get(args.path).engine is Engine.LLAMA_CPP:
        check = records.read(Path(args.out) / records.FILE_NAMES["gguf_check"], "gguf_check")
        checked = (f"llama.cpp check passed (top-1 agreement "
                   f"{top1_against(check, 'reference'):.3f})")
    else:
        check = records.read(Path(args.out) / engine_check.CHECK_NAME, "engine_check")
        checked = f"engine check not run: {check['not_run']}" if check["not_run"] else "engine check passed"
    print(f"quantize: {args.path} ({report['format']['quant_method']}, group {report['format']['group_size']}, "
          f"{report['bits_per_weight']:.3f} bits/weight, head {report['head']['stored']}){ppl}, "
          f"{report['wall_time_s']:.0f} s, {checked} -> {args.out}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face directory, or a model record (model.json)")
    p.add_argument("--path", required=True, help=f"weight path: {', '.join(weight_paths.built_by(Stage.QUANTIZE))}")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier checkpoint)")
    p.add_argument("--params", default="params.yaml",
                   help="settings from its 'quantize' and 'calibration' namespaces, if present")
    p.add_argument("--samples", type=int, help="calibration samples (overrides params)")
    p.add_argument("--length", type=int, help="calibration sample length in tokens (overrides params)")
    p.add_argument("--search", help="grid search: output-error, weight-mse or none (overrides params)")
    p.add_argument("--head", help="output head: int4 or bf16 (overrides params)")


COMMAND = Command("quantize", "write a weight path's 4-bit checkpoint", """\
    Quantize the model into the checkpoint a weight path's kernel reads.

    w4a8-gptq: a GPTQ checkpoint (symmetric int4, v1 layout, no act-order) that
    stock vLLM loads with quantization="gptq" and runs through its int4 x int8
    CPU kernel; GPTQ error feedback with a per-group scale search on the
    layer's output error.
    w4a16-tinygemm: GPTQ on an asymmetric grid, each group's range searched on
    the layer's output error (clipped from min/max), packed as cpu_int4
    (uint8 nibbles, bf16 scales and offsets) that edgepath's vLLM plugin runs
    through PyTorch's tinygemm kernel with bf16 activations.
    q4_0-gguf: the symmetric GPTQ at group 32 written as llama.cpp's Q4_0 blocks
    in a GGUF (metadata, tokenizer and chat template from llama.cpp's converter;
    the tied embedding Q8_0), checked in llama.cpp (OUT: model.gguf,
    quantization_report.json, gguf_check.json).
    All are calibrated on real text (params.yaml: calibration, quantize) and
    checked in their real engine before OUT is published. A vLLM path's OUT
    holds the weights, config, tokenizer, quantization_report.json and
    engine_check.json.

    examples: edgepath quantize --model build/model/hf --path w4a8-gptq --out build/weights/w4a8-gptq
              edgepath quantize --model build/model/model.json --path w4a16-tinygemm \\
                  --out build/weights/w4a16-tinygemm""", _arguments, _cmd)
