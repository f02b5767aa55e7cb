"""The quantize stage: a 4-bit checkpoint for one weight path.

Lifecycle of ``run(model_dir, path, out, calibrated, settings)``:

1. Refuse up front what cannot work: an unknown or not-quantized path, a
   corrupt or truncated checkpoint or missing tokenizer (``hf_model.inspect``),
   shapes no group size fits (the path's ``group_rule``, layer named), a
   calibrate stage's output made from another model or with other held-out text.
2. Read what the calibrate stage computed once for every path
   (``stages.calibrate``): the Hessians of every linear's input, the reference
   perplexities, the W4A8 ranking.
3. Quantize (``quant.sequential``: GPTQ with a per-group grid search on the
   layer's output error), the output head too when ``head: int4``: from the shared
   Hessians, every linear in parallel; or, for a path listed in
   ``quantize.true_sequential``, layer by layer on the calibration windows, each
   group of linears on the outputs of those already quantized. First the path's
   family fixes what GPTQ must leave alone (``before_gptq``: a GGUF's tensors
   stored above 4 bits, a W4A8 path's down projections kept bf16).
4. The report (``quantization_report.json``): the format, group and why, the
   grid search, the calibration, and the fidelity: perplexity of the unquantized
   model (the calibrate stage's) and of the quantized one on each genre's
   held-out windows (``calibration.held_out_genres``: the multi-genre corpus's
   held-out documents, whatever corpus calibrated), each genre's increase in
   percent, and as headline their mean and the worst genre.
5. The path's family packs the weights in its format, writes its artifact beside
   the report and checks it in its real engine (``paths.WeightPath.publish``). An
   artifact that fails is not published: ``out`` appears whole and checked, or not
   at all (``records.output_directory``: it replaces only an earlier checkpoint of
   this stage, never the model). Where this host's engine has no kernel for the
   format, the check records why it did not run and the checkpoint is published
   unchecked, which the manifest shows.

Every path the registry says this stage builds (``weight_paths``, ``built_by``
quantize) shares steps 1-4; they differ in what their record names (the grid,
``quant.gptq.grid``, and the group-size rule) and in their family's steps 3 and 5
(``edgepath/paths/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..core import files, records, usage
from ..core.command import Command
from ..formats import hf_model
from ..rules import shapes, weight_paths
from ..rules.fleet import Calibration, Gptq, check_namespace
from ..rules.weight_paths import Grid, Stage
from ..scoring.fidelity import headline, increase_percent
from .calibrate import SharedCalibration
from .probe import probe

REPORT_NAME = records.FILE_NAMES["quantization"]
WEIGHTS_NAME = "model.safetensors"
HEADS = ("int4", "bf16")
SEARCH_NAMES = ("output-error", "weight-mse", "none")
"""The objectives of ``quant.gptq.SEARCHES`` (each grid has all three), here so that
settings are checked without torch."""
OVERRIDES = {"search": ("quantize", "gptq", "search"), "head": ("quantize", "head")}
"""The settings ``edgepath quantize`` takes as flags too: flag -> its key in params.yaml.
The calibration's (samples, length) are the calibrate stage's."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """``params.yaml``'s ``quantize`` and ``calibration`` namespaces (``from_params``
    documents the keys)."""

    head: str = "bf16"
    w4a8_bf16_down_proj: int = 4
    """Down projections a W4A8 path keeps bf16 (``quant.activation_error``). Measured in
    vLLM on SmolLM2-135M (16 x 512 held-out tokens per genre): none kept +8.78 % mean
    perplexity, four +7.98 %, each at 0.094 more bits per weight (docs/quantize.md)."""
    true_sequential: tuple[str, ...] = ()
    """Paths whose GPTQ runs its own true-sequential pass instead of the shared Hessians."""
    rotate: tuple[str, ...] = ()
    """Paths whose model is rotated before GPTQ (``quant.rotation``: norms folded, R1, R2),
    drawn from the calibration's seed. None by default: on SmolLM2-135M the mean held-out
    increase fell on every path, the worst genre rose on two, and the untied head grew
    every artifact (benchmarks/results/rotation.md)."""
    calibration: Calibration = Calibration()
    search: str = Gptq.search
    damp: float = Gptq.damp
    group_order: bool = Gptq.group_order

    @classmethod
    def from_params(cls, quantize: dict[str, Any] | None = None, calibration: dict[str, Any] | None = None,
                    where: str = "params", **overrides: Any) -> "Settings":
        """``quantize``: params.yaml's ``quantize`` namespace (``{paths, head,
        w4a8_bf16_down_proj, true_sequential, rotate, gptq: {search, damp, group_order}}``; its
        ``eval`` is the calibrate stage's); ``calibration``: its ``calibration`` namespace
        (``fleet.Calibration``). Absent keys keep their defaults. ``overrides`` (the command
        line's flags; None: not given) replace their keys: ``search`` (gptq), ``head``.
        Both are then checked against params.yaml's schema, errors naming ``where`` and the
        key."""
        unknown = sorted(set(overrides) - set(OVERRIDES))
        if unknown:
            raise TypeError(f"no quantize override {unknown}; overrides: {list(OVERRIDES)}")
        quantize = dict(quantize or {})
        for name, value in overrides.items():
            if value is None:
                continue
            *section, key = OVERRIDES[name][1:]
            target = quantize
            for part in section:
                target[part] = dict(target.get(part) or {})
                target = target[part]
            target[key] = value
        quantize = check_namespace("quantize", quantize, where)
        flat: dict[str, Any] = {"calibration": Calibration.from_params(calibration, where),
                                **(quantize.get("gptq") or {})}
        for key in ("head", "w4a8_bf16_down_proj"):
            if key in quantize:
                flat[key] = quantize[key]
        for key in ("true_sequential", "rotate"):
            if key in quantize:
                flat[key] = tuple(quantize[key])
        return cls(**flat)


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


def run(model_dir: str | Path, path: str, out: str | Path, calibrated: str | Path,
        settings: Settings = Settings()) -> dict[str, Any]:
    """Build ``out`` (module docstring) from the calibrate stage's output ``calibrated``
    (its directory or record); returns the report written beside the weights."""
    model_dir, out = Path(model_dir), files.path_of(out, "--out")
    spec = weight_paths.require(path, Stage.QUANTIZE)
    family = paths.of(spec)
    family.refuse(settings)
    records.check_output_directory(out, "quantization", sources=[model_dir])  # before minutes of GPTQ
    info = hf_model.inspect(model_dir, with_file_digests=False)
    layers = quantized_layers(info, settings.head)
    group, group_reason = spec.group_size(layers)
    shared = SharedCalibration(calibrated, info["fingerprint"])

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..quant.gptq import grid as search_grid
    from ..quant.sequential import GptqPlan, quantize_from_hessians, quantize_model
    from ..scoring.evaluate import perplexity_by_genre
    from ..text import calibration

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    text = settings.calibration
    corpus = calibration.load_corpus(text.corpus, list(text.holdout))
    reference = shared.record["reference"]
    held_out = (calibration.held_out_genres(tokenizer, corpus, reference["windows_per_genre"], reference["length"])
                if reference["windows_per_genre"] else {})
    shared.check_held_out({g: calibration.tokens_sha256(w) for g, w in held_out.items()})
    check_sequences = calibration.check_sequences(tokenizer, corpus)

    hessians = None if path in settings.true_sequential else shared.hessians()  # every file checked up front
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    rotation = None
    if path in settings.rotate:  # before the copies below: GPTQ and its report see the rotated weights
        from ..quant.rotation import rotate

        rotation = rotate(model, text.seed)
        hessians = hessians and rotation.hessians(hessians)
    original = {n: p.detach().clone() for n, p in model.named_parameters()
                if n.removesuffix(".weight") in layers}
    if "lm_head" in layers and "lm_head.weight" not in original:
        original["lm_head.weight"] = model.get_output_embeddings().weight.detach().clone()
    grid = search_grid(spec.grid is Grid.SYMMETRIC, settings.search)
    kept, path_fields = family.before_gptq(model, shared, settings, started)
    sequential = hessians is None
    plan = GptqPlan(group, grid, settings.damp, settings.group_order, quantize_head=settings.head == "int4",
                    keep=kept)
    gptq_started = time.monotonic()
    if sequential:
        calib = calibration.calibration_set(tokenizer, corpus, text.samples, text.length, text.chat_fraction,
                                            text.seed)
        shared.check_calibration(calib.record)
        quantized = quantize_model(model, calib.tokens, plan)
    else:
        quantized = quantize_from_hessians(model, hessians, plan)
    gptq_time = time.monotonic() - gptq_started
    tensors = {p: _tensor_report(p, original[f"{p}.weight"], q) for p, q in sorted(quantized.items())}
    del original  # an fp32 copy of every linear: 5.2 GB at 1.5B, dropped before the evaluation and the packing
    ppl_quantized = perplexity_by_genre(model, held_out, lambda genre, ppl: print(
        f"quantize: quantized perplexity on held-out {genre}: {ppl:.2f} "
        f"({increase_percent(ppl, reference['perplexity'][genre]):+.1f} %), {time.monotonic() - started:.0f} s",
        file=sys.stderr, flush=True))

    report = {
        **records.envelope("quantization"),
        "path": path,
        "format": {"quant_method": spec.checkpoint_format, "layout": spec.checkpoint_layout,
                   "kernel": spec.group_rule.kernel, "group_size": group, "group_size_reason": group_reason},
        "model": {"directory": str(model_dir.resolve()), "fingerprint": info["fingerprint"]},
        "head": family.head_record(settings),
        "algorithm": {"name": "gptq", "search": grid.name, "ratios": list(grid.ratios), "signed": grid.signed,
                      "damp": settings.damp, "group_order": settings.group_order, "true_sequential": sequential,
                      "inputs": ("this path's own pass: each group of linears on the outputs of those already "
                                 "quantized" if sequential else
                                 "the calibrate stage's Hessians of the unquantized model's inputs")},
        "calibration": shared.record["calibration"],
        "fidelity": fidelity(reference["perplexity"], ppl_quantized, reference["windows_per_genre"],
                             reference["length"], reference["held_out"]),
        "tensors": tensors,
        "versions": records.versions("torch", "transformers", "safetensors"),
        "rotation": rotation and rotation.record(),
        "gptq_time_s": round(gptq_time, 1),
        **usage.cost(started),
        **path_fields,
    }
    built = paths.QuantizedModel(model, model_dir, info, quantized, group, kept, check_sequences, probe())
    del model  # the family may hand the memory back before its engine starts
    family.publish(built, report, settings, out)
    return report


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


# ---------------------------------------------------------------- the command

def _cmd(args: argparse.Namespace) -> None:
    from ..rules import fleet

    model_dir = Path(args.model)
    if model_dir.is_file():  # a model record: quantize the directory it names
        model_dir = records.model_directory(model_dir, records.read(model_dir, "model"))
    given = Path(args.params).is_file()
    settings = Settings.from_params(fleet.namespace(args.params, "quantize") if given else {},
                                    fleet.namespace(args.params, "calibration") if given else {},
                                    where=f"{args.params} with the command line's flags", search=args.search,
                                    head=args.head)
    report = run(model_dir, args.path, args.out, args.calibration, settings)
    fid = report["fidelity"]
    ppl = (f", held-out perplexity {fid['mean_increase_pct']:+.1f} % over the unquantized model on average "
           f"over {len(fid['genres'])} genres, worst {fid['worst']['genre']} {fid['worst']['increase_pct']:+.1f} %"
           if fid["worst"] else "")
    checked = paths.of(args.path).check_line(Path(args.out))
    print(f"quantize: {args.path} ({report['format']['quant_method']}, group {report['format']['group_size']}, "
          f"{report['bits_per_weight']:.3f} bits/weight, head {report['head']['stored']}){ppl}, "
          f"{report['wall_time_s']:.0f} s, {checked} -> {args.out}")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face directory, or a model record (model.json)")
    p.add_argument("--calibration", required=True,
                   help="the calibrate stage's output directory (or its calibration.json), of the same model")
    p.add_argument("--path", required=True, help=f"weight path: {', '.join(weight_paths.built_by(Stage.QUANTIZE))}")
    p.add_argument("--out", required=True, help="output directory (replaced atomically; only an earlier checkpoint)")
    p.add_argument("--params", default="params.yaml",
                   help="settings from its 'quantize' and 'calibration' namespaces, if present")
    p.add_argument("--search", help="grid search: output-error, weight-mse or none (overrides params)")
    p.add_argument("--head", help="output head: int4 or bf16 (overrides params)")


def _help() -> str:
    paths_built = "\n".join(f"    {name} ({weight_paths.get(name).engine.value}): {weight_paths.get(name).summary}"
                             for name in weight_paths.built_by(Stage.QUANTIZE))
    first = weight_paths.built_by(Stage.QUANTIZE)[0]
    return f"""\
    Quantize the model into the artifact a weight path's kernel reads:

{paths_built}

    Each is calibrated on real text (params.yaml: calibration, quantize), from what
    `edgepath calibrate` computed once for every path, and checked in its real
    engine before OUT is published. OUT holds the artifact (a vLLM
    checkpoint's weights, config and tokenizer, or a GGUF), quantization_report.json
    and the engine's check record.

    example:  edgepath quantize --model build/model/model.json --calibration build/calibration \\
                  --path {first} --out build/weights/{first}"""


COMMAND = Command("quantize", "write a weight path's 4-bit checkpoint", _help(), _arguments, _cmd)
