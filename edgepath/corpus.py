"""Offline text corpora for calibration and evaluation: Jane Austen's six novels.

The texts (public domain) come from Debian's package ``r-cran-janeaustenr``,
which ``scripts/fetch_corpora.sh`` (run by ``scripts/setup.sh``) unpacks into
``.venv/share/edgepath/corpora/janeaustenr``. They sit there in an R lazy-load
database, read here with the standard library only; R is not needed.

Byte layout (every integer is big-endian)
-----------------------------------------
``data/Rdata.rdx``, the index, is a ``saveRDS`` file: a gzip stream of one R
serialization, a list named ``variables``, ``references``, ``compressed``.
``variables`` maps each object's name to an integer pair ``(offset, length)``
into ``data/Rdata.rdb``; ``compressed`` is TRUE for zlib (2, bzip2, and 3, xz,
prefix a type byte and are refused).

``data/Rdata.rdb`` holds the objects back to back. The entry at ``offset``,
``length`` bytes long, is a uint32 (the serialization's uncompressed size)
followed by a zlib stream of the serialization.

A serialization (R's XDR format) is ``b"X\\n"``; int32 format version (2 or
3), int32 writer R version, int32 oldest R version that reads it; for version
3 only, int32 ``n`` and ``n`` bytes naming the writer's native encoding; then
one item. An item starts with int32 flags: type (bits 0-7), is-object (bit 8),
has-attributes (bit 9), has-tag (bit 10), levels (bits 12-27). Then, by type:

- NILVALUE_SXP (254): nothing (R's ``NULL``).
- REFSXP (255): ``flags >> 8`` is a 1-based index into the table of symbols
  read so far; 0 means an int32 index follows.
- SYMSXP (1): one item, the symbol's CHARSXP name; the symbol joins the table.
- LISTSXP (2), a pairlist cell: attributes item if has-attributes, tag item
  (a symbol) if has-tag, the value item, then the rest of the list (an item,
  NILVALUE_SXP at the end).
- CHARSXP (9): int32 ``n``, then ``n`` bytes; ``n == -1`` is NA. The levels
  give the encoding: bit 2 latin1, bit 3 UTF-8, bit 6 ASCII, bit 1 raw bytes
  (refused); none is the native encoding.
- LGLSXP (10), INTSXP (13): int32 ``n``, ``n`` int32 (NA is -2**31).
- REALSXP (14): int32 ``n``, ``n`` IEEE float64.
- STRSXP (16): int32 ``n``, ``n`` CHARSXP items.
- VECSXP (19), a list: int32 ``n``, ``n`` items.

``n == -1`` for a vector is a long vector: int32 high and low words follow.
A vector's attributes (``names``, ``class``, ``row.names``, ...) follow its
elements as one pairlist item, if has-attributes. Any other type is refused,
naming the file.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import EdgepathError

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")
_PACKAGE = "janeaustenr"

NILVALUE, REF, SYM, LIST, CHAR = 254, 255, 1, 2, 9
LGL, INT, REAL, STR, VEC = 10, 13, 14, 16, 19
_VECTOR_FORMATS = {LGL: ("i", 4), INT: ("i", 4), REAL: ("d", 8)}
_CHAR_ENCODINGS = {1 << 2: "latin-1", 1 << 3: "utf-8", 1 << 6: "ascii"}
_BYTES_MASK = 1 << 1


@dataclass(frozen=True)
class Symbol:
    """An R symbol: a pairlist tag (``names``, ``class``) or a symbol value."""

    name: str


class Vector(list):
    """An R vector's elements, plus its attributes by name (``names``, ``class``, ...)."""

    def __init__(self, items: list, attributes: dict[str, Any]):
        super().__init__(items)
        self.attributes = attributes


def named(vector: Vector) -> dict[str, Any]:
    """A vector with a ``names`` attribute as a dict, name -> element."""
    return dict(zip(vector.attributes.get("names", []), vector))


class _Unserializer:
    """One R XDR serialization being read: its bytes, a cursor, the symbol table."""

    def __init__(self, data: bytes, source: Path):
        self.data, self.source, self.pos, self.refs = data, source, 0, []
        self.native = "utf-8"  # version 2 does not say; every current R writes UTF-8

    def fail(self, problem: str) -> EdgepathError:
        return EdgepathError(f"{self.source}: {problem}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise self.fail(f"R serialization truncated or corrupt at byte {self.pos} "
                            f"(a length of {n} bytes, {len(self.data) - self.pos} left)")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def numbers(self, n: int, fmt: str = "i", size: int = 4) -> tuple:
        return struct.unpack(f">{n}{fmt}", self.take(n * size))

    def int32(self) -> int:
        return self.numbers(1)[0]

    def read(self) -> Any:
        """Check the header, then read the one item it precedes."""
        if self.take(2) != b"X\n":
            raise self.fail("not an R XDR serialization (format is not 'X\\n')")
        version, _writer, _reader = self.numbers(3)
        if version not in (2, 3):
            raise self.fail(f"R serialization version {version} is not 2 or 3")
        if version == 3:
            self.native = self.take(self.int32()).decode("ascii", "replace")
        return self.item()

    def item(self) -> Any:
        flags = self.int32()
        kind, levels = flags & 0xFF, flags >> 12
        has_attributes, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == NILVALUE:
            return None
        if kind == REF:
            index = flags >> 8 or self.int32()
            if not 0 < index <= len(self.refs):
                raise self.fail(f"R reference {index} points past the {len(self.refs)} read")
            return self.refs[index - 1]
        if kind == SYM:
            self.refs.append(Symbol(self.item()))
            return self.refs[-1]
        if kind == LIST:
            return self.pairlist(has_attributes, has_tag)
        if kind == CHAR:
            return self.string(levels)
        if kind in _VECTOR_FORMATS or kind in (STR, VEC):
            items = self.vector(kind)
            return Vector(items, self.attributes() if has_attributes else {})
        raise self.fail(f"unsupported R SEXP type {kind} at byte {self.pos - 4}")

    def pairlist(self, has_attributes: bool, has_tag: bool) -> list[tuple[str | None, Any]]:
        """A pairlist as (tag name or None, value) pairs; the cell's own attributes
        are read (their place in the stream is fixed) and dropped."""
        if has_attributes:
            self.item()
        tag = self.item() if has_tag else None
        if tag is not None and not isinstance(tag, Symbol):
            raise self.fail("R pairlist tag is not a symbol")
        cells = [(tag.name if tag else None, self.item())]
        rest = self.item()
        if rest is not None and type(rest) is not list:  # a Vector is a list too
            raise self.fail("R pairlist does not end in NULL")
        return cells + (rest or [])

    def attributes(self) -> dict[str, Any]:
        cells = self.item()
        if type(cells) is not list or any(tag is None for tag, _ in cells):
            raise self.fail("R attributes are not a tagged pairlist")
        return dict(cells)

    def string(self, levels: int) -> str | None:
        n = self.int32()
        if n == -1:
            return None
        if levels & _BYTES_MASK:
            raise self.fail("R string marked as raw bytes has no text encoding")
        encoding = next((e for mask, e in _CHAR_ENCODINGS.items() if levels & mask), self.native)
        try:
            return self.take(n).decode(encoding)
        except (LookupError, UnicodeDecodeError) as e:
            raise self.fail(f"R string is not valid {encoding}: {e}") from None

    def vector(self, kind: int) -> list:
        n = self.int32()
        if n == -1:
            high, low = self.numbers(2, "I")
            n = high << 32 | low
        if kind in _VECTOR_FORMATS:
            return list(self.numbers(n, *_VECTOR_FORMATS[kind]))
        return [self.item() for _ in range(n)]


def unserialize(data: bytes, source: Path) -> Any:
    """One R XDR serialization as Python values: NULL -> None, symbol -> Symbol,
    pairlist -> [(tag, value)], string NA -> None, vector -> Vector."""
    return _Unserializer(data, source).read()


def read_lazyload_db(base: Path) -> dict[str, Any]:
    """Every object in the lazy-load database ``base``.rdx/.rdb, by name."""
    rdx, rdb = base.with_suffix(".rdx"), base.with_suffix(".rdb")
    try:
        index = named(unserialize(gzip.decompress(rdx.read_bytes()), rdx))
        variables = named(index["variables"])
        blob = rdb.read_bytes()
    except (OSError, EOFError, zlib.error, KeyError, AttributeError) as e:
        raise EdgepathError(f"{rdx}: not a readable R lazy-load database ({e})") from None
    if index.get("compressed") != [1]:
        raise EdgepathError(f"{rdx}: only zlib-compressed databases are read "
                            f"(compressed = {index.get('compressed')})")
    if not all(isinstance(w, Vector) and len(w) == 2 for w in variables.values()):
        raise EdgepathError(f"{rdx}: an index entry is not an (offset, length) pair")
    return {name: _entry(blob, rdb, *where) for name, where in variables.items()}


def _entry(blob: bytes, rdb: Path, offset: int, length: int) -> Any:
    raw = blob[offset:offset + length]
    if len(raw) != length or length < 4:
        raise EdgepathError(f"{rdb}: truncated: the entry at byte {offset} needs {length} "
                            f"bytes, the file has {len(raw)} there")
    try:
        data = zlib.decompress(raw[4:])
    except zlib.error as e:
        raise EdgepathError(f"{rdb}: corrupt entry at byte {offset}: {e}") from None
    if len(data) != struct.unpack(">I", raw[:4])[0]:
        raise EdgepathError(f"{rdb}: entry at byte {offset} does not have its recorded size")
    return unserialize(data, rdb)


def _package_dir(root: Path | None) -> Path:
    candidates = [root] if root is not None else [
        Path(sys.prefix) / "share" / "edgepath" / "corpora" / _PACKAGE,
        Path("/usr/lib/R/site-library") / _PACKAGE,
    ]
    for d in candidates:
        if (d / "data" / "Rdata.rdx").is_file() and (d / "data" / "Rdata.rdb").is_file():
            return d
    raise EdgepathError(
        "Jane Austen corpus missing: no data/Rdata.rdx and data/Rdata.rdb under "
        + ", ".join(map(str, candidates))
        + "; scripts/fetch_corpora.sh (run by scripts/setup.sh) installs it")


def austen_novels(root: Path | None = None) -> dict[str, str]:
    """The six novels, object name (``emma``, ...) -> full text, lines joined by "\\n".

    ``root`` is the janeaustenr package directory; by default the one
    ``scripts/fetch_corpora.sh`` installs under ``sys.prefix``, else a
    system-wide R library's."""
    rdata = _package_dir(root) / "data" / "Rdata"
    objects = read_lazyload_db(rdata)
    texts = {}
    for title in NOVELS:
        lines = objects.get(title)
        if not isinstance(lines, Vector) or not all(isinstance(s, str) for s in lines):
            raise EdgepathError(f"{rdata}.rdb: {title} is missing or not a character "
                                "vector without NAs")
        texts[title] = "\n".join(lines)
    return texts


def corpus_digest(texts: dict[str, str]) -> str:
    """sha256 over the titles and texts in title order: a stable record of which
    texts a report used."""
    canonical = json.dumps(sorted(texts.items()), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
