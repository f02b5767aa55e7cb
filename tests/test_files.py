"""The readers every user-supplied file goes through, the CLI's error boundary, and the
rules for replacing an output (edgepath.core.files, edgepath.core.command.call, records.write,
records.output_directory, atomic)."""

import argparse
import json
import os
import threading

import pytest

from edgepath.core import atomic, command, files, records
from edgepath.core.errors import EdgepathError

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
AS_ROOT = "root reads files whatever their mode, so a permission error cannot be made"


def _fifo(path):
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "a directory, not a regular file"),
    (lambda p: _fifo(p), "a FIFO, not a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), "a character device, not a regular file"),
    (lambda p: p.symlink_to(p), "symlink loop"),
    (lambda p: None, "no such file or directory"),
], ids=["directory", "fifo", "dev-zero", "symlink-loop", "missing"])
def test_read_bytes_takes_regular_files_only(tmp_path, make, message):
    path = tmp_path / "x.json"
    make(path)
    result = {}
    reader = threading.Thread(target=lambda: result.setdefault("error", _error(lambda: files.read_bytes(path))))
    reader.start()
    reader.join(timeout=10)  # a FIFO opened for reading would block forever without O_NONBLOCK
    assert not reader.is_alive(), "read_bytes hung"
    assert message in result["error"] and str(path) in result["error"]


def _error(call) -> str:
    try:
        call()
    except EdgepathError as e:
        return str(e)
    return "(no error)"


def test_read_bytes_refuses_a_file_over_the_limit_and_reads_one_at_it(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(b"x" * 101)
    with pytest.raises(EdgepathError, match="101 bytes, over the 100 bytes"):
        files.read_bytes(path, limit=100)
    assert files.read_bytes(path, limit=101) == b"x" * 101


@pytest.mark.skipif(IS_ROOT, reason=AS_ROOT)
def test_permission_denied_is_named(tmp_path):
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(EdgepathError, match=f"{path}: permission denied"):
        files.read_json(path)


def test_missing_file_says_how_to_make_it(tmp_path):
    with pytest.raises(EdgepathError, match=r"no such file \(run the probe\)"):
        files.read_json(tmp_path / "p.json", missing="run the probe")


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe\x00garbage", "not UTF-8 text"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "a JSON array where a JSON object is expected"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 64 levels"),
    (json.dumps(_nested := {"a": None}).encode(), None),
], ids=["binary", "syntax", "list", "deep", "object"])
def test_read_json(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_bytes(content)
    if message is None:
        assert files.read_json(path) == {"a": None}
    else:
        with pytest.raises(EdgepathError, match=message):
            files.read_json(path)


def test_depth_limit_is_exact():
    deep = current = {}
    for _ in range(files.MAX_DEPTH - 1):
        current["k"] = current = {}
    files.check_depth(deep, "d", "JSON")  # MAX_DEPTH levels of objects: accepted
    current["k"] = {}
    with pytest.raises(EdgepathError, match="nested deeper"):
        files.check_depth(deep, "d", "JSON")


@pytest.mark.parametrize("text, message", [
    ("a: 1\nb: 2\na: 3\n", r"key 'a' appears twice \(lines 1 and 3\)"),
    ("targets:\n  on: {}\n", r"key 'on' on line 2 is not a string in YAML \(it reads as bool\)"),
    ("targets:\n  1: {}\n", r"key '1' on line 2 is not a string in YAML \(it reads as int\)"),
    ("a: [1\n", "not valid YAML"),
    ("\x00\x01binary", "not valid YAML"),
], ids=["duplicate", "bool-key", "int-key", "syntax", "binary"])
def test_read_yaml_is_strict(tmp_path, text, message):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(EdgepathError, match=message):
        files.read_yaml(path)


def test_read_yaml_keeps_quoted_keys_and_safe_values(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("targets:\n  'on': {x: yes}\n")
    assert files.read_yaml(path) == {"targets": {"on": {"x": True}}}


@pytest.mark.parametrize("text, message", [("", "empty path"), ("~no-such-user-edgepath/x", "no such user")])
def test_path_of(text, message):
    with pytest.raises(EdgepathError, match=message):
        files.path_of(text)


# ---------------------------------------------------------------- the CLI's boundary

def _call(handler) -> int:
    return command.call("demo", argparse.Namespace(handler=handler))


@pytest.mark.parametrize("error, line", [
    (EdgepathError("x.json: bad"), "edgepath demo: error: x.json: bad"),
    (PermissionError(13, "Permission denied", "/p/x"), "edgepath demo: error: /p/x: permission denied"),
    (IsADirectoryError(21, "Is a directory", "/p/d"), "edgepath demo: error: /p/d: is a directory, not a file"),
    (RecursionError(), "edgepath demo: error: input nested too deeply to read"),
], ids=["edgepath", "permission", "directory", "recursion"])
def test_call_turns_expected_failures_into_one_line(capsys, error, line):
    def handler(_):
        raise error
    assert _call(handler) == 2
    assert capsys.readouterr().err == line + "\n"


def test_call_prints_what_a_file_says_escaped(capsys):
    def handler(_):
        raise EdgepathError("params.yaml: targets.x\n\x1b[2J\u202e: bad")
    assert _call(handler) == 2
    assert capsys.readouterr().err == "edgepath demo: error: params.yaml: targets.x\\x0a\\x1b[2J\\u202e: bad\n"


def test_call_lets_a_bug_keep_its_traceback():
    def handler(_):
        raise KeyError("a bug")
    with pytest.raises(KeyError):
        _call(handler)


def test_call_on_interrupt(capsys):
    def handler(_):
        raise KeyboardInterrupt
    assert _call(handler) == 130
    assert "interrupted" in capsys.readouterr().err


# ---------------------------------------------------------------- replacing outputs

PROFILE = {"kind": "edgepath.profile", "schema_version": 1}


def _probe_record():
    from edgepath.stages import probe
    return probe.probe("/").to_dict()


def test_records_write_replaces_its_own_kind_only(tmp_path):
    record = _probe_record()
    out = tmp_path / "p.json"
    records.write(out, "profile", record)
    records.write(out, "profile", record)  # its own earlier output: replaced
    out.write_text(json.dumps({**PROFILE, "kind": "edgepath.selection"}))
    with pytest.raises(EdgepathError, match="not an edgepath profile record; not replaced"):
        records.write(out, "profile", record)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(EdgepathError, match="not replaced"):
        records.write(tmp_path / "notes.txt", "profile", record)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(EdgepathError, match="not replaced"):
        records.write(tmp_path, "profile", record)


def _model_record_dir(d):
    d.mkdir()
    (d / "model.json").write_text(json.dumps({"kind": "edgepath.model", "schema_version": 1}))
    (d / "hf").mkdir()
    return d


def test_output_directory_replaces_its_own_output_or_an_empty_one(tmp_path):
    own = _model_record_dir(tmp_path / "own")
    for out in (own, tmp_path / "empty", tmp_path / "new" / "deeper"):
        if out.name == "empty":
            out.mkdir()
        with records.output_directory(out, "model") as scratch:
            (scratch / "model.json").write_text("{}")
        assert sorted(p.name for p in out.iterdir()) == ["model.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new", "own"]  # no .tmp/.old left


@pytest.mark.parametrize("setup, out, sources, message", [
    (lambda d: (d / "mine").mkdir() or (d / "mine" / "thesis.tex").write_text("x"), "mine", (),
     r"holds files edgepath did not write there \(thesis.tex\)"),
    (lambda d: (d / "mine").write_text("x"), "mine", (), "exists and is not a directory"),
    (lambda d: (d / "src").mkdir(), "src", ("src",), "overlaps what this command reads"),
    (lambda d: (d / "src").mkdir(), "src/out", ("src",), "overlaps what this command reads"),
    (lambda d: (d / "src").mkdir(), ".", ("src",), "current directory"),
    (lambda d: None, "", (), "empty path"),
], ids=["foreign-dir", "file", "same-as-source", "inside-source", "cwd", "empty"])
def test_output_directory_refuses(tmp_path, monkeypatch, setup, out, sources, message):
    monkeypatch.chdir(tmp_path)
    setup(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(EdgepathError, match=message):
        with records.output_directory(out, "model", sources=sources):
            pytest.fail("the block must not run")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_failed_write_takes_away_the_parents_it_made(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic.directory(tmp_path / "a" / "b" / "out"):
            raise RuntimeError("refused halfway")
    assert list(tmp_path.iterdir()) == []
