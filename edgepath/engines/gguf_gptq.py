"""A GGUF whose decoder weights are GPTQ's, in llama.cpp's Q4_0 blocks, and its check.

Lifecycle of ``write(quantized_hf, out, embedding_type)``:

1. ``quantized_hf`` is a Hugging Face directory (``save_dequantized``) whose decoder
   linears hold GPTQ's dequantized weights in fp32, exactly on the symmetric grid at group 32
   (``gptq.gptq``), and whose other tensors are the model's own.
2. llama.cpp's own converter writes it as an F32 GGUF: the metadata, tokenizer,
   chat template, tensor names and the row orders llama.cpp wants (it permutes
   the query and key rows for its rotary layout) are the converter's, whatever
   the architecture; F32 carries every value unchanged.
3. Each tensor gets its type by ``tensor_type``: the per-tensor policy, kept
   apart from the numeric packing (``gptq.gguf_q4_0_format``).
   - decoder matrices: Q4_0, recovered block by block from their values
     (``GgufQ4_0.from_values`` refuses a block off the grid, so the file holds
     GPTQ's codes and scales bit for bit);
   - the embedding table, which is also the tied output head: ``embedding_type``
     (Q8_0 by default: what llama.cpp's own Q4_0 keeps it at on rows not a
     multiple of 256, where its Q6_K choice falls back to Q8_0), quantized by
     gguf-py's reference quantizer, bit-identical to llama.cpp's;
   - norms and other vectors: F32, as llama.cpp keeps them.
4. The GGUF is written beside ``out`` and renamed onto it when complete.

``agreement`` is the path's check against the real engine: llama.cpp's teacher-
forced top-1 predictions on the file against PyTorch's on the reference model
(``reference_model``: the GPTQ weights and the embedding as the policy rounds it),
on the same token ids.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import EdgepathError
from ..gptq.gguf_q4_0_format import GgufQ4_0
from .llama_cpp import convert_to_gguf, converter_dir

# The agreement ``agreement`` must reach: llama.cpp rounds activations to 8 bits in its
# Q4_0 and Q8_0 dot products, PyTorch does not. Measured 0.95-0.98 per genre (GPTQ at
# group 32, Q8_0 embedding, SmolLM2-135M, 2 x 128 held-out tokens per genre, llama-cpp-
# python 0.3.36 on a Zen 4 host); a file with its nibbles swapped scores far below.
AGREEMENT_PASS = 0.90
EMBEDDING = "token_embd.weight"
EMBEDDING_TYPES = ("Q8_0", "F16", "F32")
_DECODER_MATRIX = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")


def gguf_module():
    """llama.cpp's ``gguf-py``, from the same sdist as the engine (``converter_dir``)."""
    path = str(converter_dir() / "gguf-py")
    if not Path(path).is_dir():
        raise EdgepathError(f"{path}: llama.cpp's gguf-py is missing; run scripts/setup.sh")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    return gguf


def tensor_type(name: str, shape: Sequence[int], embedding_type: str) -> str:
    """The GGUF type of tensor ``name`` (module docstring, step 3)."""
    if _DECODER_MATRIX.fullmatch(name):
        return "Q4_0"
    if name == EMBEDDING:
        return embedding_type
    if len(shape) == 1:
        return "F32"
    raise EdgepathError(f"{name} {tuple(shape)}: no type policy for this tensor (an untied output head, "
                        f"or an architecture the Q4_0 path does not know)")


def round_embedding(weight, embedding_type: str):
    """``weight`` (a float32 array) as the GGUF will hold it after ``embedding_type``."""
    import numpy as np

    if embedding_type == "F32":
        return weight
    if embedding_type == "F16":
        return weight.astype(np.float16).astype(np.float32)
    gguf = gguf_module()
    qtype = gguf.GGMLQuantizationType[embedding_type]
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)


def save_dequantized(model, source_hf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``model`` (PyTorch, fp32, its decoder linears on GPTQ's grid) as the Hugging Face
    directory ``write`` starts from, with ``source_hf``'s tokenizer, chat template and
    generation settings; returns ``out``."""
    import shutil

    from ..hf_model import TOKENIZER_FILES

    out = Path(out)
    model.save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(source_hf) / name).is_file():
            shutil.copy(Path(source_hf) / name, out / name)
    return out


def write(quantized_hf: str | os.PathLike, out: str | os.PathLike, embedding_type: str = "Q8_0") -> dict[str, Any]:
    """Write the GGUF (module docstring) to ``out``; returns ``{type: tensor count}``."""
    import numpy as np

    if embedding_type not in EMBEDDING_TYPES:
        raise EdgepathError(f"embedding type {embedding_type!r}: one of {', '.join(EMBEDDING_TYPES)}")
    gguf = gguf_module()
    out = Path(out)
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as scratch:
        f32 = Path(scratch) / "model-f32.gguf"
        convert_to_gguf(quantized_hf, f32, "f32")
        reader = gguf.GGUFReader(f32)
        partial = Path(scratch) / out.name
        writer = gguf.GGUFWriter(partial, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
        for field in reader.fields.values():
            if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) \
                    or field.name.startswith("GGUF."):
                continue
            kind = field.types[0]
            writer.add_key_value(field.name, field.contents(), kind,
                                 sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        for tensor in reader.tensors:
            values = np.asarray(tensor.data, dtype=np.float32)
            kind = tensor_type(tensor.name, values.shape, embedding_type)
            try:
                if kind == "Q4_0":
                    data = GgufQ4_0.from_values(values).blocks
                elif kind in ("F32", "F16"):
                    data = values.astype(np.float32 if kind == "F32" else np.float16)
                else:
                    data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
            except ValueError as e:
                raise EdgepathError(f"{tensor.name}: {e}") from None
            raw = gguf.GGMLQuantizationType[kind] if kind not in ("F32", "F16") else None
            writer.add_tensor(tensor.name, data, raw_dtype=raw)
            counts[kind] = counts.get(kind, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    return counts


def reference_model(model, embedding_type: str):
    """``model`` (PyTorch, its decoder linears on GPTQ's grid) with its embedding table,
    and so its tied head, rounded as ``write`` stores it: what the GGUF must reproduce."""
    import torch

    embedding = model.get_input_embeddings().weight
    rounded = round_embedding(embedding.detach().float().numpy(), embedding_type)
    with torch.no_grad():
        embedding.copy_(torch.from_numpy(rounded))
    return model


def agreement(gguf: str | os.PathLike, reference, windows, threads: int) -> float:
    """Share of positions where llama.cpp's top-1 on ``gguf`` equals PyTorch's on
    ``reference``, teacher-forced over ``windows`` (a [W, T] tensor of token ids)."""
    import torch

    from .llama_cpp import LlamaCpp

    engine = LlamaCpp(gguf, threads=threads, n_ctx=max(64, windows.shape[1]))
    try:
        engine_top1 = engine.score(windows.tolist())["top1"]
    finally:
        engine.close()
    with torch.no_grad():
        torch_top1 = reference(windows).logits[:, :-1].argmax(dim=-1)
    same = sum(int((torch_top1[i] == torch.tensor(row)).sum()) for i, row in enumerate(engine_top1))
    return same / torch_top1.numel()
