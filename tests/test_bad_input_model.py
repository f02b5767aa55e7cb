"""Bad input to the model and bundle commands, and to every stage's ``--out``.

Each case runs the real ``edgepath`` command (tests/bad_inputs.py) on a tiny but
complete Llama directory (written by the safetensors library, a word-level
tokenizer) or a small manifest, damaged one way, and checks the one line it must
print and that nothing was deleted: the model directory, a folder of unrelated
files, a file at ``--out``. Issue 19's findings covered here: 1 (``--out`` deletes
whatever is there; ``--out .`` and ``--out ""``), 2 (weights outside the model
directory: the index, symlinks, FIFOs and devices), 3 (``model.source`` never
reaches a shell: ``--params``), 5 (JSON of the wrong shape, special files) and the
milder ones (``architectures`` as a string, safetensors offsets that overlap or
are not integers).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from .bad_inputs import EDGEPATH, ROOT, Case, run_case
from .conftest import write_tiny_llama

MODEL = ("m/config.json", "m/model.safetensors", "m/tokenizer.json")
"""The tiny model's files: no case may delete or change them."""
ODD_NAME = "my model; $(touch PWNED) 'x' \"y\" `touch PWNED2`"
"""A directory name a shell would run commands from."""


def tokenizer(d: Path) -> Path:
    """A word-level tokenizer.json of the tiny model's 64 tokens, in ``d/tok``."""
    from tokenizers import Tokenizer, models

    (d / "tok").mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(d / "tok" / "tokenizer.json"))
    return d / "tok"


def tiny_model(d: Path, name: str = "m", **config) -> Path:
    return write_tiny_llama(d / name, tokenizer(d), **config)


def edit_header(path: Path, change) -> None:
    """Rewrite the safetensors file ``path`` with ``change(header)`` applied to its
    JSON header; the tensor data stays as it was."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def _ordered(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def _overlap(header: dict) -> None:
    """The second tensor (by offset) reads the first one's bytes (both are norms of 64)."""
    first, second = [n for n in _ordered(header) if header[n]["shape"] == [64]][:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])


def _float_offsets(header: dict) -> None:
    name = _ordered(header)[0]
    header[name]["data_offsets"] = [float(o) for o in header[name]["data_offsets"]]


def _bool_offsets(header: dict) -> None:
    name = _ordered(header)[0]
    header[name]["data_offsets"] = [False, header[name]["data_offsets"][1]]


def _gap(header: dict) -> None:
    """The last tensor starts 2 bytes late (and ends 2 bytes early)."""
    name = _ordered(header)[-1]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 2, end]


# ---------------------------------------------------------------- setups

def model_setup(**config):
    return lambda d: tiny_model(d, **config)


def damaged(change, **config):
    """A setup: the tiny model, then ``change(model_dir, case_dir)``."""
    def setup(d: Path) -> None:
        change(tiny_model(d, **config), d)
    return setup


def _index(weight_map):
    def change(m: Path, d: Path) -> None:
        (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return change


def _outside_shard(m: Path, d: Path) -> None:
    """The model's weights moved out of it, linked back under the shard's name."""
    (d / "elsewhere").mkdir()
    (m / "model.safetensors").rename(d / "elsewhere" / "model.safetensors")
    (m / "model.safetensors").symlink_to(d / "elsewhere" / "model.safetensors")


def _dot_dot_shard(m: Path, d: Path) -> None:
    (d / "elsewhere").mkdir()
    (m / "model.safetensors").rename(d / "elsewhere" / "model.safetensors")
    _index({"model.embed_tokens.weight": "../elsewhere/model.safetensors"})(m, d)


def _fifo(name):
    def change(m: Path, d: Path) -> None:
        (m / name).unlink(missing_ok=True)
        os.mkfifo(m / name)
    return change


def _link(name, target):
    def change(m: Path, d: Path) -> None:
        (m / name).unlink(missing_ok=True)
        (m / name).symlink_to(target)
    return change


def _write(name, content: str | bytes):
    def change(m: Path, d: Path) -> None:
        (m / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return change


def _tokenizer_with(**fields):
    """A change: the model's tokenizer.json with ``fields`` replaced (None: removed)."""
    def change(m: Path, d: Path) -> None:
        document = json.loads((m / "tokenizer.json").read_text())
        document.update(fields)
        (m / "tokenizer.json").write_text(json.dumps({k: v for k, v in document.items() if v is not None}))
    return change


def _tokenizer_without(key: str):
    return _tokenizer_with(**{key: None})


def _header(change):
    return lambda m, d: edit_header(m / "model.safetensors", change)


def _truncate(m: Path, d: Path) -> None:
    path = m / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _huge_header(m: Path, d: Path) -> None:
    path = m / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + path.read_bytes()[8:])


def _pickle_only(m: Path, d: Path) -> None:
    (m / "model.safetensors").rename(m / "pytorch_model.bin")


def _config_as_directory(m: Path, d: Path) -> None:
    (m / "config.json").unlink()
    (m / "config.json").mkdir()


def _unrelated_folder(d: Path) -> None:
    tiny_model(d)
    (d / "notes").mkdir()
    (d / "notes" / "todo.txt").write_text("my notes\n")


def _regular_file(d: Path) -> None:
    tiny_model(d)
    (d / "out.txt").write_text("not a folder\n")


def _another_stage_output(d: Path) -> None:
    tiny_model(d)
    (d / "out").mkdir()
    (d / "out" / "control.json").write_text(json.dumps({"kind": "edgepath.control", "schema_version": 1}))


def _earlier_output(d: Path) -> None:
    from edgepath.stages import model

    model.run(d / "out", source=str(tiny_model(d)))
    (d / "out" / "stale.txt").write_text("from the earlier run\n")


def _nested(d: Path) -> None:
    tiny_model(d / "w")


def _params(source: str):
    def setup(d: Path) -> None:
        (d / "params.yaml").write_text(json.dumps({"model": {"source": source}}))  # JSON is YAML
    return setup


def _odd_name(d: Path) -> None:
    tiny_model(d, name=ODD_NAME)
    _params(ODD_NAME)(d)


# ---------------------------------------------------------------- bundle

def manifest(d: Path, artifacts: list[dict]) -> None:
    """``d/manifest.json``: a manifest with one target, ``dev``, whose build is ``artifacts``."""
    from edgepath.core import records

    summary = dict.fromkeys(["arch", "cpu_model", "isa", "kernel_isa", "n_physical", "n_logical", "ram_total_bytes",
                             "accelerator", "gpu_name", "gpu_mem_bytes", "supports_bf16", "source"], "x")
    path = {"name": "bf16", "engine": "vllm", "built_by": "model", "quantization": None, "group_size": None,
            "bits_per_weight": 16, "runs_in_vllm": True, "fused_cpu_norms": False,
            "rationale": "the unquantized checkpoint, for tests", "build_with": "edgepath model", "notes": [],
            "engine_kwargs": {}, "engine_env": {}, "activations": "bf16", "dtype": "bfloat16", "fallback": None,
            "evidence": [], "memory": None}
    digest = "sha256:" + "0" * 64
    entry = {"tag": "dev", "platform": "linux/amd64", "priority": "speed", "engine": "auto",
             "profile": {"digest": digest, "summary": summary}, "path": path,
             "build": {"state": "built", "detail": "built here"},
             "verification": {"verified": False, "state": "not run here", "detail": "a test", "record": None},
             "benchmark": {"state": "not run", "detail": "a test", "record": None}, "artifacts": artifacts,
             "memory": None, "release": {"state": "unreleased", "version": None, "digest": None, "detail": "a test"}}
    record = {**records.envelope("manifest"), "edgepath_version": "0", "targets": [entry],
              "model": {"source": {}, "architecture": "LlamaForCausalLM", "parameters": 1, "fingerprint": digest,
                        "digest": digest}}
    records.write(d / "manifest.json", "manifest", record)


def artifact(d: Path, path: str, name: str) -> dict:
    data = (d / path).read_bytes()
    return {"path": path, "name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def built(d: Path) -> None:
    """A stage output, ``build/weights/w/`` (two files), and a manifest naming it."""
    (d / "build" / "weights" / "w").mkdir(parents=True)
    (d / "build" / "weights" / "w" / "model.safetensors").write_bytes(b"weights")
    (d / "build" / "weights" / "w" / "config.json").write_text("{}")
    manifest(d, [artifact(d, "build/weights/w/model.safetensors", "w/model.safetensors"),
                 artifact(d, "build/weights/w/config.json", "w/config.json")])


def _built_then(change):
    def setup(d: Path) -> None:
        built(d)
        change(d)
    return setup


def _bundled_before(d: Path) -> None:
    from edgepath.stages import bundle

    built(d)
    bundle.write(d / "manifest.json", "dev", d / "build" / "devices" / "dev")


def _artifact_special(make):
    """The manifest names a file that ``make(path)`` then turns into something else."""
    def setup(d: Path) -> None:
        (d / "build").mkdir()
        (d / "build" / "f").write_bytes(b"x" * 7)
        manifest(d, [artifact(d, "build/f", "f")])
        (d / "build" / "f").unlink()
        make(d / "build" / "f")
    return setup


def _name_escapes(d: Path) -> None:
    built(d)
    entry = artifact(d, "build/weights/w/config.json", "../escaped.json")
    manifest(d, [entry])


BUNDLE = ("build/weights/w/model.safetensors", "build/weights/w/config.json", "manifest.json")


def bundle_argv(out: str):
    return lambda d: ["bundle", "--target", "dev", "--manifest", "manifest.json", "--out", out]


def model_argv(*args: str):
    return lambda d: ["model", *args]


CASES = [
    # finding 1: --out deletes whatever is there
    Case("model-out-is-the-source", model_argv("--source", "m", "--out", "m"), r"m: overlaps what this command reads",
         model_setup(), unchanged=MODEL, absent=("m/model.json", ".m.*")),
    Case("model-out-inside-the-source", model_argv("--source", "m", "--out", "m/record"), "overlaps what this command",
         model_setup(), unchanged=MODEL, absent=("m/record",)),
    Case("model-out-holds-the-source", model_argv("--source", "w/m", "--out", "w"), r"w: overlaps .*w/m",
         _nested, unchanged=tuple(f"w/{p}" for p in MODEL), absent=("w/model.json",)),
    Case("model-out-is-the-source-through-a-symlink", model_argv("--source", "m", "--out", "link"),
         "overlaps what this command reads",
         lambda d: (tiny_model(d), (d / "link").symlink_to(d / "m")), unchanged=MODEL, absent=("m/model.json",)),
    Case("model-out-is-an-unrelated-folder", model_argv("--source", "m", "--out", "notes"),
         r"notes: holds files edgepath did not write there \(todo.txt\).*no model.json", _unrelated_folder,
         unchanged=("notes/todo.txt", *MODEL), absent=("notes/model.json",)),
    Case("model-out-is-a-regular-file", model_argv("--source", "m", "--out", "out.txt"),
         "out.txt: exists and is not a directory", _regular_file, unchanged=("out.txt", *MODEL)),
    Case("model-out-is-another-stages-output", model_argv("--source", "m", "--out", "out"),
         r"out: holds files .*\(control.json\)", _another_stage_output, unchanged=("out/control.json",),
         absent=("out/model.json",)),
    Case("model-out-is-the-current-directory", model_argv("--source", "m", "--out", "."), "is the current directory",
         model_setup(), unchanged=MODEL, absent=(".*.old", ".*.tmp", "model.json")),
    Case("model-out-is-the-parent-directory", model_argv("--source", "m", "--out", ".."),
         "current directory or one above",
         model_setup(), unchanged=MODEL, absent=(".*.old", ".*.tmp")),
    Case("model-out-is-empty", model_argv("--source", "m", "--out", ""), "--out: empty path",
         model_setup(), unchanged=MODEL, absent=(".*.old", ".*.tmp", "model.json")),
    Case("model-rerun-replaces-its-own-output", model_argv("--source", "m", "--out", "out"), "", _earlier_output,
         code=0, exists=("out/model.json", *MODEL), absent=("out/stale.txt", ".out.*")),
    Case("model-into-an-empty-folder", model_argv("--source", "m", "--out", "empty"), "",
         lambda d: (tiny_model(d), (d / "empty").mkdir()), code=0, exists=("empty/model.json",)),
    # finding 3: model.source from params, never through a shell
    Case("model-params-source-with-shell-characters", model_argv("--params", "params.yaml", "--out", "out"), "",
         _odd_name, code=0, exists=("out/model.json", f"{ODD_NAME}/config.json"), absent=("PWNED", "PWNED2")),
    Case("model-params-source-missing", model_argv("--params", "params.yaml", "--out", "out"),
         r"no such; \$\(touch PWNED\): not a directory", _params("no such; $(touch PWNED)"), absent=("out", "PWNED")),
    Case("model-params-file-missing", model_argv("--params", "nothing.yaml", "--out", "out"), "nothing.yaml",
         absent=("out",)),
    # finding 2: the model directory is closed
    Case("index-names-an-absolute-path", model_argv("--source", "m", "--out", "out"),
         r"model.safetensors.index.json: weight_map names \"/etc/passwd\": a shard must be a relative path",
         damaged(_index({"model.embed_tokens.weight": "/etc/passwd"})), absent=("out",), unchanged=MODEL),
    Case("index-names-a-path-above", model_argv("--source", "m", "--out", "out"),
         r"weight_map names \"../elsewhere/model.safetensors\".*no '\.\.'", damaged(_dot_dot_shard), absent=("out",)),
    Case("index-names-a-hidden-file", model_argv("--source", "m", "--out", "out"),
         r"weight_map names \"\.w\.safetensors\"",
         damaged(_index({"model.embed_tokens.weight": ".w.safetensors"})), absent=("out",)),
    Case("index-weight-map-not-an-object", model_argv("--source", "m", "--out", "out"), "index.json: no weight_map",
         damaged(_index(["model.safetensors"])), absent=("out",)),
    Case("index-is-a-json-list", model_argv("--source", "m", "--out", "out"),
         "index.json: a JSON array where a JSON object is expected",
         damaged(_write("model.safetensors.index.json", "[]")), absent=("out",)),
    Case("weights-are-a-symlink-out-of-the-directory", model_argv("--source", "m", "--out", "out"),
         r"m/model.safetensors: a symlink leading out of the model directory .*cp -rL", damaged(_outside_shard),
         absent=("out",), exists=("elsewhere/model.safetensors",)),
    Case("any-symlink-out-of-the-directory", model_argv("--source", "m", "--out", "out"),
         r"m/notes.txt: a symlink leading out of the model directory \(to /etc/hostname\)",
         damaged(_link("notes.txt", "/etc/hostname")), absent=("out",)),
    Case("config-is-a-symlink-to-dev-zero", model_argv("--source", "m", "--out", "out"),
         r"m/config.json: a symlink leading out .*/dev/zero", damaged(_link("config.json", "/dev/zero")),
         absent=("out",)),
    Case("config-is-a-fifo", model_argv("--source", "m", "--out", "out"),
         "m/config.json: not a regular file or a directory", damaged(_fifo("config.json")), absent=("out",)),
    Case("weights-are-a-fifo", model_argv("--source", "m", "--out", "out"),
         "m/model.safetensors: not a regular file or a directory", damaged(_fifo("model.safetensors")),
         absent=("out",)),
    Case("a-fifo-anywhere-in-the-directory", model_argv("--source", "m", "--out", "out"),
         "m/generation_config.json: not a regular file", damaged(_fifo("generation_config.json")), absent=("out",)),
    Case("config-is-a-directory", model_argv("--source", "m", "--out", "out"),
         "m/config.json: a directory, not a regular file", damaged(_config_as_directory), absent=("out",)),
    Case("symlink-loop-in-the-directory", model_argv("--source", "m", "--out", "out"),
         r"m/loop: (too many levels of symbolic links|a symlink leading out)", damaged(_link("loop", "loop")),
         absent=("out",)),
    # finding 5 in the model directory: wrong JSON shapes, undecodable or nested too deep
    Case("config-is-a-json-list", model_argv("--source", "m", "--out", "out"),
         "m/config.json: a JSON array where a JSON object is expected", damaged(_write("config.json", "[1, 2]")),
         absent=("out",)),
    Case("tokenizer-is-a-json-list", model_argv("--source", "m", "--out", "out"),
         "m/tokenizer.json: a JSON array where a JSON object is expected", damaged(_write("tokenizer.json", "[]")),
         absent=("out",)),
    Case("tokenizer-without-added-tokens", model_argv("--source", "m", "--out", "out"),
         r"m/tokenizer.json: not a tokenizers file: its 'added_tokens' is missing",
         damaged(_tokenizer_without("added_tokens")), absent=("out",)),
    Case("tokenizer-the-library-cannot-read", model_argv("--source", "m", "--out", "out"),
         r"m/tokenizer.json: not a tokenizer the tokenizers library reads",
         damaged(_tokenizer_with(model={"type": "NoSuchModel"})), absent=("out",)),
    Case("tokenizer-config-is-a-json-string", model_argv("--source", "m", "--out", "out"),
         "m/tokenizer_config.json: a JSON string where a JSON object is expected",
         damaged(_write("tokenizer_config.json", '"chat"')), absent=("out",)),
    Case("config-is-binary", model_argv("--source", "m", "--out", "out"), "m/config.json: not UTF-8",
         damaged(_write("config.json", b"\xff\xfe{}")), absent=("out",)),
    Case("config-nested-too-deep", model_argv("--source", "m", "--out", "out"), "m/config.json: JSON nested deeper",
         damaged(_write("config.json", "[" * 100_000 + "]" * 100_000)), absent=("out",)),
    # milder: architectures as a string, safetensors offsets
    Case("architectures-is-a-string", model_argv("--source", "m", "--out", "out"),
         r"config.json: architectures is the string \"LlamaForCausalLM\"; it must be a list",
         model_setup(architectures="LlamaForCausalLM"), absent=("out",)),
    Case("architectures-is-a-number", model_argv("--source", "m", "--out", "out"),
         "architectures must be a list of names", model_setup(architectures=7), absent=("out",)),
    Case("safetensors-offsets-overlap", model_argv("--source", "m", "--out", "out"),
         r"m/model.safetensors: corrupt safetensors header: tensors .* overlap", damaged(_header(_overlap)),
         absent=("out",)),
    Case("safetensors-offsets-are-floats", model_argv("--source", "m", "--out", "out"),
         r"has data_offsets \[0.0, .*not a pair \[begin, end\] of integers", damaged(_header(_float_offsets)),
         absent=("out",)),
    Case("safetensors-offsets-are-booleans", model_argv("--source", "m", "--out", "out"),
         r"has data_offsets \[false, .*not a pair", damaged(_header(_bool_offsets)), absent=("out",)),
    Case("safetensors-offsets-leave-a-gap", model_argv("--source", "m", "--out", "out"), "belong to no tensor",
         damaged(_header(_gap)), absent=("out",)),
    # what already worked stays
    Case("safetensors-truncated", model_argv("--source", "m", "--out", "out"), "truncated", damaged(_truncate),
         absent=("out",)),
    Case("safetensors-header-huge", model_argv("--source", "m", "--out", "out"), "over the format's 100 MiB limit",
         damaged(_huge_header), absent=("out",)),
    Case("safetensors-two-bytes", model_argv("--source", "m", "--out", "out"), "truncated safetensors file",
         damaged(_write("model.safetensors", b"\x01\x02")), absent=("out",)),
    Case("weights-pickle-only", model_argv("--source", "m", "--out", "out"), "never unpickles", damaged(_pickle_only),
         absent=("out",), exists=("m/pytorch_model.bin",)),
    Case("no-tokenizer", model_argv("--source", "m", "--out", "out"), "no tokenizer",
         damaged(lambda m, d: (m / "tokenizer.json").unlink()), absent=("out",)),
    # bundle: finding 1, and special files among what it copies
    Case("bundle-out-is-a-folder-it-copies-from", bundle_argv("build/weights/w"),
         "build/weights/w: overlaps what this command reads", built, unchanged=BUNDLE,
         absent=("build/weights/w/edgepath-device.json",)),
    Case("bundle-out-holds-what-it-copies", bundle_argv("build"), "build: overlaps what this command reads", built,
         unchanged=BUNDLE),
    Case("bundle-out-inside-a-folder-it-copies-from", bundle_argv("build/weights/w/dev"), "overlaps", built,
         unchanged=BUNDLE, absent=("build/weights/w/dev",)),
    Case("bundle-out-is-an-unrelated-folder", bundle_argv("mine"), r"mine: holds files .*no edgepath-device.json",
         _built_then(lambda d: ((d / "mine").mkdir(), (d / "mine" / "a.txt").write_text("a"))),
         unchanged=("mine/a.txt", *BUNDLE)),
    Case("bundle-out-is-a-regular-file", bundle_argv("notes.txt"), "notes.txt: exists and is not a directory",
         _built_then(lambda d: (d / "notes.txt").write_text("mine")), unchanged=("notes.txt", *BUNDLE)),
    Case("bundle-out-is-the-current-directory", bundle_argv("."), "is the current directory", built,
         unchanged=BUNDLE, absent=(".*.old", ".*.tmp", "w")),
    Case("bundle-out-is-empty", bundle_argv(""), "--out: empty path", built, unchanged=BUNDLE,
         absent=(".*.old", ".*.tmp")),
    Case("bundle-rerun-replaces-its-own-output", bundle_argv("build/devices/dev"), "", _bundled_before, code=0,
         exists=("build/devices/dev/edgepath-device.json", "build/devices/dev/w/model.safetensors"), unchanged=BUNDLE),
    Case("bundle-copies-a-fifo", bundle_argv("out"), "build/f: a FIFO, not a regular file", _artifact_special(os.mkfifo),
         absent=("out",)),
    Case("bundle-copies-dev-zero", bundle_argv("out"), "build/f: a character device, not a regular file",
         _artifact_special(lambda p: p.symlink_to("/dev/zero")), absent=("out",)),
    Case("bundle-name-leaves-the-bundle", bundle_argv("out"), r"refused path '\.\./escaped.json'", _name_escapes,
         absent=("out", "escaped.json")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    run_case(case, tmp_path)


def test_source_and_params_together_are_refused_by_the_parser(tmp_path):
    done = subprocess.run([*EDGEPATH, "model", "--source", "m", "--params", "p.yaml", "--out", "out"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert done.returncode == 2 and "not allowed with argument" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
