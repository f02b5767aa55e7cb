"""Bad input to the readers and the read-only commands (issue 19): ls, pull, manifest
show, select, release --dry-run, and check / patch-verify up to where an engine would
start. Each case runs the real CLI (``tests/bad_inputs.py``): one line, exit 2, no
traceback, nothing of the user's lost, nothing left behind. Then: what a manifest
makes ``manifest show`` and ``ls`` print cannot drive the terminal, and the read-only
commands write nothing inside a (read-only) checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import types
from pathlib import Path

import pytest

from .bad_inputs import EDGEPATH, ROOT, Case, copy_project, run_case

TAGS = {"gpu": "gpu-cuda", "avx2": "x86-avx2"}
"""The small fleet of the manifests built here: device tag -> captured profile."""
FINGERPRINT = "sha256:" + "1" * 64


# ---------------------------------------------------------------- building inputs

def model_record(d: Path) -> Path:
    """A hand-written model record (``build/model/model.json``) of a one-layer Llama:
    what select and the manifest read of a model, without converting one."""
    from edgepath.core import records

    path = d / "build" / "model" / "model.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    h, i = 64, 128
    shapes = {"model.embed_tokens.weight": [64, h], "model.layers.0.self_attn.q_proj.weight": [h, h],
              "model.layers.0.self_attn.k_proj.weight": [32, h], "model.layers.0.self_attn.v_proj.weight": [32, h],
              "model.layers.0.self_attn.o_proj.weight": [h, h], "model.layers.0.mlp.gate_proj.weight": [i, h],
              "model.layers.0.mlp.up_proj.weight": [i, h], "model.layers.0.mlp.down_proj.weight": [h, i]}
    record = {**records.envelope("model"), "source": {"kind": "local", "path": "hf"}, "directory": "hf",
              "architecture": "LlamaForCausalLM", "parameters": 49152,
              "config": {"hidden_size": h, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
              "tensors": {n: {"dtype": "BF16", "shape": s} for n, s in shapes.items()},
              "fingerprint": FINGERPRINT, "digest": "sha256:" + "2" * 64, "tokenizer_files": ["tokenizer.json"],
              "has_chat_template": False,
              "files": [{"path": "model.safetensors", "size": 98304, "sha256": "3" * 64}]}
    records.write(path, "model", record)
    return path


def write_manifest(d: Path, rationale: str | None = None) -> Path:
    """``d/manifest.json``, built by ``manifest.build`` from real selection records of
    ``TAGS`` (the GPU's bf16 is built: the model's files; the others are pending);
    ``rationale``: the GPU target's, as a hostile manifest might carry."""
    from edgepath.core import records
    from edgepath.rules import fleet, select
    from edgepath.rules.profile import HardwareProfile
    from edgepath.stages import manifest
    from edgepath.stages.select import selection_record

    model = model_record(d)
    selections = d / "build" / "selections"
    for tag, profile_name in TAGS.items():
        profile = HardwareProfile.from_dict(records.read(ROOT / "profiles" / f"{profile_name}.json", "profile"))
        path = select.select_weight_path(profile)
        if rationale is not None and tag == "gpu":
            path = select.WeightPath(path.spec, path.group_size, rationale, path.notes)
        platform = fleet.Target(tag, "", "speed", "auto").resolve_platform(profile)
        records.write(selections / f"{tag}.json", "selection",
                      selection_record(tag, "speed", platform, profile, FINGERPRINT, path))
    manifest.build(types.SimpleNamespace(targets=list(TAGS)), model, selections, d / "manifest.json",
                   weights_dir=d / "build" / "weights", verify_dir=d / "build" / "verify",
                   exports_dir=d / "build" / "exports", benchmark_path=d / "build" / "benchmark" / "b.json",
                   releases_path=d / "releases.json")
    return d / "manifest.json"


DVC_YAML = "stages:\n  manifest:\n    cmd: python -c pass\n    outs:\n    - manifest.json\n"
STORE = "/nonexistent/edgepath-store"
"""The clones' default DVC remote: none of these commands gets as far as reading it,
except where a case says so (and then it holds nothing)."""


def dvc_project(d: Path) -> Path:
    """``d`` as a git repository with DVC initialised, ``DVC_YAML`` and the remote
    ``STORE``: a clone, for ls and pull."""
    from dvc.repo import Repo

    subprocess.run(["git", "init", "-q"], cwd=d, check=True)
    Repo.init(str(d)).close()
    (d / ".dvc" / "config").write_text(f"[core]\n    remote = store\n['remote \"store\"']\n    url = {STORE}\n")
    (d / "dvc.yaml").write_text(DVC_YAML)
    return d


def lock_naming(d: Path, manifest_bytes: bytes | None = None) -> None:
    """``d/dvc.lock`` naming ``manifest.json`` by the md5 of ``manifest_bytes`` (default:
    the file's bytes), as DVC records a stage output."""
    data = (d / "manifest.json").read_bytes() if manifest_bytes is None else manifest_bytes
    md5 = hashlib.md5(data).hexdigest()
    (d / "dvc.lock").write_text(f"schema: '2.0'\nstages:\n  manifest:\n    cmd: python -c pass\n    outs:\n"
                                f"    - path: manifest.json\n      hash: md5\n      md5: {md5}\n"
                                f"      size: {len(data)}\n")


def ls_project(d: Path) -> None:
    """A clone whose workspace manifest is the one its dvc.lock names (committed to DVC's
    cache, as `dvc repro` leaves it): ls reads it, no remote."""
    from dvc.repo import Repo

    dvc_project(d)
    write_manifest(d)
    with Repo(str(d)) as repo:
        repo.commit(None, force=True)


def deep_json(levels: int = 200) -> str:
    return "[" * levels + "]" * levels


def fifo(path: Path) -> None:
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


# The same bad file in each form a reader must refuse: (id, how to make it at a path, what the line says).
BAD_FILES = [
    ("directory", lambda p: p.mkdir(), "a directory"),
    ("fifo", fifo, "a FIFO"),
    ("dev-zero", dev_zero, "a character device"),
    ("binary", lambda p: p.write_bytes(b"\xff\xfe\x00garbage\x80"), "not UTF-8"),
    ("json-list", lambda p: p.write_text("[1, 2]"), "a JSON array where a JSON object is expected"),
    ("deep", lambda p: p.write_text(deep_json()), "nested deeper than"),
    ("not-json", lambda p: p.write_text("{oops"), "not valid JSON"),
    ("loop", lambda p: p.symlink_to(p.name), "symbolic links"),
    ("key-twice", lambda p: p.write_text('{"kind": "a", "kind": "b"}'), "key 'kind' appears twice"),
]
"""``missing`` is a case of its own: its line says how to make the file."""


def bad(name: str, make):
    """A setup making ``name`` (relative to the case's directory) with ``make``."""
    def setup(d: Path) -> None:
        make(d / name)
    return setup


def then(*steps):
    def setup(d: Path) -> None:
        for step in steps:
            step(d)
    return setup


# ---------------------------------------------------------------- the cases

def _manifest_show_cases() -> list[Case]:
    cases = [Case(f"manifest-show-{kind}", lambda d: ["manifest", "show", "m.json"], rf"m.json: .*{message}",
                  bad("m.json", make)) for kind, make, message in BAD_FILES]
    return cases + [
        Case("manifest-show-missing", lambda d: ["manifest", "show", "m.json"], r"m.json: no such file"),
        Case("manifest-show-empty-path", lambda d: ["manifest", "show", ""], r"manifest: empty path"),
        Case("manifest-show-no-such-user", lambda d: ["manifest", "show", "~edgepath-nouser/m.json"],
             r"no such user"),
        Case("manifest-show-another-record", lambda d: ["manifest", "show", str(ROOT / "profiles/x86-avx2.json")],
             r"x86-avx2.json: .*edgepath.manifest"),
        Case("manifest-show-older-schema", lambda d: ["manifest", "show", "m.json"], r"m.json: .*schema_version",
             bad("m.json", lambda p: p.write_text('{"kind": "edgepath.manifest", "schema_version": 1}'))),
        Case("manifest-show-a-tag-twice", lambda d: ["manifest", "show", "manifest.json"],
             r"manifest.json: not a valid manifest record: targets has tag gpu more than once", _tag_twice),
    ]


def _tag_twice(d: Path) -> None:
    """A manifest listing its GPU target twice (each entry valid)."""
    manifest = json.loads(write_manifest(d).read_text())
    manifest["targets"].append(manifest["targets"][0])
    (d / "manifest.json").write_text(json.dumps(manifest))


def _manifest_bytes_under_lock(data: bytes):
    """A clone whose manifest.json holds ``data``, the bytes its dvc.lock names."""
    def setup(d: Path) -> None:
        dvc_project(d)
        (d / "manifest.json").write_bytes(data)
        lock_naming(d)
    return setup


def _ls_cases() -> list[Case]:
    ls = lambda d: ["ls"]  # noqa: E731
    cases = [Case("ls-no-lock", ls, r"dvc.lock: no such file \(run in a clone", dvc_project)]
    cases += [Case(f"ls-lock-{kind}", ls, rf"dvc.lock: .*{message}", then(dvc_project, bad("dvc.lock", make)))
              for kind, make, message in BAD_FILES if kind in ("directory", "fifo", "dev-zero", "binary", "loop")]
    cases += [
        Case("ls-lock-not-yaml", ls, r"dvc.lock", then(dvc_project, bad("dvc.lock", lambda p: p.write_text(": : :")))),
        Case("ls-lock-without-manifest", ls, r"names no manifest.json",
             then(ls_project, lambda d: (d / "dvc.lock").write_text(
                 (d / "dvc.lock").read_text().replace("path: manifest.json", "path: other.json")),
                  lambda d: (d / "dvc.yaml").write_text(DVC_YAML.replace("manifest.json", "other.json")))),
        Case("ls-manifest-list", ls, r"manifest.json: a JSON array where a JSON object is expected",
             _manifest_bytes_under_lock(b"[1, 2]")),
        Case("ls-manifest-deep", ls, r"manifest.json: JSON nested deeper than",
             _manifest_bytes_under_lock(deep_json().encode())),
        Case("ls-manifest-binary", ls, r"manifest.json: not UTF-8", _manifest_bytes_under_lock(b"\xff\xfe\x80")),
        Case("ls-manifest-another-record", ls, r"manifest.json: .*edgepath.manifest",
             _manifest_bytes_under_lock((ROOT / "profiles/x86-avx2.json").read_bytes())),
        # not the file dvc.lock names, which the remote does not hold either
        Case("ls-manifest-directory-not-on-the-remote", ls, r"manifest.json \(md5 \w+\): missing from remote store",
             then(ls_project, lambda d: (d / "manifest.json").unlink(), bad("manifest.json", Path.mkdir))),
        Case("ls-project-missing", lambda d: ["ls", "--project", "nowhere"], r"nowhere/dvc.lock: no such file"),
    ]
    return cases


def _earlier_pull(d: Path) -> None:
    """``got/``, as an earlier pull left it (its receipt marks it)."""
    (d / "got").mkdir()
    (d / "got" / "edgepath-pull.json").write_text('{"kind": "edgepath.pull", "schema_version": 2}')
    (d / "got" / "model.safetensors").write_text("weights")


def _user_folder(d: Path) -> None:
    (d / "mine").mkdir()
    (d / "mine" / "notes.txt").write_text("keep")


def _pull_cases() -> list[Case]:
    pull_dev = lambda d: ["pull", "dev", "-o", "out"]  # noqa: E731
    # pull has DVC read dvc.lock and dvc.yaml; edgepath reads them first, as it reads any input
    cases = [Case(f"pull-dvc-yaml-{kind}", pull_dev, rf"dvc.yaml: .*{message}",
                  then(ls_project, lambda d: (d / "dvc.yaml").unlink(), bad("dvc.yaml", make)), absent=("out",))
             for kind, make, message in BAD_FILES if kind in ("fifo", "dev-zero", "binary", "directory")]
    return cases + [
        Case("pull-into-a-folder-of-user-files", lambda d: ["pull", "dev", "-o", "mine"],
             r"mine: holds files edgepath did not write there \(notes.txt\).*not replaced",
             then(ls_project, _user_folder), unchanged=("mine/notes.txt",)),
        Case("pull-over-a-user-file", lambda d: ["pull", "dev", "-o", "notes.txt"],
             r"notes.txt: exists and is not a directory",
             then(ls_project, lambda d: (d / "notes.txt").write_text("keep")), unchanged=("notes.txt",)),
        Case("pull-through-a-symlink", lambda d: ["pull", "dev", "-o", "link"], r"link: is a symbolic link; not replaced",
             then(ls_project, _user_folder, lambda d: (d / "link").symlink_to("mine")),
             unchanged=("mine/notes.txt",), absent=("mine/edgepath-pull.json",)),
        Case("pull-into-the-current-directory", lambda d: ["pull", "dev", "-o", "."], r"current directory",
             ls_project, unchanged=("manifest.json",)),
        Case("pull-into-a-parent-directory", lambda d: ["pull", "dev", "-o", ".."], r"current directory or one above"),
        Case("pull-refused-leaves-no-parent-folders", lambda d: ["pull", "dev", "-o", "a/b/c"],
             r"dvc.lock: no such file", absent=("a", ".a*", "*.tmp")),
        Case("pull-unknown-tag-leaves-no-parent-folders", lambda d: ["pull", "toaster", "-o", "a/b/c"],
             r"no device tag 'toaster' in the manifest", ls_project, absent=("a",)),
        Case("pull-refused-keeps-an-earlier-pull", lambda d: ["pull", "toaster", "-o", "got"],
             r"no device tag 'toaster'", then(ls_project, _earlier_pull),
             unchanged=("got/edgepath-pull.json", "got/model.safetensors"), absent=(".got*",)),
        Case("pull-lock-binary", lambda d: ["pull", "dev", "-o", "out"], r"dvc.lock: not UTF-8",
             then(dvc_project, bad("dvc.lock", lambda p: p.write_bytes(b"\xff\xfe\x80"))), absent=("out", ".out*")),
        Case("pull-lock-fifo", lambda d: ["pull", "dev", "-o", "out"], r"dvc.lock: a FIFO",
             then(dvc_project, bad("dvc.lock", fifo)), absent=("out",)),
        Case("pull-manifest-list", lambda d: ["pull", "dev", "-o", "out"], r"manifest.json: a JSON array",
             _manifest_bytes_under_lock(b"[]"), absent=("out",)),
        Case("pull-not-built", lambda d: ["pull", "avx2", "-o", "out"], r"avx2: nothing to pull: its build is pending",
             ls_project, absent=("out",)),
        Case("pull-empty-out", lambda d: ["pull", "-o", ""], r"name a device tag"),
        Case("pull-out-no-such-user", lambda d: ["pull", "gpu", "-o", "~edgepath-nouser/x"], r"no such user"),
    ]


def _select_cases() -> list[Case]:
    profile = lambda d: ["select", "--profile", "p.json"]  # noqa: E731
    cases = [Case(f"select-profile-{kind}", profile, rf"p.json: .*{message}", bad("p.json", make))
             for kind, make, message in BAD_FILES]
    avx2 = str(ROOT / "profiles/x86-avx2.json")
    with_model = lambda *more: lambda d: ["select", "--profile", avx2, "--model", "m.json", *more]  # noqa: E731
    cases += [Case(f"select-model-{kind}", with_model(), rf"m.json: .*{message}", bad("m.json", make))
              for kind, make, message in BAD_FILES if kind in ("directory", "fifo", "json-list", "deep")]
    profile_with = lambda **fields: bad("p.json", lambda p: p.write_text(json.dumps(  # noqa: E731
        {**json.loads((ROOT / "profiles/gpu-cuda.json").read_text()), **fields})))
    return cases + [
        Case("select-profile-ram-of-1e32-bytes", profile, r"p.json: .*ram_total_bytes: 10{32} is greater than the maximum",
             profile_with(ram_total_bytes=10**32)),
        Case("select-profile-compute-capability-abc", profile, r"p.json: .*gpu_compute_capability: 'abc' does not match",
             profile_with(gpu_compute_capability="abc")),
        Case("select-profile-missing", profile, r"p.json: no such file"),
        Case("select-profile-empty-path", lambda d: ["select", "--profile", ""], r"empty path|no such file"),
        Case("select-profile-no-such-user", lambda d: ["select", "--profile", "~edgepath-nouser/p.json"],
             r"no such user"),
        Case("select-profile-is-a-manifest", profile, r"p.json: .*edgepath.profile",
             bad("p.json", lambda p: write_manifest(p.parent).rename(p))),
        Case("select-out-over-a-user-file", with_model("--out", "notes.txt"),
             r"notes.txt: exists and is not an edgepath selection record; not replaced",
             then(lambda d: shutil.copy(model_record(d), d / "m.json"), lambda d: (d / "notes.txt").write_text("keep")),
             unchanged=("notes.txt",)),
        Case("select-out-over-another-record", with_model("--out", "p.json"),
             r"p.json: exists and is not an edgepath selection record",
             then(lambda d: shutil.copy(model_record(d), d / "m.json"), lambda d: shutil.copy(avx2, d / "p.json")),
             unchanged=("p.json",)),
        Case("select-out-over-a-directory", with_model("--out", "sel"),
             r"sel: exists and is not an edgepath selection record",
             then(lambda d: shutil.copy(model_record(d), d / "m.json"), _user_folder,
                  lambda d: (d / "mine").rename(d / "sel")), unchanged=("sel/notes.txt",)),
    ]


def _releases_cases() -> list[Case]:
    dry_run = lambda d: ["release", "--dry-run"]  # noqa: E731
    return [Case(f"release-dry-run-releases-{kind}", dry_run, rf"releases.json: .*{message}",
                 then(dvc_project, bad("releases.json", make)))
            for kind, make, message in BAD_FILES if kind in ("directory", "fifo", "dev-zero", "json-list", "deep")]


def _checkpoint(d: Path, config: dict | None = None) -> None:
    """``ck/``: a checkpoint directory's config.json (nothing else: the check refuses first)."""
    (d / "ck").mkdir()
    config = {"quantization_config": {"quant_method": "gptq"}} if config is None else config
    (d / "ck" / "config.json").write_text(json.dumps(config))


def _base_model(d: Path) -> None:
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text("{}")


def _check_cases() -> list[Case]:
    check = lambda *more: lambda d: ["check", "--checkpoint", "ck", "--model", "hf", *more]  # noqa: E731
    cases = [Case(f"check-checkpoint-config-{kind}", check(), rf"ck/config.json: .*{message}",
                  then(lambda d: (d / "ck").mkdir(), bad("ck/config.json", make)))
             for kind, make, message in BAD_FILES if kind in ("directory", "fifo", "dev-zero", "json-list", "deep")]
    corpus = check("--corpus", "texts", "--holdout", "b")
    return cases + [
        Case("check-checkpoint-missing", check(), r"ck/config.json: no such file \(not a checkpoint directory"),
        Case("check-not-quantized", check(), r"ck/config.json: no quantization_config.quant_method",
             lambda d: _checkpoint(d, {"architectures": ["LlamaForCausalLM"]})),
        Case("check-quant-method-not-a-string", check(), r"no quantization_config.quant_method string",
             lambda d: _checkpoint(d, {"quantization_config": {"quant_method": ["gptq"]}})),
        Case("check-quantization-config-a-list", check(), r"no quantization_config.quant_method",
             lambda d: _checkpoint(d, {"quantization_config": ["gptq"]})),
        Case("check-unknown-quant-method", check(), r"no kernel for awq checkpoints",
             lambda d: _checkpoint(d, {"quantization_config": {"quant_method": "awq"}})),
        Case("check-model-missing", check(), r"hf/config.json: no such file \(--model: not a Hugging Face",
             _checkpoint),
        Case("check-model-config-fifo", check(), r"hf/config.json: a FIFO",
             then(_checkpoint, lambda d: (d / "hf").mkdir(), bad("hf/config.json", fifo))),
        Case("check-corpus-document-fifo", corpus, r"texts/a.txt: a FIFO",
             then(_checkpoint, _base_model, lambda d: (d / "texts").mkdir(), bad("texts/a.txt", fifo),
                  lambda d: (d / "texts" / "b.txt").write_text("held out"))),
        Case("check-corpus-document-binary", corpus, r"texts/a.txt: not UTF-8",
             then(_checkpoint, _base_model, lambda d: (d / "texts").mkdir(),
                  bad("texts/a.txt", lambda p: p.write_bytes(b"\xff\xfe")),
                  lambda d: (d / "texts" / "b.txt").write_text("held out"))),
        Case("check-corpus-document-directory", corpus, r"texts/a.txt: a directory",
             then(_checkpoint, _base_model, lambda d: (d / "texts").mkdir(), bad("texts/a.txt", Path.mkdir),
                  lambda d: (d / "texts" / "b.txt").write_text("held out"))),
        Case("check-corpus-document-dev-zero", corpus, r"texts/a.txt: a character device",
             then(_checkpoint, _base_model, lambda d: (d / "texts").mkdir(), bad("texts/a.txt", dev_zero),
                  lambda d: (d / "texts" / "b.txt").write_text("held out"))),
        Case("check-corpus-not-a-directory", corpus, r"calibration corpus texts: not a directory of .txt files",
             then(_checkpoint, _base_model)),
        Case("check-corpus-empty-path", check("--corpus", ""), r"calibration corpus: empty path",
             then(_checkpoint, _base_model)),
    ]


def _patch_verify_cases() -> list[Case]:
    verify = lambda d: ["patch-verify", "--path", "w4a16-tinygemm", "--model", "m.json", "--weights", "w",  # noqa: E731
                        "--out", "v.json"]
    cases = [Case(f"patch-verify-model-{kind}", verify, rf"m.json: .*{message}",
                  then(copy_project, bad("m.json", make)), absent=("v.json",))
             for kind, make, message in BAD_FILES if kind in ("directory", "fifo", "json-list")]
    with_model = lambda d: (copy_project(d), shutil.copy(model_record(d), d / "m.json"))  # noqa: E731
    return cases + [
        Case("patch-verify-checkpoint-missing", verify,
             r"w/w4a16-tinygemm/config.json: no such file \(no checkpoint: has quantize@w4a16-tinygemm run", with_model,
             absent=("v.json",)),
        Case("patch-verify-checkpoint-config-list", verify, r"w4a16-tinygemm/config.json: a JSON array",
             then(with_model, lambda d: (d / "w" / "w4a16-tinygemm").mkdir(parents=True),
                  bad("w/w4a16-tinygemm/config.json", lambda p: p.write_text("[]"))), absent=("v.json",)),
        Case("patch-verify-not-a-4-bit-path", lambda d: [*verify(d)[:2], "bf16", *verify(d)[3:]],
             r"bf16 is not a quantize stage.s path", with_model, absent=("v.json",)),
    ]


def _pulled(path: str, files: dict[str, bytes], named: dict[str, str] | None = None):
    """A setup: ``got/``, as ``edgepath pull`` leaves a build of weight path ``path``:
    ``files`` (name -> bytes, written relative to ``got/``) and its receipt naming each,
    at ``named[name]`` where given (a hostile receipt's own spelling)."""
    def setup(d: Path) -> None:
        from edgepath.core import records

        (d / "got").mkdir()
        entries = []
        for name, data in files.items():
            (d / "got" / name).parent.mkdir(parents=True, exist_ok=True)
            (d / "got" / name).write_bytes(data)
            entries.append({"path": (named or {}).get(name, name), "source": f"build/{name}", "size": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
        receipt = {**records.envelope("pull"), "tag": "dev", "remote": {"name": "store", "url": STORE},
                   "release": {"state": "unreleased", "version": None, "digest": "sha256:" + "4" * 64},
                   "manifest_md5": "5" * 32, "model": {}, "path": {"name": path, "rationale": "r"},
                   "verification": {"verified": False, "state": "not run here", "detail": "d"}, "files": entries}
        (d / "got" / "edgepath-pull.json").write_text(json.dumps(receipt))
    return setup


def _outside_file(d: Path) -> None:
    (d / "outside.gguf").write_bytes(b"GGUF outside")


def _port_in_use(case_port: list[int]):
    """A setup holding a listening socket for the case's run; its port goes to ``case_port``."""
    import socket

    def setup(d: Path) -> None:
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        case_port.append(held.getsockname()[1])
        _HELD.append(held)  # kept open until the test session ends
    return setup


_HELD: list = []
_PORT: list[int] = []


def _serve_cases() -> list[Case]:
    def serve(*more: str):
        """``serve got`` on a port free now (one the machine already uses would be refused first)."""
        def argv(d: Path) -> list[str]:
            from edgepath.delivery.serve import free_port

            return ["serve", "got", *(more if "--port" in more else ("--port", str(free_port()), *more))]
        return argv

    gguf = _pulled("q4_0-gguf", {"model.gguf": b"GGUF"})
    outside = {"model.gguf": b"GGUF outside"}
    return [
        Case("serve-receipt-names-an-absolute-path", serve(), r"got/edgepath-pull.json: a file's path: refused path "
             r"'/.*outside.gguf': it would leave its directory",
             lambda d: (_outside_file(d), _pulled("q4_0-gguf", outside, {"model.gguf": str(d / "outside.gguf")})(d))),
        Case("serve-receipt-names-a-parent-path", serve(), r"refused path '\.\./outside.gguf'",
             then(_outside_file, _pulled("q4_0-gguf", outside, {"model.gguf": "../outside.gguf"}))),
        Case("serve-port-past-65535", serve("--port", "99999"), r"--port 99999: out of range; give 1 to 65535", gguf),
        Case("serve-port-negative", serve("--port", "-1"), r"--port -1: out of range", gguf),
        Case("serve-context-negative", serve("--context", "-5"), r"--context -5: out of range", gguf),
        Case("serve-parallel-zero", serve("--parallel", "0"), r"--parallel 0: out of range", gguf),
        Case("serve-port-in-use", lambda d: ["serve", "got", "--port", str(_PORT[-1])],
             r"cannot listen there \(Address already in use\); another server holds the port",
             then(gguf, _port_in_use(_PORT))),
        Case("serve-a-phone-program", serve(), r"an ExecuTorch program: it runs in the app on the phone, not as a "
             r"server; serve the build of a CPU or GPU target", _pulled("w4a8-xnnpack", {"model.pte": b"PTE"})),
    ]


def _benchmark_cases() -> list[Case]:
    return [Case("benchmark-unknown-path", lambda d: ["benchmark", "--paths", "nosuch", "--out", "b"],
                 r"weight path 'nosuch' is not built by the quantize stage", copy_project, absent=("b",))]


CASES = [*_manifest_show_cases(), *_ls_cases(), *_pull_cases(), *_select_cases(), *_releases_cases(),
         *_check_cases(), *_patch_verify_cases(), *_serve_cases(), *_benchmark_cases()]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case, tmp_path):
    run_case(case, tmp_path)


# ---------------------------------------------------------------- what is printed

HOSTILE = "Fine.\x1b[2J\x1b]0;owned\x07\rX\x9b31m\u202egnp.exe\u2066\nnext\x00"
"""Escape codes (clear screen, set title, C1 CSI), CR, a bidi override and isolate, a newline, NUL."""


def _hostile_project(d: Path) -> None:
    dvc_project(d)
    write_manifest(d, rationale=HOSTILE)
    lock_naming(d)


@pytest.mark.parametrize("argv", [["manifest", "show"], ["ls"]], ids=" ".join)
def test_manifest_text_cannot_drive_the_terminal(argv, tmp_path):
    proc = run_case(Case(" ".join(argv), lambda d: argv, "", _hostile_project, code=0), tmp_path)
    shown = proc.stdout
    assert not any(c in shown for c in "\x1b\x07\r\x9b\u202e\u2066\x00"), shown
    if argv == ["manifest", "show"]:
        assert "Fine.\\x1b[2J\\x1b]0;owned\\x07\\x0dX\\x9b31m\\u202egnp.exe\\u2066\\x0anext\\x00" in shown
    else:
        assert "gpu" in shown and "avx2" in shown


# ---------------------------------------------------------------- read-only commands

READ_ONLY_COMMANDS = [
    ["ls"], ["ls", "--json"], ["manifest", "show"], ["manifest", "show", "manifest.json"],
    ["select", "--profile", "profiles/x86-avx2.json"],
    ["select", "--target", "host", "--profile", "profiles/x86-avx2.json", "--model", "build/model/model.json"],
    ["images", "plan"], ["images", "plan", "--json"], ["images", "bake"],
    ["release", "--dry-run"],
]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A committed clone of a small project: params.yaml, profiles/, a model record,
    selections, a manifest its dvc.lock names (in DVC's cache), as `dvc repro` leaves
    it; without .dvc/tmp, which git does not carry."""
    project = tmp_path_factory.mktemp("clone")
    copy_project(project)
    ls_project(project)
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a clone"], cwd=project,
                   check=True)
    shutil.rmtree(project / ".dvc" / "tmp")
    return project


def _tree(d: Path) -> dict[str, tuple]:
    """Every path under ``d`` with its mode, size, mtime and (a file's) content digest."""
    seen = {}
    for path in sorted([d, *d.rglob("*")]):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else None
        seen[str(path.relative_to(d))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return seen


@pytest.mark.parametrize("read_only", [False, True], ids=["watched", "chmod-a-w"])
@pytest.mark.parametrize("argv", READ_ONLY_COMMANDS, ids=" ".join)
def test_read_only_commands_write_nothing_in_the_project(argv, read_only, clone):
    """Each read-only command succeeds in the clone and leaves every file and folder of
    it as it was; made read-only (chmod -R a-w), it still succeeds."""
    if read_only and os.geteuid() == 0:
        pytest.skip("root writes through chmod a-w; the watched run checks the same command")
    if read_only:
        subprocess.run(["chmod", "-R", "a-w", str(clone)], check=True)
    try:
        before = _tree(clone)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([*EDGEPATH, *argv], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        after = _tree(clone)
        changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
        assert not changed, f"`edgepath {' '.join(argv)}` changed {changed}"
    finally:
        if read_only:
            subprocess.run(["chmod", "-R", "u+w", str(clone)], check=True)
