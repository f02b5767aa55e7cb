"""Benchmark input: the bandwidth-bound shape, a Llama with Llama-3.2-1B's shapes and
random weights, and its builds made the cheap way.

    .venv/bin/python -m benchmarks.shape_1b --out /tmp/shape-1b                      # ~10 min on 2 cores
    .venv/bin/python -m benchmarks.serving --weights /tmp/shape-1b/weights --model /tmp/shape-1b/hf \\
        --control /tmp/shape-1b/control --out benchmarks/results/serving_1b.json     # the measurement

At SmolLM2-135M's size a decode step reads ~100 MB and vLLM's fixed per-step cost
decides; at 1B a step reads ~0.7-2.5 GB, as on the devices vLLM is run for. The
weights are random (normal, std 0.02, seeded): speed does not depend on their
values, and fidelity is meaningless on them and not measured. Written under ``--out``:

- ``hf/``: the bf16 Hugging Face checkpoint (hidden 2048, 16 layers, 32 query and 8
  KV heads, FFN 8192, vocabulary 128256, tied embeddings), with SmolLM2's tokenizer
  (its 49152 ids are a subset of the vocabulary: the prompts are real text).
- ``weights/w4a16-tinygemm``, ``weights/w4a8-gptq``: each vLLM 4-bit format at the
  group its kernel takes for these shapes, rounded to nearest on the path's grid
  (the quantize stage's GPTQ would take ~1 h here and changes no byte count), the
  output head in 4 bits too (``quantize.head: int4``: untied, the bf16 table kept
  for lookups) so a step reads 4-bit weights only. W4A8 keeps no bf16 down
  projection (the stage's ranking needs a model whose outputs mean something).
- ``control/``: llama.cpp's own F16 conversion and its Q4_K_M and Q4_0, made by
  llama.cpp's tools (``control``'s file names). The ``q4_0-gguf`` build is not
  made: it is Q4_0 blocks too, in a file llama.cpp's quantizer also writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from edgepath.core.command import progress

from .common import ROOT

CONFIG = {  # Llama-3.2-1B's shapes (its config.json), random weights
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
}
VLLM_PATHS = ("w4a16-tinygemm", "w4a8-gptq")


def random_model(out: Path, tokenizer_from: Path) -> None:
    """``out``: the bf16 checkpoint (module docstring), seeded."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).state_dict().items()}
    tensors = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s) * 0.02).to(torch.bfloat16)
               for n, s in shapes.items() if n != "lm_head.weight"}  # tied: the head is the table
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, out / name)


def rounded_to_nearest(weight, group: int, symmetric: bool):
    """``weight`` [N, K] on the path's grid, each group's scale (and offset) from its own
    range, codes rounded to nearest: a ``gptq.QuantizedLayer``."""
    import torch

    from edgepath.quant.gptq import QuantizedLayer, grid, quantize_codes

    w = weight.to(torch.float32)
    chosen = grid(symmetric, "none")
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.int32)
    scales = torch.empty(n, k // group)
    offsets = None if symmetric else torch.empty(n, k // group)
    for g in range(k // group):
        block = w[:, g * group:(g + 1) * group]
        s, o, _ = chosen.choose(block, None)  # one ratio: no search, no Hessian
        scales[:, g] = s
        if offsets is not None:
            offsets[:, g] = o
        codes[:, g * group:(g + 1) * group] = quantize_codes(block, s, o).to(torch.int32)
    return QuantizedLayer(codes=codes, scales=scales, group_size=group, ratios=torch.ones(n, k // group),
                          offsets=offsets)


def vllm_build(hf: Path, path: str, out: Path) -> None:
    """``out``: ``hf``'s decoder linears and head in ``path``'s checkpoint format."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from edgepath.formats.checkpoint import layer_format
    from edgepath.rules import shapes, weight_paths
    from edgepath.rules.weight_paths import Grid
    from edgepath.paths.vllm_checkpoint import quantization_config

    spec = weight_paths.get(path)
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    linears = {n.removesuffix(".weight"): tuple(s) for n, s in
               shapes.block_linears({n: list(t.shape) for n, t in tensors.items()}).items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # untied below: the head in 4 bits
    linears["lm_head"] = tuple(tensors["lm_head.weight"].shape)
    group, _ = spec.group_size(linears)
    fmt = layer_format(spec.checkpoint_format)
    symmetric = spec.grid is Grid.SYMMETRIC
    started = time.monotonic()
    for i, prefix in enumerate(sorted(linears)):
        q = rounded_to_nearest(tensors.pop(f"{prefix}.weight"), group, symmetric)
        fields = (q.codes, q.scales) if symmetric else (q.codes, q.scales, q.offsets)
        tensors.update(fmt.pack(*fields).tensors(prefix))
        if i % 16 == 0:
            progress("shape_1b", f"{path}: {i + 1}/{len(linears)} linears, {time.monotonic() - started:.0f} s")
    config = json.loads((hf / "config.json").read_text())
    config["tie_word_embeddings"] = False
    # round to nearest: no GPTQ, so no calibration inputs of any kind
    config["quantization_config"] = quantization_config(spec, group, head="int4", damp=0.0, true_sequential=False)
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(scratch / "model.safetensors"),
              metadata={"format": "pt"})
    (scratch / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (hf / name).is_file():
            shutil.copy2(hf / name, scratch / name)
    scratch.rename(out)


def control(hf: Path, out: Path) -> None:
    """``out``: llama.cpp's F16 conversion and its Q4_K_M and Q4_0, by its own tools."""
    from edgepath.engines import llama_cpp
    from edgepath.formats import gguf_file

    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    gguf_file.convert_to_gguf(hf, scratch / "model-f16.gguf")
    for ftype, name in (("Q4_K_M", "model-q4_k_m.gguf"), ("Q4_0", "model-q4_0.gguf")):
        progress("shape_1b", f"llama.cpp {ftype}")
        llama_cpp.quantize_gguf(scratch / "model-f16.gguf", scratch / name, ftype, threads=os.cpu_count() or 1)
    (scratch / "model-f16.gguf").unlink()  # 2.5 GB, not measured
    scratch.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "build" / "model" / "hf",
                        help="a Hugging Face directory whose tokenizer the model gets (default: the model stage's)")
    args = parser.parse_args()
    hf = args.out / "hf"
    if not (hf / "config.json").is_file():
        progress("shape_1b", "random bf16 checkpoint")
        random_model(hf, args.tokenizer)
    for path in VLLM_PATHS:
        if not (args.out / "weights" / path).is_dir():
            vllm_build(hf, path, args.out / "weights" / path)
    if not (args.out / "control").is_dir():
        control(hf, args.out / "control")
    progress("shape_1b", f"done: {args.out}")


if __name__ == "__main__":
    main()
