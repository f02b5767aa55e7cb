"""Benchmark: which calibration and GPTQ settings generalize, per held-out genre.

    .venv/bin/python -m benchmarks.calibration                  # every variant, ~1.5 h on 2 cores
    .venv/bin/python -m benchmarks.calibration --only mix-sym     # some of them

Every arm is scored on the same token ids: ``calibration.held_out_genres``'
windows of each genre of the multi-genre corpus (documents no variant calibrates
on), perplexity in PyTorch fp32 on the arm's dequantized weights, and its
increase over the unquantized model's. The llama.cpp control (Q4_0, Q4_K_M,
made by llama.cpp's own converter and quantizer from the same checkpoint) is
scored through llama.cpp on those ids, so every GPTQ variant stands against the
figures the issue's goal names: below Q4_0 on every genre, a mean at most 1.5x
Q4_K_M's. The GPTQ variants run the quantize stage's own code
(``quant.sequential.quantize_model``) in this process, one after the other, each
on a fresh copy of the model; fidelity does not depend on load, so the figures
hold whatever else the machine does (the times do not). A variant marked ``gguf``
is scored as llama.cpp runs it instead: its weights written as Q4_0 blocks
(``paths.gguf``, ``formats.gguf_file``), with llama.cpp's top-1 agreement with PyTorch on them.

What the PyTorch figures leave out: vLLM's W4A8 kernel quantizes activations to
int8 per token, which the quantize stage's engine check and the benchmark stage
measure; tinygemm's bf16 activations cost next to nothing.

Results go to benchmarks/results/calibration.json (one row per arm, merged with an
earlier run's rows of other names) and calibration.csv (``dvc plots show``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from .common import ROOT, host, today, write_csv, write_json


@dataclasses.dataclass(frozen=True)
class Variant:
    corpus: str = "mix"
    samples: int = 128
    length: int = 256
    damp: float = 0.05
    symmetric: bool = True
    """The grid: symmetric (``w4a8-gptq``'s) or asymmetric (``w4a16-tinygemm``'s)."""
    search: str = "output-error"
    signed: bool = False
    """The symmetric scale's sign searched too (``gptq.ScaleSearch.signed``; the product's
    output-error search since this row was measured)."""
    head: str = "int4"
    chat_fraction: float = 0.2
    group: int | None = None
    """None: the path's rule (64 on SmolLM2's 576-wide rows)."""
    gguf: bool = False
    """Written as a GGUF of Q4_0 blocks (``paths.gguf``, ``formats.gguf_file``, the embedding Q8_0) and
    scored through llama.cpp, like the control; needs the symmetric grid at group 32. Every
    decoder matrix is Q4_0 here: which ones the quantize stage keeps at Q8_0 was measured
    on top of this by benchmarks/gguf_mix.py."""
    shift: int = 0
    """GPTQ's groups moved this many input columns along each row (``_groups_shifted``),
    off the groups of 32 the default model's weights came quantized in."""
    bf16: tuple[str, ...] = ()
    """Linears of every layer left at bf16, GPTQ calibrating the rest on them (vLLM fuses
    the query, key and value projections into one layer, so they stay or go together)."""


# In the order they were measured: each changes one thing against an earlier row.
VARIANTS = {
    "austen-sym": Variant(corpus="austen", chat_fraction=0.25),
    "austen-minmax": Variant(corpus="austen", chat_fraction=0.25, symmetric=False, search="none"),
    "mix-sym": Variant(),
    "mix-minmax": Variant(symmetric=False, search="none"),
    "mix-minmax-search": Variant(symmetric=False),
    "mix-sym-bf16-head": Variant(head="bf16"),
    "mix-minmax-search-bf16-head": Variant(symmetric=False, head="bf16"),
    "mix-sym-256x256": Variant(samples=256),
    "mix-sym-damp0.01": Variant(damp=0.01),
    "mix-minmax-search-g32": Variant(symmetric=False, group=32),
    # the defaults since (params.yaml), per grid
    "mix-minmax-search-bf16-head-256x256-damp0.01": Variant(symmetric=False, head="bf16", samples=256, damp=0.01),
    "mix-sym-bf16-head-256x256-damp0.01": Variant(head="bf16", samples=256, damp=0.01),
    # the symmetric scale's sign searched too
    "mix-sym-signed-bf16-head-256x256-damp0.01": Variant(head="bf16", samples=256, damp=0.01, signed=True),
    "mix-sym-signed-bf16-head-512x256-damp0.01": Variant(head="bf16", samples=512, damp=0.01, signed=True),
    # group 32: the grid of the embedded model's source GGUF (Q4_1), see calibration.md
    "mix-sym-g32": Variant(group=32),
    # the defaults' GPTQ on llama.cpp's Q4_0 grid, in llama.cpp (issue 21)
    "mix-sym-g32-q4_0-gguf": Variant(head="bf16", samples=256, damp=0.01, signed=True, group=32, gguf=True),
    "mix-sym-signed-bf16-head-256x256-damp0.01-bf16-qkv": Variant(
        head="bf16", samples=256, damp=0.01, signed=True,
        bf16=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "mix-sym-signed-bf16-head-256x256-damp0.01-g32": Variant(head="bf16", samples=256, damp=0.01, signed=True,
                                                             group=32),
    "mix-sym-signed-bf16-head-256x256-damp0.01-g32-shift16": Variant(head="bf16", samples=256, damp=0.01,
                                                                     signed=True, group=32, shift=16),
}


class _Unshifted:
    """A layer quantized on shifted columns, read back in the model's column order."""

    def __init__(self, layer, order):
        self.layer, self.order = layer, order

    def dequantize(self):
        return self.layer.dequantize()[:, self.order]


@contextlib.contextmanager
def _groups_shifted(columns: int):
    """Every layer GPTQ quantizes meanwhile is quantized with its input columns rolled
    by ``columns`` (weights and Hessian alike), so each group of g straddles two of the
    source's groups, and is read back unrolled: the same grid and bits, other groups.
    The default model is converted from a Q4_1 GGUF, whose groups of 32 already hold at
    most 16 levels each; this separates that from what group 32 itself gains."""
    import torch

    from edgepath.quant import sequential

    real = sequential.quantize_layer

    def shifted(weight, hessian, *args, **kwargs):
        roll = (torch.arange(weight.shape[1]) + columns) % weight.shape[1]
        return _Unshifted(real(weight[:, roll], hessian[roll][:, roll], *args, **kwargs), torch.argsort(roll))

    sequential.quantize_layer = shifted
    try:
        yield
    finally:
        sequential.quantize_layer = real


def _perplexities(model, held_out) -> dict[str, float]:
    from edgepath.scoring.evaluate import perplexity

    return {genre: perplexity(model, windows) for genre, windows in held_out.items()}


def _scored_by_llama_cpp(path: Path, held_out, threads: int) -> dict:
    """Perplexity per genre of the GGUF at ``path`` in llama.cpp, its bits per weight as
    llama.cpp counts them, and its top-1 predictions (one list per window, genre after genre)."""
    from edgepath.engines.llama_cpp import LlamaCpp
    from edgepath.scoring import stats

    engine = LlamaCpp(path, threads=threads, n_ctx=1024)
    perplexity, top1 = {}, []
    for genre, windows in held_out.items():
        scored = engine.score(windows.tolist())
        perplexity[genre] = stats.perplexity(scored["nll"])
        top1 += scored["top1"]
    arm = {"perplexity": perplexity, "bits_per_weight": engine.info()["bits_per_weight"], "top1": top1}
    engine.close()
    return arm


def _llama_cpp(hf_dir: Path, held_out, work: Path, threads: int) -> dict[str, dict]:
    """Q4_0 and Q4_K_M made and scored by llama.cpp; their bits per weight as llama.cpp counts."""
    from edgepath.engines.llama_cpp import quantize_gguf
    from edgepath.formats.gguf_file import convert_to_gguf

    f16 = work / "model-f16.gguf"
    if not f16.is_file():
        convert_to_gguf(hf_dir, f16)
    arms = {}
    for ftype in ("F16", "Q4_0", "Q4_K_M"):
        path = f16 if ftype == "F16" else work / f"model-{ftype.lower()}.gguf"
        if not path.is_file():
            quantize_gguf(f16, path, ftype, threads)
        arms[f"llama.cpp {ftype}"] = _scored_by_llama_cpp(path, held_out, threads)
        print(f"calibration: llama.cpp {ftype} scored", file=sys.stderr, flush=True)
    return arms


def _as_gguf(model, hf: Path, held_out, work: Path, threads: int) -> dict:
    """``model``'s GPTQ weights (its embedding already rounded to Q8_0) written as a Q4_0
    GGUF and scored through llama.cpp, with llama.cpp's top-1 agreement with PyTorch on
    the same weights (the path's check)."""
    import shutil

    from edgepath.formats import gguf_file
    from edgepath.paths import gguf as gguf_path

    shutil.rmtree(work / "gptq-hf", ignore_errors=True)
    path = work / "gptq-q4_0.gguf"
    gguf_file.write(gguf_file.save_dequantized(model, hf, work / "gptq-hf"), path, gguf_path.TensorPolicy().type_of)
    arm = _scored_by_llama_cpp(path, held_out, threads)
    overall, _ = gguf_path.top1_agreement(arm.pop("top1"), model, {g: w.tolist() for g, w in held_out.items()})
    arm["top1_vs_pytorch"] = round(overall, 4)
    return arm


def _row(name: str, perplexity: dict[str, float], reference: dict[str, float], **extra) -> dict:
    increase = {g: round(100 * (perplexity[g] / reference[g] - 1), 2) for g in reference}
    worst = max(increase, key=increase.get)
    return {"arm": name, "mean_increase_pct": round(sum(increase.values()) / len(increase), 2),
            "worst_genre": worst, "worst_increase_pct": increase[worst],
            **{f"increase_pct_{g}": v for g, v in increase.items()},
            **{f"perplexity_{g}": round(v, 3) for g, v in perplexity.items()}, **extra}


def print_table(rows: list[dict], genres: list[str]) -> None:
    """``rows`` (``_row``'s) as a Markdown table on stdout."""
    print("\n| arm | bits/weight | " + " | ".join(genres) + " | mean | worst |")
    print("|---" * (len(genres) + 4) + "|")
    for r in rows:
        print(f"| {r['arm']} | {r.get('bits_per_weight', '')} | " +
              " | ".join(f"{r[f'increase_pct_{g}']:+.1f} %" for g in genres) +
              f" | {r['mean_increase_pct']:+.2f} % | {r['worst_genre']} {r['worst_increase_pct']:+.1f} % |")


def _save(results: Path, meta: dict, rows: list[dict]) -> list[dict]:
    """Merge ``rows`` into calibration.json (an earlier run's rows of other names stay)
    and calibration.csv, each replaced whole; returns the merged rows."""
    record = results / "calibration.json"
    earlier = json.loads(record.read_text())["rows"] if record.is_file() else []
    names = {r["arm"] for r in rows}
    rows = [*[r for r in earlier if r["arm"] not in names], *rows]
    write_json(record, {"meta": meta, "rows": rows})
    write_csv(results / "calibration.csv", rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "build" / "model" / "hf"), help="the bf16 Hugging Face directory")
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), help="variants to run (default: all)")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows per genre (the quantize stage's)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp control")
    parser.add_argument("--work", default=str(ROOT / "build" / "bench" / "calibration"))
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgepath.paths import gguf as gguf_path
    from edgepath.quant.gptq import grid
    from edgepath.quant.sequential import GptqPlan, quantize_model
    from edgepath.rules import shapes, weight_paths
    from edgepath.text import calibration

    torch.manual_seed(0)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    hf = Path(args.model)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, local_files_only=True).eval()
    mix = calibration.load_corpus("mix", [])
    held_out = calibration.held_out_genres(tokenizer, mix, args.windows, args.length)
    reference = _perplexities(base, held_out)
    print(f"calibration: reference {reference}", file=sys.stderr, flush=True)
    linears = {n.removesuffix(".weight"): s for n, s in
               shapes.block_linears({n: tuple(p.shape) for n, p in base.named_parameters()}).items()}

    meta = {"command": f"python -m {__spec__.name} " + " ".join(sys.argv[1:]),
            "date": today(), "host": host(),
            "windows_per_genre": args.windows, "length": args.length,
            "held_out": calibration.held_out_record(mix)}
    rows = [_row("bf16", reference, reference)]
    if not args.no_llama_cpp:
        for name, arm in _llama_cpp(hf, held_out, work, threads).items():
            rows.append(_row(name, arm["perplexity"], reference, bits_per_weight=round(arm["bits_per_weight"], 3)))
    for name in args.only or VARIANTS:
        v = VARIANTS[name]
        corpus = calibration.load_corpus(v.corpus, ["persuasion"] if v.corpus == "austen" else [])
        if calibration.held_out_record(corpus)["dropped"]:
            raise SystemExit(f"{name}: its corpus calibrates on a held-out document; the figures would not compare")
        calib = calibration.calibration_set(tokenizer, corpus, v.samples, v.length, v.chat_fraction, seed=0)
        path = weight_paths.get("w4a8-gptq" if v.symmetric else "w4a16-tinygemm")
        group = v.group or path.group_size({**linears, **({"lm_head": tuple(base.lm_head.weight.shape)}
                                                           if v.head == "int4" else {})})[0]
        model = copy.deepcopy(base)
        started = time.monotonic()
        search = grid(v.symmetric, v.search)
        if v.symmetric and search.objective != "none":
            search = dataclasses.replace(search, signed=v.signed)
        if v.gguf:
            assert v.symmetric and group == 32, f"{name}: Q4_0 is the symmetric grid at group 32"
            gguf_path.TensorPolicy().round_to_stored(model)  # the embedding as the file stores it
        kept = [f"model.layers.{i}.{n}" for i in range(len(model.model.layers)) for n in v.bf16]
        with _groups_shifted(v.shift) if v.shift else contextlib.nullcontext():
            quantized = quantize_model(model, calib.tokens, GptqPlan(group, search, v.damp, True,
                                                                     quantize_head=v.head == "int4", keep=kept))
        seconds = time.monotonic() - started
        if v.gguf:
            arm = _as_gguf(model, hf, held_out, work, threads)
            perplexity, measured = arm.pop("perplexity"), arm
        else:
            perplexity = _perplexities(model, held_out)
            sizes = {name: shape[0] * shape[1] for name, shape in linears.items() if name != "lm_head"}
            total, at_bf16 = sum(sizes.values()), sum(sizes[name] for name in kept)
            bits = (path.bits_per_weight(group) * (total - at_bf16) + 16 * at_bf16) / total
            measured = {"bits_per_weight": round(bits, 3)}
        rows.append(_row(name, perplexity, reference, **dataclasses.asdict(v), group_size=group,
                         **measured, gptq_s=round(seconds)))
        print(f"calibration: {name}: mean {rows[-1]['mean_increase_pct']:+.2f} %, worst {rows[-1]['worst_genre']} "
              f"{rows[-1]['worst_increase_pct']:+.2f} % ({seconds:.0f} s)", file=sys.stderr, flush=True)
        del model, quantized
        _save(Path(args.results), meta, rows)  # an interrupted run keeps the variants it finished

    print_table(_save(Path(args.results), meta, rows), list(reference))


if __name__ == "__main__":
    main()
