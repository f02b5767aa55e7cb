"""Reading what a user hands edgepath: regular files only, bounded, one clear error.

Every file edgepath reads from outside its own process (records, profiles, configs,
tokenizers, ``params.yaml``, captured ``/proc`` files) goes through ``read_bytes``:
it opens without blocking (a FIFO cannot hang the command), refuses anything that is
not a regular file (a directory, a FIFO, ``/dev/zero`` behind a symlink) and anything
over a stated size limit, and turns each operating-system error into an
``EdgepathError`` that names the file. ``read_json`` and ``read_yaml`` add the
document's own checks: valid UTF-8, valid syntax, a bounded nesting depth, an object
where one is expected, unique keys; YAML with keys that are strings as written and
no aliases.

``describe`` is the CLI's last line of defence (``command.call``): an expected failure
that escaped a reader (an OS error while writing, say) still leaves the command as one
line, never a traceback.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from .errors import EdgepathError, one_line

MAX_DOCUMENT_BYTES = 64 << 20
"""The most edgepath reads of one JSON or YAML document: the largest it reads is a
tokenizer.json (Llama 3's 128k-token vocabulary: 9 MB; SmolLM2's: 2 MB), the records
are kilobytes."""
READ_BLOCK = 1 << 20
MAX_DEPTH = 64
"""Nesting a document may have: the records nest 7 levels, tokenizers fewer."""


def path_of(text: str | os.PathLike, what: str = "path") -> Path:
    """``text`` as a path, ``~`` expanded; an empty path or an unknown ``~user`` is
    refused by name."""
    if not str(text):
        raise EdgepathError(f"{what}: empty path")
    try:
        return Path(text).expanduser()
    except RuntimeError as e:  # Path.expanduser: "Could not determine home directory"
        raise EdgepathError(f"{text}: {e} (no such user)") from None


def open_regular(path: str | os.PathLike, missing: str = "") -> BinaryIO:
    """``path`` opened for binary reading, refused (naming it) unless it is a regular
    file: opened without blocking, so a FIFO is refused rather than waited on, and
    checked on the open file, so nothing can swap it in between. ``missing``: what to
    add after "no such file" (how to make it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if e.errno == errno.ENOENT and missing:
            raise EdgepathError(f"{path}: no such file ({missing})") from None
        raise EdgepathError(describe_os_error(e, path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise EdgepathError(f"{path}: {_kind(mode)}, not a regular file; edgepath reads regular files only")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES, missing: str = "") -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), at most ``limit`` of them."""
    chunks, size = [], 0
    with open_regular(path, missing) as f:
        if (st_size := os.fstat(f.fileno()).st_size) > limit:
            raise EdgepathError(f"{path}: {st_size} bytes, over the {limit} bytes edgepath reads from such a file")
        try:
            # In blocks, not one read of the limit: /proc/sys files refuse a read of 4 MiB
            # or more (ENOMEM), and a small file should not cost the limit in memory.
            while size <= limit and (chunk := f.read(READ_BLOCK)):
                chunks.append(chunk)
                size += len(chunk)
        except OSError as e:
            raise EdgepathError(describe_os_error(e, path)) from None
    data = b"".join(chunks)
    if len(data) > limit:  # grew while read
        raise EdgepathError(f"{path}: over the {limit} bytes edgepath reads from such a file")
    return data


def read_text(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES, missing: str = "") -> str:
    """``read_bytes`` decoded as UTF-8; other bytes are refused naming the file."""
    data = read_bytes(path, limit, missing)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EdgepathError(f"{path}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def loads_json(text: str, where: str, shape: type | None = dict) -> Any:
    """Parse ``text`` (read from ``where``); refuse bad syntax, a key twice in one object
    (JSON readers disagree on which one wins), nesting deeper than ``MAX_DEPTH`` and,
    where ``shape`` is given, a top level of another JSON type."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise EdgepathError(f"{where}: key {e.args[0]!r} appears twice in one JSON object") from None
    except json.JSONDecodeError as e:
        raise EdgepathError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise EdgepathError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels") from None
    check_depth(data, where, "JSON")
    if shape is not None and not isinstance(data, shape):
        raise EdgepathError(f"{where}: a JSON {_json_type(data)} where a JSON {_json_type(shape())} is expected")
    return data


class _RepeatedKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise _RepeatedKey(next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])))
    return found


def read_json(path: str | os.PathLike, shape: type | None = dict, limit: int = MAX_DOCUMENT_BYTES,
              missing: str = "") -> Any:
    """A JSON document from a regular file (``read_text`` + ``loads_json``)."""
    return loads_json(read_text(path, limit, missing), str(path), shape)


def read_yaml(path: str | os.PathLike, limit: int = MAX_DOCUMENT_BYTES, missing: str = "") -> Any:
    """A YAML document from a regular file, with YAML's safe types only, unique keys
    (DVC refuses a file with a repeated key too) and every key a string as written: a
    key YAML would read as another type (``on``, ``no``, ``1``, ``2024-01-01``) is
    refused as written, not renamed ``True``."""
    import yaml

    text = read_text(path, limit, missing)
    try:
        data = yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as e:
        raise EdgepathError(f"{path}: not valid YAML ({one_line(e)})") from None
    except RecursionError:
        raise EdgepathError(f"{path}: YAML nested deeper than {MAX_DEPTH} levels") from None
    check_depth(data, str(path), "YAML")
    return data


def check_depth(data: Any, where: str, what: str) -> None:
    """Refuse a document nested deeper than ``MAX_DEPTH`` (iteratively: a deep document
    must not exhaust the stack of whatever walks it next, e.g. the schema check)."""
    level = [data] if isinstance(data, (dict, list)) else []
    for _ in range(MAX_DEPTH):
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list))]
        if not level:
            return
    raise EdgepathError(f"{where}: {what} nested deeper than {MAX_DEPTH} levels")


def describe(error: BaseException) -> str | None:
    """One line for an expected failure (``EdgepathError``, an OS error, a decoding
    error, nesting too deep), or None for anything else (a bug: let it show)."""
    if isinstance(error, EdgepathError):
        return str(error)
    if isinstance(error, OSError):
        return describe_os_error(error, error.filename)
    if isinstance(error, UnicodeError):
        return f"not UTF-8 text ({error})"
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error})"
    if isinstance(error, RecursionError):
        return "input nested too deeply to read"
    if isinstance(error, RuntimeError) and str(error).startswith("Symlink loop"):  # Path.resolve's own
        return f"{str(error).removeprefix('Symlink loop from ')}: too many levels of symbolic links (a symlink loop)"
    if type(error).__module__.split(".")[0] == "yaml":
        return f"not valid YAML ({one_line(error)})"
    return None


def describe_os_error(error: OSError, path: str | os.PathLike | None) -> str:
    reason = {errno.ENOENT: "no such file or directory", errno.EACCES: "permission denied",
              errno.EISDIR: "is a directory, not a file", errno.ENOTDIR: "a part of the path is not a directory",
              errno.ELOOP: "too many levels of symbolic links (a symlink loop?)",
              errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only file system",
              errno.ENAMETOOLONG: "file name too long"}.get(error.errno, error.strerror or str(error))
    where = path if path is not None else error.filename
    return f"{where}: {reason}" if where is not None else reason


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


@functools.cache
def _strict_loader():
    """yaml.SafeLoader refusing aliases, repeated keys and keys that are not strings as
    written. An alias refers to a node instead of copying it, but whatever walks the
    document after (the depth check, the schema) meets it once per reference: nine
    levels of ten references each is a kilobyte file that no walk finishes. No file
    edgepath reads needs one."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"alias *{event.anchor} on line {event.start_mark.line + 1}: edgepath's YAML files "
                    f"take no aliases; write the value out", event.start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen: dict[str, int] = {}
            for key_node, _ in node.value:
                line = key_node.start_mark.line + 1
                if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == "tag:yaml.org,2002:str"):
                    shown = key_node.value if isinstance(key_node, yaml.ScalarNode) else "(a collection)"
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {shown!r} on line {line} is not a string in YAML (it reads as "
                        f"{key_node.tag.rsplit(':', 1)[-1]}); quote it: '{shown}':", key_node.start_mark)
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} appears twice (lines {seen[key_node.value]} and {line})",
                        key_node.start_mark)
                seen[key_node.value] = line
            return super().construct_mapping(node, deep)

    return StrictLoader


def safe_relative(path: str, what: str) -> str:
    """``path`` if it is relative and stays inside its base (no ``..``, no
    absolute path, no empty or ``.`` part); otherwise refuse it."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or os.path.isabs(path)
            or any(p in ("", ".", "..") for p in parts)):
        raise EdgepathError(f"{what}: refused path {path!r}: it would leave its directory")
    return path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The sha256 of the regular file ``path`` (a FIFO or a device is refused by
    name: hashing one would hang or never end)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_OVERLAPS_READS = "overlaps what this command reads ({source}); write the output elsewhere"


def check_replaceable_directory(out: str | os.PathLike, is_own: Callable[[Path], bool], not_own: str, *,
                                reads: Iterable[str | os.PathLike] = (), overlap: str = _OVERLAPS_READS,
                                may_lie_inside_reads: bool = False) -> Path:
    """``out`` as an absolute path, where a command may build a directory that replaces
    what is there; refused before anything is written, naming why: the current
    directory or one above it; a place that is or holds one of ``reads`` (what the
    command reads), or lies inside one unless ``may_lie_inside_reads`` (``overlap``
    says so, with ``{source}``); an existing file or symlink; a directory of files that
    ``is_own`` does not take for an earlier output of the same command (``not_own``
    completes that refusal, with ``{shown}``: the first entries). Every command that
    replaces a directory asks this one question."""
    place = Path(os.path.abspath(out))
    if place == Path.cwd() or place in Path.cwd().parents:
        raise EdgepathError(f"{out}: is the current directory or one above it; name a directory of its own")
    for source in reads:
        # realpath, not Path.resolve: a symlink loop stays a path (its reader names the
        # loop) instead of a RuntimeError
        for a, b in ((place, Path(os.path.abspath(source))), (Path(os.path.realpath(place)),
                                                              Path(os.path.realpath(source)))):
            if a == b or a in b.parents or (b in a.parents and not may_lie_inside_reads):
                raise EdgepathError(f"{out}: " + overlap.format(source=source))
    if place.is_symlink() or place.exists():
        if place.is_symlink():  # replacing it would replace the link, not write where it points
            raise EdgepathError(f"{out}: is a symbolic link; not replaced (name the directory it points to, "
                                f"{os.path.realpath(place)}, or write elsewhere)")
        if not place.is_dir():
            raise EdgepathError(f"{out}: exists and is not a directory; not replaced (remove it, or write elsewhere)")
        entries = sorted(p.name for p in place.iterdir())
        if entries and not is_own(place):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise EdgepathError(f"{out}: holds files {not_own.format(shown=shown)}; not replaced "
                                f"(remove it, or write elsewhere)")
    return place
