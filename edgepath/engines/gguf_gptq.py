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

``check`` is the path's check against the real engine: llama.cpp loads the file,
and its teacher-forced top-1 predictions (``agreement``) agree with PyTorch's on
the reference model (``reference_model``: the GPTQ weights and the embedding as the
policy rounds it), on the same token ids.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import EdgepathError
from ..gptq.gguf_q4_0_format import BLOCK_BYTES, GgufQ4_0
from .llama_cpp import convert_to_gguf, converter_dir

# The agreement ``agreement`` must reach: llama.cpp rounds activations to 8 bits in its
# Q4_0 and Q8_0 dot products, PyTorch does not. Measured 0.95-0.98 per genre (GPTQ at
# group 32, Q8_0 embedding, SmolLM2-135M, 2 x 128 held-out tokens per genre, llama-cpp-
# python 0.3.36 on a Zen 4 host); a file with its nibbles swapped scores far below.
AGREEMENT_PASS = 0.90
FILE_NAME = "model.gguf"
EMBEDDING = "token_embd.weight"
EMBEDDING_TYPES = ("Q8_0", "F16", "F32")
EMBEDDING_TYPE = "Q8_0"
"""The quantize stage's choice for the embedding table and tied head: llama.cpp's own
for Q4_0 files on rows not a multiple of 256 (its Q6_K choice falls back to Q8_0)."""
READ_BACK_IS = "the file's own tensors, dequantized by gguf-py, in PyTorch fp32 (gguf_gptq.read_back)"
REFERENCE_IS = ("the GPTQ weights the file holds, dequantized, in PyTorch fp32, with the embedding and tied "
                f"head rounded as the file stores them ({EMBEDDING_TYPE})")
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


def write(quantized_hf: str | os.PathLike, out: str | os.PathLike,
          embedding_type: str = EMBEDDING_TYPE) -> dict[str, Any]:
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


def read_back(gguf: str | os.PathLike, model_dir: str | os.PathLike):
    """The model of ``model_dir`` (PyTorch, fp32) with every tensor replaced by the
    GGUF's, dequantized by gguf-py, the query and key rows put back in Hugging Face's
    order: the weights the file holds, as the reference the patch-verify stage runs
    llama.cpp against. Llama-architecture files only (their converter's permutation
    is undone here); a tensor of the model the file lacks is refused."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    gguf_py = gguf_module()
    reader = gguf_py.GGUFReader(gguf)
    arch = reader.fields[gguf_py.Keys.General.ARCHITECTURE].contents()
    if arch != "llama":
        raise EdgepathError(f"{gguf}: a {arch} GGUF; reading one back knows the llama architecture only")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    config = model.config
    names = gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    stored = {t.name: t for t in reader.tensors}
    with torch.no_grad():
        for name, param in model.named_parameters():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            tensor = stored.get(gguf_name) if gguf_name else None
            if tensor is None:
                raise EdgepathError(f"{gguf}: no tensor for {name} (expected {gguf_name})")
            kind = tensor.tensor_type
            values = (np.asarray(tensor.data, dtype=np.float32) if kind.name in ("F32", "F16")
                      else gguf_py.quants.dequantize(tensor.data, kind))
            values = values.reshape(param.shape)
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
            head_count = next((n for proj, n in heads.items() if f".{proj}." in name), None)
            if head_count:  # the converter's rotary permutation: [heads, 2, d/2] -> [heads, d/2, 2]
                values = values.reshape(head_count, values.shape[0] // head_count // 2, 2, -1) \
                    .swapaxes(1, 2).reshape(param.shape)
            param.copy_(torch.tensor(values))
    return model


def swap_nibbles(gguf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A copy of ``gguf`` at ``out`` with the two nibbles of every Q4_0 byte swapped: the
    packing mistake (``c[j]`` and ``c[j + 16]`` exchanged) a check must catch."""
    import shutil

    out = Path(shutil.copy(gguf, out))
    gguf_py = gguf_module()
    reader = gguf_py.GGUFReader(out, "r+")
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf_py.GGMLQuantizationType.Q4_0:
            qs = tensor.data.reshape(-1, BLOCK_BYTES)[:, 2:]
            qs[:] = (qs >> 4) | (qs << 4)
    reader.data.flush()
    del reader
    return out


def agreement(gguf: str | os.PathLike, reference, sequences: dict[str, list[list[int]]],
              threads: int) -> tuple[float, dict[str, float]]:
    """(over every position, per genre) the share of positions where llama.cpp's top-1
    on ``gguf`` equals PyTorch's on ``reference``, teacher-forced over ``sequences``
    (genre -> windows of token ids, each genre's of one length)."""
    from ..engine_check import all_windows

    with _loaded(gguf, sequences, threads) as engine:
        return top1_agreement(engine.score(all_windows(sequences))["top1"], reference, sequences)


@contextlib.contextmanager
def _loaded(gguf: str | os.PathLike, sequences: dict[str, list[list[int]]], threads: int):
    from .llama_cpp import LlamaCpp

    engine = LlamaCpp(gguf, threads=threads, n_ctx=max(64, max(len(w) for ws in sequences.values() for w in ws)))
    try:
        yield engine
    finally:
        engine.close()


def top1_agreement(engine_top1: list[list[int]], reference,
                   sequences: dict[str, list[list[int]]]) -> tuple[float, dict[str, float]]:
    """``agreement``'s figures from llama.cpp's top-1 already scored (one list per window
    of ``engine_check.all_windows(sequences)``, in that order) against ``reference``'s."""
    import torch

    from ..engine_check import agreement as share_agreeing, agreement_by_genre

    with torch.no_grad():
        torch_top1 = [row for ws in sequences.values()
                      for row in reference(torch.tensor(ws)).logits[:, :-1].argmax(dim=-1).tolist()]
    return share_agreeing(engine_top1, torch_top1), agreement_by_genre(engine_top1, torch_top1, sequences)


def check(gguf: str | os.PathLike, reference, reference_is: str, sequences: dict[str, list[list[int]]],
          threads: int) -> dict[str, Any]:
    """The GGUF check record (``gguf_check.schema.json``): the file as llama.cpp loads it
    (size, sha256, bits per weight as llama.cpp counts them, tensor types) and its
    ``agreement`` with ``reference`` (described by ``reference_is``), passed at
    ``AGREEMENT_PASS``."""
    import importlib.metadata

    from .. import records
    from ..hf_model import sha256_file

    from ..engine_check import all_windows

    gguf = Path(gguf)
    with _loaded(gguf, sequences, threads) as engine:
        info = engine.info()
        overall, by_genre = top1_agreement(engine.score(all_windows(sequences))["top1"], reference, sequences)
    types: dict[str, int] = {}
    for tensor in gguf_module().GGUFReader(gguf).tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return {
        **records.envelope("gguf_check"),
        "engine": f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}",
        "file": {"name": gguf.name, "size": gguf.stat().st_size, "sha256": sha256_file(gguf),
                 "bits_per_weight": info["bits_per_weight"], "parameters": info["parameters"],
                 "tensor_types": dict(sorted(types.items())), "desc": info["desc"]},
        "reference": reference_is,
        "held_out": {"windows_per_genre": {g: len(ws) for g, ws in sequences.items()},
                     "length": max(len(w) for ws in sequences.values() for w in ws)},
        "teacher_forced_positions": sum(len(w) - 1 for ws in sequences.values() for w in ws),
        "against": {"reference": {"teacher_forced_top1_agreement": round(overall, 4),
                                  "teacher_forced_top1_by_genre": by_genre}},
        "threshold": {"teacher_forced_top1_vs_reference": AGREEMENT_PASS},
        "passed": overall >= AGREEMENT_PASS,
    }
