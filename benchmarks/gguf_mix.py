"""Benchmark: which decoder matrices a GPTQ Q4_0 GGUF should keep at Q8_0, per held-out genre.

    .venv/bin/python -m benchmarks.gguf_mix --gguf build/weights/q4_0-gguf/model.gguf \\
        --control build/control                              # ~20 min on 2 cores

A screen, not a build: one GPTQ run's weights (the q4_0-gguf build at ``--gguf``,
read back by ``gguf_file.read_back``) with each candidate's matrices swapped back
to the model's own weights and written through ``gguf_file.write`` with that
candidate's ``TensorPolicy`` (those matrices rounded to Q8_0), then scored by
llama.cpp on ``calibration.held_out_genres``' windows beside the control's Q4_0 and
Q4_K_M (``--control``: the control stage's directory), each against the bf16
model's perplexity in PyTorch fp32 on the same token ids. The quantize stage runs
GPTQ with the chosen matrices rounded first, so its own figures differ a little
(the benchmark stage measures them). Bits per weight are llama.cpp's count.

Results go to benchmarks/results/gguf_mix.json and are printed as a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

from .common import ROOT, host, today

# name -> (matrices at Q8_0, in which layers); "q4_0" is the build as written.
CANDIDATES = {
    "q4_0": ((), "all"),
    "q4_k_m-layers v+down": (("attn_v", "ffn_down"), "more-bits"),
    "all v": (("attn_v",), "all"),
    "all k": (("attn_k",), "all"),
    "all v+k": (("attn_v", "attn_k"), "all"),
    "all down": (("ffn_down",), "all"),
    "all q+k+v+o": (("attn_q", "attn_k", "attn_v", "attn_output"), "all"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="a q4_0-gguf build's model.gguf")
    parser.add_argument("--control", required=True, help="the control stage's directory (its Q4_0 and Q4_K_M)")
    parser.add_argument("--model", default=str(ROOT / "build" / "model" / "hf"), help="the bf16 Hugging Face directory")
    parser.add_argument("--only", nargs="+", choices=sorted(CANDIDATES), help="candidates to run (default: all)")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows per genre")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    import torch
    from calibration import _row, _scored_by_llama_cpp, print_table
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgepath.formats import gguf_file
    from edgepath.paths import gguf as gguf_path
    from edgepath.scoring.evaluate import perplexity
    from edgepath.text import calibration

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    hf = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    held_out = calibration.held_out_genres(tokenizer, calibration.load_corpus("mix", []), args.windows, args.length)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, local_files_only=True).eval()
    reference = {genre: perplexity(base, windows) for genre, windows in held_out.items()}
    gptq = gguf_file.read_back(args.gguf, hf)
    rows = [_row("bf16", reference, reference)]
    for ftype in ("q4_0", "q4_k_m"):
        arm = _scored_by_llama_cpp(Path(args.control) / f"model-{ftype}.gguf", held_out, threads)
        rows.append(_row(f"llama.cpp {ftype.upper()}", arm["perplexity"], reference,
                         bits_per_weight=round(arm["bits_per_weight"], 3)))
    for i, name in enumerate(args.only or CANDIDATES):
        matrices, layers = CANDIDATES[name]
        policy = gguf_path.TensorPolicy(q8_0=matrices, q8_0_layers=layers)
        model = copy.deepcopy(gptq)
        with torch.no_grad():
            for prefix in policy.kept_from_gptq(model.config.num_hidden_layers):
                model.get_submodule(prefix).weight.copy_(base.get_submodule(prefix).weight)
        with tempfile.TemporaryDirectory(prefix="gguf-mix-") as work:
            path = Path(work) / "mix.gguf"
            counts = gguf_file.write(gguf_file.save_dequantized(model, hf, Path(work) / "hf"), path, policy.type_of)
            arm = _scored_by_llama_cpp(path, held_out, threads)
        rows.append(_row(f"gptq {name}", arm["perplexity"], reference, bits_per_weight=round(arm["bits_per_weight"], 3),
                         q8_0=list(matrices), q8_0_layers=layers, tensor_types=counts))
        print(f"gguf_mix: {name} ({i + 1}/{len(args.only or CANDIDATES)}): {rows[-1]['bits_per_weight']} bits/weight, "
              f"mean {rows[-1]['mean_increase_pct']:+.2f} %", file=sys.stderr, flush=True)
        del model

    meta = {"command": f"python -m {__spec__.name} " + " ".join(sys.argv[1:]),
            "date": today(), "host": host(), "gguf": str(args.gguf),
            "windows_per_genre": args.windows, "length": args.length}
    results = Path(args.results)
    with tempfile.NamedTemporaryFile("w", dir=results, delete=False, suffix=".tmp") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    os.replace(f.name, results / "gguf_mix.json")
    print_table(rows, list(reference))


if __name__ == "__main__":
    main()
