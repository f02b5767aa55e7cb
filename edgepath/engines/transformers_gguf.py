"""GGUF -> bf16 Hugging Face directory, with transformers + gguf.

transformers reads the GGUF's tokenizer and chat template from its metadata and
dequantizes the weights (Q4_1 here) to bf16 when asked with
``GgufConfig(dequantize=True)``; without it, transformers 5.19 keeps GGUF blocks
packed and refuses to save them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils.quantization_config import GgufConfig


def file_type(gguf_path: Path) -> str:
    """What the GGUF's weights were quantized to, as llama.cpp names its file types
    (``general.file_type``: ``Q4_K_M``, ``Q4_1``, ``F16``, ...), read with the gguf
    package transformers reads the file with."""
    from gguf import GGUFReader, Keys, LlamaFileType

    field = GGUFReader(gguf_path).fields.get(Keys.General.FILE_TYPE)
    if field is None:
        return "unknown (the file does not say)"
    return LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


def gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, bf16 safetensors, tokenizer and chat template into ``out_dir``."""
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
