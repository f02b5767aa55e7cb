"""Validate and fingerprint a Hugging Face model directory, without loading it.

The checks read ``config.json``, the tokenizer files and each safetensors
header, never the weights themselves, and never unpickle anything. The headers
are read by the safetensors library (``safe_open``, numpy framework: it
memory-maps the file and loads no tensor), which refuses a header over the
format's 100 MiB limit before reading it, and a file whose tensors' byte
ranges do not cover it exactly. A directory is refused, with the problem named,
when it has no tokenizer, weights that are not safetensors, a truncated or
corrupt safetensors file, or an architecture the pipeline does not handle.

The model record (``model.json``) keeps two identities:

- ``fingerprint``: config + tokenizer + weight names/dtypes/shapes. Two
  directories with the same fingerprint are the same model layout.
- ``digest``: sha256 over every file's sha256; changes with any byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import EdgepathError

# Decoder-only architectures whose checkpoints use the Llama tensor layout
# (model.layers.N.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj) that
# edgepath's quantizers walk, and that vLLM's CPU backend runs.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)

# Bits per element of each dtype safetensors reads (the sub-byte ones come packed; the
# library checks that every tensor's byte range is its shape times this).
_DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
# safetensors' reasons for refusing a file (its SafetensorError text) -> the problem as
# a user reads it; the library's own words follow.
_SAFETENSORS_PROBLEMS = (
    ("header too small", "truncated safetensors file, no complete header"),
    ("header too large", "not a safetensors file, or truncated: a header length over the format's 100 MiB limit"),
    ("invalid header length", "not a safetensors file, or truncated: its header runs past the end of the file"),
    ("incomplete metadata", "truncated, or bytes after the last tensor: the tensors the header lists do not "
                            "cover the file exactly; re-download or re-export it"),
    ("invalid JSON", "corrupt safetensors header"),
    ("invalid shape", "corrupt safetensors header: a tensor's byte range does not fit its shape and dtype"),
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
# Config keys that name the tool or path that wrote the file, not the model.
_CONFIG_KEYS_NOT_IDENTITY = ("transformers_version", "_name_or_path", "_model_name_or_path")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path, root: Path) -> dict[str, Any]:
    """``{path (relative to root), size, sha256}`` of one file, as records list them."""
    return {"path": path.relative_to(root).as_posix(), "size": path.stat().st_size, "sha256": sha256_file(path)}


def _canonical_sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape} of one safetensors file, after checking that
    the header parses and the file holds exactly the bytes the header promises
    (safetensors' checks, on the memory-mapped file: no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            tensors = {name: {"dtype": s.get_dtype(), "shape": [int(d) for d in s.get_shape()]}
                       for name, s in slices.items()}
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        problem = next((p for key, p in _SAFETENSORS_PROBLEMS if reason.startswith(key)),
                       "not a readable safetensors file")
        raise EdgepathError(f"{path}: {problem} (safetensors: {reason}; {path.stat().st_size} bytes)") from None
    unknown = sorted({t["dtype"] for t in tensors.values()} - _DTYPE_BITS.keys())
    if unknown:
        raise EdgepathError(f"{path}: tensors of dtype {', '.join(unknown)}, which edgepath does not know")
    return tensors


def tensor_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> bytes of its data in one safetensors file (header checked)."""
    return {name: math.prod(t["shape"]) * _DTYPE_BITS[t["dtype"]] // 8
            for name, t in read_safetensors_header(path).items()}


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgepathError(f"{path.parent}: no {path.name} ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgepathError(f"{path}: not valid JSON ({e})") from None


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = _load_json(index, "safetensors shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EdgepathError(f"{index}: no weight_map")
        files = [d / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EdgepathError(f"{d}: shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in d.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise EdgepathError(
            f"{d}: weights are not safetensors ({', '.join(pickled)}); edgepath never unpickles "
            f"weight files. Convert them to safetensors with the tool you trust, then retry"
        )
    raise EdgepathError(f"{d}: no weights (no *.safetensors file)")


def _check_tokenizer(d: Path) -> list[str]:
    present = [name for name in TOKENIZER_FILES if (d / name).is_file()]
    if "tokenizer.json" in present:
        tok = _load_json(d / "tokenizer.json", "tokenizer")
        if not isinstance(tok, dict) or "model" not in tok:
            raise EdgepathError(f"{d / 'tokenizer.json'}: not a tokenizers file (no 'model' entry)")
    elif "tokenizer.model" in present:
        if (d / "tokenizer.model").stat().st_size == 0:
            raise EdgepathError(f"{d / 'tokenizer.model'}: empty file")
    else:
        raise EdgepathError(
            f"{d}: no tokenizer (expected tokenizer.json or tokenizer.model beside config.json)"
        )
    return present


def _chat_template(d: Path) -> bool:
    if (d / "chat_template.jinja").is_file():
        return True
    config = d / "tokenizer_config.json"
    return config.is_file() and bool(_load_json(config, "tokenizer config").get("chat_template"))


def inspect(model_dir: str | os.PathLike, with_file_digests: bool = True) -> dict[str, Any]:
    """Everything the model record says about ``model_dir``, or EdgepathError."""
    d = Path(model_dir)
    if not d.is_dir():
        raise EdgepathError(f"{d}: not a directory")
    config = _load_json(d / "config.json", "the model's config")
    if not isinstance(config, dict):
        raise EdgepathError(f"{d / 'config.json'}: not a JSON object")
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise EdgepathError(
            f"{d}: architecture {', '.join(archs) or '(none given in config.json)'} is not handled; "
            f"edgepath handles {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tokenizer_files = _check_tokenizer(d)
    tensors: dict[str, dict[str, Any]] = {}
    for f in _weight_files(d):
        for name, info in read_safetensors_header(f).items():
            if name in tensors:
                raise EdgepathError(f"{d}: tensor {name!r} appears in more than one weight file")
            tensors[name] = info
    embed = tensors.get("model.embed_tokens.weight")
    want = [config.get("vocab_size"), config.get("hidden_size")]
    if embed is None:
        raise EdgepathError(f"{d}: no model.embed_tokens.weight tensor (not a {arch} checkpoint)")
    if embed["shape"] != want:
        raise EdgepathError(
            f"{d}: model.embed_tokens.weight is {embed['shape']}, config.json says "
            f"[vocab_size, hidden_size] = {want}"
        )
    tied = bool(config.get("tie_word_embeddings", False))
    if not tied and "lm_head.weight" not in tensors:
        raise EdgepathError(f"{d}: untied embeddings but no lm_head.weight tensor")
    identity_config = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_NOT_IDENTITY}
    tokenizer_digests = {n: sha256_file(d / n) for n in tokenizer_files}
    record: dict[str, Any] = {
        "architecture": arch,
        "model_type": config.get("model_type", ""),
        "config": {k: config.get(k) for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings",
        )},
        "dtypes": sorted({t["dtype"] for t in tensors.values()}),
        "parameters": sum(_numel(t["shape"]) for t in tensors.values()),
        "has_chat_template": _chat_template(d),
        "tokenizer_files": tokenizer_files,
        "tensors": dict(sorted(tensors.items())),
        "fingerprint": _canonical_sha256(
            {"config": identity_config, "tokenizer": tokenizer_digests, "tensors": tensors}
        ),
    }
    if with_file_digests:
        files = [
            file_entry(p, d)
            for p in sorted(d.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(d).parts)
        ]
        record["files"] = files
        record["digest"] = _canonical_sha256([[f["path"], f["sha256"]] for f in files])
    return record


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
