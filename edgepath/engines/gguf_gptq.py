"""A GGUF whose decoder weights are GPTQ's, in llama.cpp's Q4_0 blocks, and its check.

Lifecycle of ``write(quantized_hf, out, policy)``:

1. ``quantized_hf`` is a Hugging Face directory (``save_dequantized``) whose decoder
   linears hold GPTQ's dequantized weights in fp32, exactly on the symmetric grid at group 32
   (``quant.gptq``), but for those the policy stores as Q8_0, and whose other tensors are
   the model's own.
2. llama.cpp's own converter writes it as an F32 GGUF: the metadata, tokenizer,
   chat template, tensor names and the row orders llama.cpp wants (it permutes
   the query and key rows for its rotary layout) are the converter's, whatever
   the architecture; F32 carries every value unchanged.
3. Each tensor gets its type from ``TensorPolicy.type_of``: the per-tensor policy,
   kept apart from the numeric packing (``formats.gguf_q4_0_format``).
   - decoder matrices: Q4_0, recovered block by block from their values
     (``GgufQ4_0.from_values`` refuses a block off the grid, so the file holds
     GPTQ's codes and scales bit for bit); those the policy names, Q8_0
     (``DEFAULT_POLICY``: the attention's key and value projections);
   - the embedding table, which is also the tied output head: Q8_0 by default,
     what llama.cpp's own Q4_0 keeps it at on rows not a multiple of 256, where
     its Q6_K choice falls back to Q8_0;
   - Q8_0 tensors are quantized by gguf-py's reference quantizer, bit-identical
     to llama.cpp's;
   - norms and other vectors: F32, as llama.cpp keeps them.
4. The GGUF is written beside ``out`` and renamed onto it when complete.

``check`` is the path's check against the real engine: llama.cpp loads the file,
and its teacher-forced top-1 predictions (``agreement``) agree with PyTorch's on
the reference model (the GPTQ weights, and the other tensors rounded as the policy
stores them: ``TensorPolicy.round_to_stored``), on the same token ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.errors import EdgepathError
from ..formats.gguf_q4_0_format import BLOCK_BYTES, GgufQ4_0
from .llama_cpp import convert_to_gguf, converter_dir

# The agreement ``agreement`` must reach: llama.cpp rounds activations to 8 bits in its
# Q4_0 and Q8_0 dot products, PyTorch does not. Measured 0.95-0.98 per genre (GPTQ at
# group 32, Q8_0 embedding, SmolLM2-135M, 2 x 128 held-out tokens per genre, llama-cpp-
# python 0.3.36 on a Zen 4 host); a file with its nibbles swapped scores far below.
AGREEMENT_PASS = 0.90
FILE_NAME = "model.gguf"
EMBEDDING = "token_embd.weight"
EMBEDDING_TYPES = ("Q8_0", "F16", "F32")
# A Q8_0 block: 32 int8 codes and an fp16 scale, 34 bytes per 32 weights.
Q8_0_BITS = 8.5
REFERENCE_IS = ("the GPTQ weights the file holds, dequantized, in PyTorch fp32, with the tensors it stores above "
                "4 bits rounded as it stores them (the quantization report's tensor_policy)")
READ_BACK_IS = "the file's own tensors, dequantized by gguf-py, in PyTorch fp32 (gguf_gptq.read_back)"
# A decoder matrix's GGUF name (llama.cpp's, by layer) and its Hugging Face module in the layer.
MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
_DECODER_MATRIX = re.compile(rf"blk\.(\d+)\.({'|'.join(MATRICES)})\.weight")


def more_bits_layer(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (src/llama-quant.cpp): the first and last eighth of
    the layers and every third between, where its Q4_K_M gives attn_v and ffn_down 6
    bits or more (Q8_0 for attn_v on SmolLM2's 576-wide rows: layers 0-2, 5, 8, ..., 23, 26-29)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclasses.dataclass(frozen=True)
class TensorPolicy:
    """Which GGUF type each tensor gets (module docstring, step 3): the per-tensor
    policy, kept apart from the numeric packing."""

    embedding: str = "Q8_0"
    """The embedding table and tied head: llama.cpp's own choice for Q4_0 files on rows not
    a multiple of 256 (its Q6_K falls back to Q8_0)."""
    q8_0: tuple[str, ...] = ()
    """Decoder matrices (``MATRICES`` keys) stored as Q8_0 rather than GPTQ's Q4_0, in the
    layers ``q8_0_layers`` names: GPTQ leaves them alone and they are rounded to Q8_0."""
    q8_0_layers: str = "more-bits"
    """``more-bits``: llama.cpp's ``more_bits_layer``s; ``all``: every layer."""

    def __post_init__(self):
        if self.embedding not in EMBEDDING_TYPES:
            raise EdgepathError(f"embedding type {self.embedding!r}: one of {', '.join(EMBEDDING_TYPES)}")
        unknown = set(self.q8_0) - set(MATRICES)
        if unknown or self.q8_0_layers not in ("more-bits", "all"):
            raise EdgepathError(f"Q8_0 matrices {sorted(unknown)} in {self.q8_0_layers!r} layers: matrices are "
                                f"{', '.join(MATRICES)}; layers 'more-bits' or 'all'")

    def _at_q8_0(self, matrix: str, layer: int, layers: int) -> bool:
        return matrix in self.q8_0 and (self.q8_0_layers == "all" or more_bits_layer(layer, layers))

    def type_of(self, name: str, shape: Sequence[int], layers: int) -> str:
        """The GGUF type of tensor ``name`` in a file of ``layers`` decoder layers."""
        if matrix := _DECODER_MATRIX.fullmatch(name):
            return "Q8_0" if self._at_q8_0(matrix[2], int(matrix[1]), layers) else "Q4_0"
        if name == EMBEDDING:
            return self.embedding
        if len(shape) == 1:
            return "F32"
        raise EdgepathError(f"{name} {tuple(shape)}: no type policy for this tensor (an untied output head, "
                            f"or an architecture the Q4_0 path does not know)")

    def kept_from_gptq(self, layers: int) -> list[str]:
        """The Hugging Face prefixes (``model.layers.N.<module>``) of the matrices stored as
        Q8_0, which GPTQ leaves unquantized."""
        return [f"model.layers.{i}.{MATRICES[m]}" for i in range(layers) for m in MATRICES
                if self._at_q8_0(m, i, layers)]

    def round_to_stored(self, model):
        """``model`` (PyTorch) with its embedding table (so its tied head) and its Q8_0
        matrices rounded as ``write`` stores them; done before GPTQ, so that GPTQ
        calibrates on them and the result is what the GGUF must reproduce."""
        import torch

        rounded = [(model.get_input_embeddings().weight, self.embedding)]
        rounded += [(model.get_submodule(p).weight, "Q8_0") for p in self.kept_from_gptq(model.config.num_hidden_layers)]
        with torch.no_grad():
            for weight, kind in rounded:
                weight.copy_(torch.from_numpy(_rounded(weight.detach().float().numpy(), kind)))
        return model


# The key and value projections at Q8_0 in every layer. On SmolLM2-135M (3 KV heads of 64
# on 576-wide rows) they are 6 % of the decoder's weights; screened on one GPTQ build
# (benchmarks/gguf_mix.py, 8 x 512 held-out tokens per genre, Zen 4 host) they took the mean
# perplexity increase over bf16 from +6.96 % to +3.96 % for 0.20 more bits per weight (5.55,
# against Q4_K_M's 6.17 at +5.83 %), below Q4_K_M on every genre, where Q4_K_M's own choice
# (attn_v and ffn_down in its more-bits layers) reached +5.06 % at 5.76.
DEFAULT_POLICY = TensorPolicy(q8_0=("attn_k", "attn_v"), q8_0_layers="all")
DEFAULT_POLICY_REASON = ("attn_k and attn_v at Q8_0 in every layer: 6 % of SmolLM2-135M's decoder weights, they "
                         "took the held-out perplexity increase from +6.96 % to +3.96 % for 0.20 more bits per "
                         "weight, below llama.cpp Q4_K_M on every genre (benchmarks/gguf_mix.py)")


def _rounded(weight, kind: str):
    """``weight`` (a float32 array) as the GGUF holds it after type ``kind``."""
    import numpy as np

    if kind == "F32":
        return weight
    if kind == "F16":
        return weight.astype(np.float16).astype(np.float32)
    gguf = gguf_module()
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)


def gguf_module():
    """llama.cpp's ``gguf-py``, from the same sdist as the engine (``converter_dir``)."""
    path = str(converter_dir() / "gguf-py")
    if not Path(path).is_dir():
        raise EdgepathError(f"{path}: llama.cpp's gguf-py is missing; run scripts/setup.sh")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    return gguf


def save_dequantized(model, source_hf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``model`` (PyTorch, fp32, its decoder linears on GPTQ's grid) as the Hugging Face
    directory ``write`` starts from, with ``source_hf``'s tokenizer, chat template and
    generation settings; returns ``out``."""
    import shutil

    from ..formats.hf_model import TOKENIZER_FILES

    out = Path(out)
    model.save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(source_hf) / name).is_file():
            shutil.copy(Path(source_hf) / name, out / name)
    return out


def write(quantized_hf: str | os.PathLike, out: str | os.PathLike,
          policy: TensorPolicy = DEFAULT_POLICY) -> dict[str, Any]:
    """Write the GGUF (module docstring) to ``out``; returns ``{type: tensor count}``."""
    import numpy as np

    gguf = gguf_module()
    out = Path(out)
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as scratch:
        f32 = Path(scratch) / "model-f32.gguf"
        convert_to_gguf(quantized_hf, f32, "f32")
        reader = gguf.GGUFReader(f32)
        partial = Path(scratch) / out.name
        arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        layers = reader.fields[gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)].contents()
        writer = gguf.GGUFWriter(partial, arch=arch)
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
            kind = policy.type_of(tensor.name, values.shape, layers)
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
    from ..scoring.agreement import all_windows

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
    of ``scoring.agreement.all_windows(sequences)``, in that order) against ``reference``'s."""
    import torch

    from ..scoring.agreement import agreement as share_agreeing
    from ..scoring.agreement import agreement_by_genre

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

    from ..core import records
    from ..core.files import sha256_file
    from ..scoring.agreement import all_windows, comparison

    gguf = Path(gguf)
    with _loaded(gguf, sequences, threads) as engine:
        info = engine.info()
        overall, by_genre = top1_agreement(engine.score(all_windows(sequences))["top1"], reference, sequences)
    types: dict[str, int] = {}
    for tensor in gguf_module().GGUFReader(gguf).tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return {
        **records.envelope("gguf_check"),
        "engine": records.tool("llama-cpp-python"),
        "file": {"name": gguf.name, "size": gguf.stat().st_size, "sha256": sha256_file(gguf),
                 "bits_per_weight": info["bits_per_weight"], "parameters": info["parameters"],
                 "tensor_types": dict(sorted(types.items())), "desc": info["desc"]},
        "reference": reference_is,
        "held_out": {"windows_per_genre": {g: len(ws) for g, ws in sequences.items()},
                     "length": max(len(w) for ws in sequences.values() for w in ws)},
        "teacher_forced_positions": sum(len(w) - 1 for ws in sequences.values() for w in ws),
        "against": {"reference": comparison(overall, by_genre)},
        "threshold": {"teacher_forced_top1_vs_reference": AGREEMENT_PASS},
        "passed": overall >= AGREEMENT_PASS,
    }
