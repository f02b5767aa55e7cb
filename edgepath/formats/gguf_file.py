"""GGUF files: llama.cpp's converter and its gguf-py, and the writer of a GGUF whose
tensors each get a type from a per-tensor policy.

``converter_dir``: set-up copies llama.cpp's ``convert_hf_to_gguf.py``, with its
``conversion`` package and ``gguf-py``, out of the same sdist the bindings were
built from, so the converter, the reader and the engine are one llama.cpp version.

Lifecycle of ``write(quantized_hf, out, type_of)``:

1. ``quantized_hf`` is a Hugging Face directory (``save_dequantized``) whose decoder
   linears hold GPTQ's dequantized weights in fp32, exactly on the symmetric grid at
   group 32 (``quant.gptq``), but for those the policy stores above 4 bits, and whose
   other tensors are the model's own.
2. llama.cpp's own converter writes it as an F32 GGUF: the metadata, tokenizer,
   chat template, tensor names and the row orders llama.cpp wants (it permutes
   the query and key rows for its rotary layout) are the converter's, whatever
   the architecture; F32 carries every value unchanged.
3. Each tensor gets its type from ``type_of(name, shape, layers)`` (the path's
   per-tensor policy, ``paths.gguf.TensorPolicy``, kept apart from the packing):
   Q4_0 blocks are recovered from their values (``GgufQ4_0.from_values`` refuses a
   block off the grid, so the file holds GPTQ's codes and scales bit for bit); Q8_0
   tensors are quantized by gguf-py's reference quantizer, bit-identical to
   llama.cpp's; F32 and F16 are stored as they are.
4. The GGUF is written beside ``out`` and renamed onto it when complete.

``read_back`` is the independent reader (gguf-py's dequantizers, the converter's
row permutation undone) and ``swap_nibbles`` the packing mistake a check of a file
must catch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..core.errors import EdgepathError
from .gguf_q4_0_format import BLOCK_BYTES, GgufQ4_0

TypeOf = Callable[[str, Sequence[int], int], str]
"""A per-tensor policy: the GGUF type of tensor ``name`` of ``shape`` in a file of ``layers`` decoder layers."""

# The architectures ``read_back`` knows, by GGUF name: whether llama.cpp's converter
# permutes their query and key rows. Llama's rotary embedding rotates interleaved pairs
# in llama.cpp, so the converter reorders Hugging Face's half-split rows; Qwen2's runs
# llama.cpp's NEOX rotation, which is Hugging Face's own order, and keeps them.
PERMUTES_QUERY_KEY = {"llama": True, "qwen2": False}


def converter_dir() -> Path:
    """Where set-up put llama.cpp's converter (``.venv/share/edgepath/llama.cpp``)."""
    return Path(sys.prefix) / "share" / "edgepath" / "llama.cpp"


def convert_to_gguf(hf_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16") -> None:
    """Write ``hf_dir`` (safetensors; its tokenizer included) as a GGUF at ``out``, its
    tensors in ``outtype`` (the converter's ``--outtype``: ``f16``, ``f32``)."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise EdgepathError(f"{script}: llama.cpp's converter is missing; run scripts/setup.sh")
    done = subprocess.run([sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise EdgepathError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {done.returncode}):\n"
                            f"{done.stderr[-3000:]}")


def gguf_module():
    """llama.cpp's ``gguf-py``, from the same sdist as the engine (``converter_dir``)."""
    path = str(converter_dir() / "gguf-py")
    if not Path(path).is_dir():
        raise EdgepathError(f"{path}: llama.cpp's gguf-py is missing; run scripts/setup.sh")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf

    return gguf


def rounded(weight, kind: str):
    """``weight`` (a float32 array) as the GGUF holds it after type ``kind``."""
    import numpy as np

    if kind == "F32":
        return weight
    if kind == "F16":
        return weight.astype(np.float16).astype(np.float32)
    gguf = gguf_module()
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)


def save_dequantized(model, source_hf: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``model`` (PyTorch, fp32, its decoder linears on GPTQ's grid) as the Hugging Face
    directory ``write`` starts from, with ``source_hf``'s tokenizer, chat template and
    generation settings; returns ``out``."""
    import shutil

    from .hf_model import TOKENIZER_FILES

    out = Path(out)
    model.save_pretrained(out)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (Path(source_hf) / name).is_file():
            shutil.copy(Path(source_hf) / name, out / name)
    return out


def write(quantized_hf: str | os.PathLike, out: str | os.PathLike, type_of: TypeOf) -> dict[str, Any]:
    """Write the GGUF (module docstring) to ``out``, each tensor of the type ``type_of``
    gives it; returns ``{type: tensor count}``."""
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
            kind = type_of(tensor.name, values.shape, layers)
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
    llama.cpp against. Architectures of ``PERMUTES_QUERY_KEY`` only (their converter's
    permutation, where it makes one, is undone here); a tensor of the model the file
    lacks is refused."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    gguf_py = gguf_module()
    reader = gguf_py.GGUFReader(gguf)
    arch = reader.fields[gguf_py.Keys.General.ARCHITECTURE].contents()
    if arch not in PERMUTES_QUERY_KEY:
        raise EdgepathError(f"{gguf}: a {arch} GGUF; reading one back knows {', '.join(PERMUTES_QUERY_KEY)}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    config = model.config
    model_arch = next(a for a, name in gguf_py.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf_py.get_tensor_name_map(model_arch, config.num_hidden_layers)
    stored = {t.name: t for t in reader.tensors}
    head = model.get_output_embeddings()
    if names.get_name("lm_head.weight", try_suffixes=(".weight",)) in stored and head.weight is model.get_input_embeddings().weight:
        # a file that stores a head apart (a rotated build's) is read with its own head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        config.tie_word_embeddings = False
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
            if head_count and PERMUTES_QUERY_KEY[arch]:  # the converter's: [heads, 2, d/2] -> [heads, d/2, 2]
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
