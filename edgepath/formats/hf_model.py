"""Validate and fingerprint a Hugging Face model directory, without loading it.

The checks read ``config.json``, the tokenizer files and each safetensors
header, never the weights themselves, and never unpickle anything. Each
safetensors header is checked here first (its length within the file and the
format's 100 MiB limit, JSON, every tensor's ``data_offsets`` a pair of
integers, the tensors' byte ranges tiling the data without a gap or an
overlap), then read by the safetensors library (``safe_open``, numpy framework:
it memory-maps the file and loads no tensor), which checks each range against
its tensor's shape and dtype. A directory is refused, with the problem named,
when it has no tokenizer, weights that are not safetensors, a truncated or
corrupt safetensors file, or an architecture the pipeline does not handle.

A model directory is closed: what the record lists is everything the model
reads. Every entry (hidden ones, which no loader reads and the record leaves
out, aside) is a regular file or a directory, or a symlink that stays inside the
directory: a symlink leading out (a Hugging Face cache snapshot, whose files
link to its blobs; copy it with ``cp -rL`` first), a FIFO or a device is refused
by name. The shard index names relative paths inside the directory only.

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
import stat
import struct
from pathlib import Path
from typing import Any

from ..core import files
from ..core.errors import EdgepathError, one_line
from ..core.files import sha256_file

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
# safetensors' reasons for refusing a file that passed check_safetensors_layout (its
# SafetensorError text) -> the problem as a user reads it; the library's own words follow.
_SAFETENSORS_PROBLEMS = (
    ("invalid JSON", "corrupt safetensors header"),
    ("invalid shape", "corrupt safetensors header: a tensor's byte range does not fit its shape and dtype"),
)
# The safetensors format's own limit on the header (the library refuses a larger one).
MAX_SAFETENSORS_HEADER = 100 << 20
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
# Config keys that name the tool or path that wrote the file, not the model.
_CONFIG_KEYS_NOT_IDENTITY = ("transformers_version", "_name_or_path", "_model_name_or_path")


def file_entry(path: Path, root: Path) -> dict[str, Any]:
    """``{path (relative to root), size, sha256}`` of one file, as records list them."""
    return {"path": path.relative_to(root).as_posix(), "size": path.stat().st_size, "sha256": sha256_file(path)}


def _canonical_sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def check_safetensors_layout(path: Path) -> None:
    """Refuse a safetensors file whose header is not what the format promises: an
    8-byte little-endian length, a JSON object that fits in the file, and per
    tensor a ``data_offsets`` pair of integers; sorted by their start, the tensors'
    ranges tile the data after the header exactly (no gap, no overlap, nothing
    after the last). The library accepts overlapping ranges, so this comes first."""
    with files.open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise EdgepathError(f"{path}: truncated safetensors file, no complete header ({size} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_SAFETENSORS_HEADER:
            raise EdgepathError(f"{path}: not a safetensors file, or truncated: a header length ({length}) over "
                                f"the format's 100 MiB limit ({size} bytes)")
        if 8 + length > size:
            raise EdgepathError(f"{path}: not a safetensors file, or truncated: its header ({length} bytes) runs "
                                f"past the end of the file ({size} bytes)")
        raw = f.read(length)
    try:
        header = files.loads_json(raw.decode("utf-8"), str(path), shape=dict)
    except (UnicodeDecodeError, EdgepathError):
        raise EdgepathError(f"{path}: corrupt safetensors header (not a JSON object)") from None
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise EdgepathError(f"{path}: corrupt safetensors header: tensor {name!r} has data_offsets "
                                f"{json.dumps(offsets)}, not a pair [begin, end] of integers with begin <= end")
        ranges.append((offsets[0], offsets[1], name))
    data_size = size - 8 - length
    position, previous = 0, None
    for begin, end, name in sorted(ranges):
        if begin < position:
            raise EdgepathError(f"{path}: corrupt safetensors header: tensors {previous!r} and {name!r} overlap "
                                f"(bytes {begin} to {position} of the data)")
        if begin > position:
            raise EdgepathError(f"{path}: corrupt safetensors header: bytes {position} to {begin} of the data, "
                                f"before tensor {name!r}, belong to no tensor")
        position, previous = end, name
    if position != data_size:
        raise EdgepathError(f"{path}: truncated, or bytes after the last tensor: the tensors the header lists "
                            f"cover {position} bytes of data, the file holds {data_size}; re-download or re-export it")


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape} of one safetensors file, after checking that
    the header parses and the file holds exactly the bytes the header promises
    (``check_safetensors_layout``, then safetensors' own checks on the
    memory-mapped file: no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    check_safetensors_layout(path)
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


def _load_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (a regular file; any other JSON type is refused)."""
    if not os.path.lexists(path):
        raise EdgepathError(f"{path.parent}: no {path.name} ({what})")
    return files.read_json(path)


def check_closed(d: Path) -> None:
    """Refuse a model directory that is not closed (module docstring): every entry
    not hidden must be a regular file or a directory, reached without a symlink
    that leads out of ``d``."""
    root = Path(os.path.realpath(d))
    for parent, dirs, names in os.walk(d):
        dirs[:] = [n for n in dirs if not n.startswith(".")]
        for name in [*dirs, *names]:
            if name.startswith("."):
                continue
            entry = Path(parent) / name
            if entry.is_symlink():
                target = Path(os.path.realpath(entry))
                if target != root and root not in target.parents:
                    raise EdgepathError(
                        f"{entry}: a symlink leading out of the model directory (to {target}); the record could "
                        f"not cover what the model reads. Copy the directory with the links resolved (cp -rL)")
            try:
                mode = entry.stat().st_mode
            except OSError as e:
                raise EdgepathError(files.describe_os_error(e, entry)) from None
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise EdgepathError(f"{entry}: not a regular file or a directory; a model directory holds "
                                    f"regular files and folders only")


def _shard_path(d: Path, index: Path, name: Any) -> Path:
    """The shard ``name`` of ``index``'s weight_map: a relative path inside ``d``, no
    part of it hidden (what the record lists, ``check_closed`` has checked)."""
    if not (isinstance(name, str) and name and not name.startswith("/") and "\\" not in name
            and not any(part == "" or part.startswith(".") for part in name.split("/"))):
        raise EdgepathError(f"{index}: weight_map names {json.dumps(name)}: a shard must be a relative path "
                            f"inside the model directory (no absolute path, no '..', no hidden file)")
    return d / name


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of the model directory ``d``: those its index names, or
    else every ``*.safetensors`` beside config.json."""
    index = d / "model.safetensors.index.json"
    if os.path.lexists(index):
        weight_map = _load_json(index, "safetensors shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EdgepathError(f"{index}: no weight_map (an object of tensor name -> shard file)")
        shards = [_shard_path(d, index, name) for name in weight_map.values()]
        found = sorted(set(shards))
        missing = [f.relative_to(d).as_posix() for f in found if not os.path.lexists(f)]
        if missing:
            raise EdgepathError(f"{d}: shards named in {index.name} are missing: {', '.join(missing)}")
        return found
    found = sorted(p for p in d.glob("*.safetensors") if not p.name.startswith("."))
    if found:
        return found
    pickled = sorted(p.name for p in d.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise EdgepathError(
            f"{d}: weights are not safetensors ({', '.join(pickled)}); edgepath never unpickles "
            f"weight files. Convert them to safetensors with the tool you trust, then retry"
        )
    raise EdgepathError(f"{d}: no weights (no *.safetensors file)")


def _check_tokenizer_json(path: Path) -> None:
    """``path`` read as transformers reads it: the ``tokenizers`` library parses the
    whole file, and transformers' fast tokenizer takes ``added_tokens`` (a list) out of it
    first itself, so a file without it loads here and fails in every later stage."""
    import tokenizers

    document = _load_json(path, "tokenizer")
    for key, kind, name in (("model", dict, "object"), ("added_tokens", list, "array")):
        if not isinstance(document.get(key), kind):
            raise EdgepathError(f"{path}: not a tokenizers file: its {key!r} is "
                                f"{'missing' if key not in document else 'not a JSON ' + name}")
    try:
        tokenizers.Tokenizer.from_str(json.dumps(document))
    except Exception as e:  # the library raises plain Exceptions with its parser's message
        raise EdgepathError(f"{path}: not a tokenizer the tokenizers library reads ({one_line(e)})") from None


def _check_tokenizer(d: Path) -> list[str]:
    present = [name for name in TOKENIZER_FILES if os.path.lexists(d / name)]
    if "tokenizer.json" in present:
        _check_tokenizer_json(d / "tokenizer.json")
    elif "tokenizer.model" in present:
        with files.open_regular(d / "tokenizer.model") as f:
            if not f.read(1):
                raise EdgepathError(f"{d / 'tokenizer.model'}: empty file")
    else:
        raise EdgepathError(
            f"{d}: no tokenizer (expected tokenizer.json or tokenizer.model beside config.json)"
        )
    return present


def _chat_template(d: Path) -> bool:
    if os.path.lexists(d / "chat_template.jinja"):
        return True
    config = d / "tokenizer_config.json"
    return os.path.lexists(config) and bool(_load_json(config, "tokenizer config").get("chat_template"))


def _architecture(d: Path, config: dict[str, Any]) -> str:
    """The supported architecture config.json's ``architectures`` list names."""
    archs = config.get("architectures")
    where = d / "config.json"
    if isinstance(archs, str):
        raise EdgepathError(f"{where}: architectures is the string {json.dumps(archs)}; it must be a list, "
                            f"e.g. [{json.dumps(archs)}]")
    if archs is None or archs == []:
        archs = []
    elif not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise EdgepathError(f"{where}: architectures must be a list of names, e.g. [\"LlamaForCausalLM\"]")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise EdgepathError(
            f"{d}: architecture {', '.join(archs) or '(none given in config.json)'} is not handled; "
            f"edgepath handles {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def inspect(model_dir: str | os.PathLike, with_file_digests: bool = True) -> dict[str, Any]:
    """Everything the model record says about ``model_dir``, or EdgepathError."""
    d = Path(model_dir)
    if not d.is_dir():
        raise EdgepathError(f"{d}: not a directory")
    check_closed(d)
    config = _load_json(d / "config.json", "the model's config")
    arch = _architecture(d, config)
    tokenizer_files = _check_tokenizer(d)
    tensors: dict[str, dict[str, Any]] = {}
    for f in weight_files(d):
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
        # every file the model reads (the directory is closed: check_closed)
        entries = [
            file_entry(p, d)
            for p in sorted(d.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(d).parts)
        ]
        record["files"] = entries
        record["digest"] = _canonical_sha256([[f["path"], f["sha256"]] for f in entries])
    return record


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def stored_bytes(directory: Path) -> tuple[int, int]:
    """(tensor bytes of a safetensors checkpoint, the bytes a decode step reads of them):
    every tensor, except the embedding table where the checkpoint has its own head (a
    step then reads one row of it)."""
    sizes: dict[str, int] = {}
    for f in sorted(directory.glob("*.safetensors")):
        sizes.update(tensor_bytes(f))
    total = sum(sizes.values())
    untied = any(name.startswith("lm_head.") for name in sizes)
    embedding = sum(n for name, n in sizes.items() if name.endswith("embed_tokens.weight"))
    return total, total - embedding if untied else total
