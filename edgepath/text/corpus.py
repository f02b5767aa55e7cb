"""Offline text corpora for calibration and evaluation: the ``Document`` every
corpus is made of, and Jane Austen's six novels (the multi-genre mix is
edgepath/text/genres.py's).

The texts (public domain) come from Debian's package ``r-cran-janeaustenr``,
which ``scripts/fetch_corpora.sh`` (run by ``scripts/setup.sh``) unpacks into
``.venv/share/edgepath/corpora/janeaustenr``. They sit there in an R lazy-load
database, read without R: the PyPI package ``rdata`` reads R's serializations,
and the database around them is two files (every integer big-endian):

- ``data/Rdata.rdx``, the index, a ``saveRDS`` file (``rdata.read_rds``): a list
  named ``variables``, ``references``, ``compressed``. ``variables`` maps each
  object's name to an integer pair ``(offset, length)`` into ``data/Rdata.rdb``;
  ``compressed`` is TRUE for zlib (2, bzip2, and 3, xz, prefix a type byte and
  are refused).
- ``data/Rdata.rdb`` holds the objects back to back. The entry at ``offset``,
  ``length`` bytes long, is a uint32 (the serialization's uncompressed size)
  followed by a zlib stream of one R XDR serialization
  (``rdata.parser.parse_data``).

rdata has no reader of lazy-load databases, hence the index and entry handling
here. It gives each novel as a numpy array of its lines; joined, they are the
texts R's ``janeaustenr::emma`` etc. hold (the line counts and openings in
tests/test_corpus.py), and their ``corpus_digest`` is the one the committed
reports record (benchmarks/results/*.json; pinned in tests/test_corpus.py). A
database or object rdata cannot read is refused, naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

from ..core import files
from ..core.errors import EdgepathError

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")
_PACKAGE = "janeaustenr"


@dataclasses.dataclass(frozen=True)
class Document:
    """One unit of a corpus's split: calibrated on or held out (``held_out``), never
    both. Prose, code and the like are ``text``; dialogue is ``conversations``, each a
    tuple of ``{"role", "content"}`` messages, rendered through the model's own chat
    template where tokenized. ``origin``: where it was read (``package==version:
    path``), ``license``: under which terms."""

    genre: str
    held_out: bool
    origin: str
    license: str
    text: str = ""
    conversations: tuple = ()

    def __post_init__(self):
        if bool(self.text) == bool(self.conversations):
            raise ValueError(f"{self.origin}: a document is text or conversations, exactly one")

    @property
    def content(self) -> str:
        """What ``corpus_digest`` covers: the text, or the conversations as JSON."""
        return self.text or json.dumps(self.conversations, ensure_ascii=False)


def read_lazyload_db(base: Path) -> dict[str, Any]:
    """Every object in the lazy-load database ``base``.rdx/.rdb, by name, as rdata
    converts it (a character vector: a numpy array of str)."""
    import rdata

    rdx, rdb = base.with_suffix(".rdx"), base.with_suffix(".rdb")
    index_bytes, blob = files.read_bytes(rdx), files.read_bytes(rdb)  # regular files, bounded
    try:
        index = rdata.read_rds(io.BytesIO(index_bytes))
        variables, compressed = index["variables"], index.get("compressed")
    except Exception as e:  # rdata's parse errors are ValueError, IndexError, NotImplementedError, ...
        raise EdgepathError(f"{rdx}: not a readable R lazy-load database ({type(e).__name__}: {e})") from None
    if compressed is None or list(compressed) != [True]:
        raise EdgepathError(f"{rdx}: only zlib-compressed databases are read (compressed = {compressed})")
    if not isinstance(variables, dict) or not all(len(w) == 2 for w in variables.values()):
        raise EdgepathError(f"{rdx}: an index entry is not an (offset, length) pair")
    return {str(name): _entry(blob, rdb, int(offset), int(length)) for name, (offset, length) in variables.items()}


def _entry(blob: bytes, rdb: Path, offset: int, length: int) -> Any:
    import rdata

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
    try:
        return rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))
    except Exception as e:  # as above: whatever rdata's parser or converter raises
        raise EdgepathError(f"{rdb}: the entry at byte {offset} is not an R object rdata reads "
                            f"({type(e).__name__}: {e})") from None


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
    database = _package_dir(root) / "data" / "Rdata"
    objects = read_lazyload_db(database)
    texts = {}
    for title in NOVELS:
        lines = objects.get(title)
        # a character vector with an NA is an object array (None for the NA), not a str one
        if getattr(lines, "dtype", None) is None or lines.dtype.kind != "U" or lines.ndim != 1:
            raise EdgepathError(f"{database}.rdb: {title} is missing or not a character "
                                "vector without NAs")
        texts[title] = "\n".join(lines.tolist())
    return texts


def corpus_digest(texts: dict[str, str]) -> str:
    """sha256 over the titles and texts in title order: a stable record of which
    texts a report used."""
    canonical = json.dumps(sorted(texts.items()), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
