"""The quantize stage: a 4-bit checkpoint for one weight path.

Lifecycle of ``run(model_dir, path, out, settings)``:

1. Refuse up front what cannot work: an unknown or not-quantized path, a
   corrupt or truncated checkpoint or missing tokenizer (``hf_model.inspect``),
   shapes no group size fits (the path's ``KernelShapeRule``, layer named), a
   calibration corpus too short or a chat template missing.
2. Calibrate: draw the token windows (``quant.calibration``).
3. Quantize layer by layer (``quant.sequential``: GPTQ with the per-group
   output-error scale search), the output head too when ``head: int4``.
4. Pack into the path's format (``quant.gptq_format``), copy config,
   tokenizer and chat template, measure held-out perplexity against the
   unquantized model, and write ``quantization_report.json`` beside the
   weights.
5. Check the written checkpoint in real vLLM against its dequantized weights
   and the unquantized model (``engine_check``), into ``engine_check.json``.
   A checkpoint that fails is not published: ``out`` appears whole and
   checked, or not at all (``atomic.directory``). Where this host's vLLM has no
   kernel for the format (the AVX2 build has no GPTQ kernel), the check records
   why it did not run and the checkpoint is published unchecked, which the
   manifest shows.

Both CPU formats share steps 1-3 and the report; they differ in the grid
(``w4a8-amx``: symmetric GPTQ with the scale search, for vLLM's GPTQ kernels;
``w4a16-tinygemm``: GPTQ on an asymmetric min/max grid, for tinygemm through
edgepath's vLLM plugin) and in step 4's packing (``PathFormat``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
import time
from pathlib import Path
from typing import Any

from . import __version__, atomic, engine_check, hf_model, records, shapes
from .errors import EdgepathError
from .fleet import check_keys
from .select import CPU_ENGINES

REPORT_NAME = "quantization_report.json"
WEIGHTS_NAME = "model.safetensors"
HEADS = ("int4", "bf16")
SEARCH_NAMES = ("output-error", "weight-mse", "none")
"""``quant.gptq.SEARCHES``'s keys, here so that settings are checked without torch."""


@dataclasses.dataclass(frozen=True)
class PathFormat:
    """What a weight path's checkpoint is, and the kernel rule its shapes obey. How
    the engine runs it (quantization method, activations) is ``select.CPU_ENGINES``."""

    path: str
    layout: str
    rule: shapes.KernelShapeRule
    symmetric: bool
    """Symmetric grid with the scale search (``quantize.gptq.search``), or asymmetric min/max."""

    @property
    def quant_method(self) -> str:
        return CPU_ENGINES[self.path].quantization

    @property
    def w4a8(self) -> bool:
        return CPU_ENGINES[self.path].w4a8

    def pack(self, prefix: str, q) -> dict[str, Any]:
        """State-dict entries of the quantized layer ``q`` (a ``QuantizedLayer``) in this format."""
        from .quant import layer_format

        fields = (q.codes, q.scales) if self.symmetric else (q.codes, q.scales, q.offsets)
        return layer_format(self.quant_method).pack(*fields).tensors(prefix)


FORMATS = {
    "w4a8-amx": PathFormat("w4a8-amx", "GPTQ v1, symmetric int4, zero 8 stored as 7", shapes.GPTQ_CPU,
                           symmetric=True),
    "w4a16-tinygemm": PathFormat("w4a16-tinygemm",
                                 "cpu_int4 v1, asymmetric int4: uint8 nibbles [N, K/2], bf16 scales and offsets "
                                 "[N, K/g] (edgepath/quant/cpu_int4_format.py)", shapes.TINYGEMM_CPU,
                                 symmetric=False),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """``params.yaml``'s ``quantize`` namespace (``from_params`` documents the keys)."""

    head: str = "int4"
    corpus: str = "austen"
    holdout: tuple[str, ...] = ("persuasion",)
    samples: int = 128
    length: int = 256
    chat_fraction: float = 0.25
    seed: int = 0
    search: str = "output-error"
    damp: float = 0.05
    group_order: bool = True
    eval_windows: int = 16
    eval_length: int = 512

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Settings":
        """``{head, calibration: {corpus, holdout, samples, length, chat_fraction, seed},
        gptq: {search, damp, group_order}, eval: {windows, length}}``; absent keys keep
        their defaults, unknown keys are refused."""
        known = {"paths", "head", "calibration", "gptq", "eval"}
        check_keys("quantize", params, known)
        flat: dict[str, Any] = {}
        if "head" in params:
            flat["head"] = params["head"]
        for section, keys, prefix in (
            ("calibration", ("corpus", "holdout", "samples", "length", "chat_fraction", "seed"), ""),
            ("gptq", ("search", "damp", "group_order"), ""),
            ("eval", ("windows", "length"), "eval_"),
        ):
            sub = params.get(section) or {}
            check_keys(f"quantize.{section}", sub, set(keys))
            flat.update({prefix + k: sub[k] for k in keys if k in sub})
        if "holdout" in flat:
            holdout = flat["holdout"]
            if not isinstance(holdout, list) or not all(isinstance(h, str) for h in holdout):
                raise EdgepathError(f"quantize.calibration.holdout must be a list of document names, got {holdout!r}")
            flat["holdout"] = tuple(holdout)
        return cls.checked(cls(**flat))

    @classmethod
    def checked(cls, settings: "Settings") -> "Settings":
        """``settings`` itself, after checking every field's type and range."""
        defaults = cls()
        for field in dataclasses.fields(cls):
            value, want = getattr(settings, field.name), type(getattr(defaults, field.name))
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok:
                raise EdgepathError(f"quantize: {field.name} must be {want.__name__}, got {value!r}")
        if settings.head not in HEADS:
            raise EdgepathError(f"quantize.head must be one of {list(HEADS)}, got {settings.head!r}")
        if settings.search not in SEARCH_NAMES:
            raise EdgepathError(f"quantize.gptq.search must be one of {list(SEARCH_NAMES)}, got {settings.search!r}")
        if not 0 < settings.damp < 1:
            raise EdgepathError(f"quantize.gptq.damp must be in (0, 1), got {settings.damp}")
        return settings


def path_format(path: str) -> PathFormat:
    fmt = FORMATS.get(path)
    if fmt is None:
        raise EdgepathError(f"weight path {path!r} has no 4-bit checkpoint to build; edgepath quantize "
                            f"builds {sorted(FORMATS)}")
    return fmt


def quantized_layers(info: dict[str, Any], head: str) -> dict[str, tuple[int, int]]:
    """``{prefix: (out, in)}`` of every linear the checkpoint stores in 4 bits."""
    linears = {name.removesuffix(".weight"): shape
               for name, shape in shapes.block_linears({n: t["shape"] for n, t in info["tensors"].items()}).items()}
    if head == "int4":
        vocab, hidden = info["config"]["vocab_size"], info["config"]["hidden_size"]
        linears["lm_head"] = (vocab, hidden)
    return linears


def _versions() -> dict[str, str]:
    names = ("torch", "transformers", "safetensors")
    return {"edgepath": __version__, **{n: importlib.metadata.version(n) for n in names}}


def _tensor_report(name: str, weight, q) -> dict[str, Any]:
    from .quant.gptq import snr_db

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
    }


def _quantization_config(fmt: PathFormat, group: int, settings: Settings) -> dict[str, Any]:
    common = {"quant_method": fmt.quant_method, "bits": 4, "group_size": group, "sym": fmt.symmetric,
              "true_sequential": True, "lm_head": settings.head == "int4", "damp_percent": settings.damp}
    if fmt.quant_method == "gptq":
        return {**common, "desc_act": False, "static_groups": False, "checkpoint_format": "gptq"}
    from .quant.cpu_int4_format import FORMAT_VERSION

    return {**common, "format_version": FORMAT_VERSION}


def _copy_side_files(src: Path, dest: Path, tokenizer_files: list[str]) -> None:
    for name in [*tokenizer_files, "generation_config.json", "chat_template.jinja"]:
        if (src / name).is_file() and not (dest / name).exists():
            shutil.copy2(src / name, dest / name)


def run(model_dir: str | Path, path: str, out: str | Path, settings: Settings = Settings()) -> dict[str, Any]:
    """Build ``out`` (module docstring); returns the report written beside the weights."""
    model_dir, out = Path(model_dir), Path(out)
    fmt = path_format(path)
    info = hf_model.inspect(model_dir, with_file_digests=False)
    layers = quantized_layers(info, settings.head)
    group, group_reason = fmt.rule.choose_group_size(layers)

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quant import calibration
    from .quant.evaluate import perplexity
    from .quant.gptq import MINMAX, SEARCHES
    from .quant.sequential import quantize_model

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    corpus = calibration.load_corpus(settings.corpus, list(settings.holdout))
    calib = calibration.calibration_set(tokenizer, corpus, settings.samples, settings.length,
                                        settings.chat_fraction, settings.seed)
    eval_windows = (calibration.evaluation_set(tokenizer, corpus, settings.eval_windows, settings.eval_length)
                    if settings.eval_windows else None)
    check_sequences = engine_check.check_sequences(tokenizer, corpus)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    original = {n: p.detach().clone() for n, p in model.named_parameters()
                if n.removesuffix(".weight") in layers}
    if "lm_head" in layers and "lm_head.weight" not in original:
        original["lm_head.weight"] = model.get_output_embeddings().weight.detach().clone()
    ppl_reference = perplexity(model, eval_windows) if eval_windows is not None else None
    grid = SEARCHES[settings.search] if fmt.symmetric else MINMAX
    gptq_started = time.monotonic()
    quantized = quantize_model(model, calib.tokens, group, grid, settings.damp,
                               settings.group_order, quantize_head=settings.head == "int4")
    gptq_time = time.monotonic() - gptq_started
    ppl_quantized = perplexity(model, eval_windows) if eval_windows is not None else None

    tensors_to_save: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                if name.removesuffix(".weight") not in quantized:
                    tensors_to_save[name] = sf.get_tensor(name)
    stored_bits = 0
    for prefix, q in quantized.items():
        for name, t in fmt.pack(prefix, q).items():
            tensors_to_save[name] = t
            stored_bits += t.numel() * t.element_size() * 8
    quantized_weights = sum(q.codes.numel() for q in quantized.values())

    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt, group, settings)
    if settings.head == "int4":
        config["tie_word_embeddings"] = False  # the bf16 table stays for lookups

    report = {
        **records.envelope("quantization"),
        "path": path,
        "format": {"quant_method": fmt.quant_method, "layout": fmt.layout,
                   "kernel": fmt.rule.kernel, "group_size": group, "group_size_reason": group_reason},
        "model": {"directory": str(model_dir.resolve()), "fingerprint": info["fingerprint"]},
        "head": {"stored": settings.head, "tied_embedding_kept": "bf16"},
        "algorithm": {"name": "gptq", "search": grid.name, "ratios": list(grid.ratios),
                      "damp": settings.damp, "group_order": settings.group_order, "true_sequential": True},
        "calibration": calib.record,
        "bits_per_weight": round(stored_bits / quantized_weights, 4),
        "fidelity": {"eval_windows": settings.eval_windows, "eval_length": settings.eval_length,
                     "perplexity_reference": ppl_reference, "perplexity_quantized": ppl_quantized},
        "tensors": {p: _tensor_report(p, original[f"{p}.weight"], q) for p, q in sorted(quantized.items())},
        "versions": _versions(),
        "gptq_time_s": round(gptq_time, 1),
        "wall_time_s": round(time.monotonic() - started, 1),
    }
    records.validate("quantization", report, where=str(out / REPORT_NAME))
    del model
    with atomic.directory(out) as scratch:
        save_file(tensors_to_save, str(scratch / WEIGHTS_NAME), metadata={"format": "pt"})
        (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_side_files(model_dir, scratch, info["tokenizer_files"])
        (scratch / REPORT_NAME).write_text(records.dumps(report))
        checked = engine_check.check(scratch, model_dir, check_sequences, w4a8=fmt.w4a8)
        records.write(scratch / engine_check.CHECK_NAME, "engine_check", {**records.envelope("engine_check"), **checked})
        if not checked["passed"] and checked["not_run"] is None:
            raise EdgepathError(_failed(checked))
    return report


def _failed(checked: dict[str, Any]) -> str:
    agreement = checked["against"]["dequantized"]["teacher_forced_top1_agreement"]
    threshold = checked["threshold"]["teacher_forced_top1_vs_dequantized"]
    if not checked["ran_kernel"]:
        return (f"the engine did not run {checked['kernel_op']} on every quantized layer "
                f"(layers: {checked['layer_modes']}); the checkpoint was not written")
    return (f"vLLM's output disagrees with the checkpoint's own dequantized weights: top-1 agreement "
            f"{agreement:.3f} < {threshold} (a layout convention mismatch); the checkpoint was not written")
