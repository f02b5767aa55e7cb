"""The Jane Austen corpus, read from the real janeaustenr package that
scripts/fetch_corpora.sh installs under the venv (scripts/setup.sh runs it)."""

import shutil
import sys
from pathlib import Path

import pytest

from edgepath.core.errors import EdgepathError
from edgepath.text import corpus

PACKAGE = Path(sys.prefix) / "share" / "edgepath" / "corpora" / "janeaustenr"

# Title line, then a line from the first chapter; line counts as R's
# length(janeaustenr::emma) etc. give them (73,422 in all, austen_books()'s rows).
KNOWN = {
    "emma": ("EMMA", "Emma Woodhouse, handsome, clever, and rich, with a comfortable home", 16235),
    "mansfieldpark": ("MANSFIELD PARK",
                      "About thirty years ago Miss Maria Ward, of Huntingdon, with only seven",
                      15349),
    "northangerabbey": ("NORTHANGER ABBEY",
                        "No one who had ever seen Catherine Morland in her infancy would have",
                        7856),
    "persuasion": ("Persuasion",
                   "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who,", 8328),
    "prideprejudice": ("PRIDE AND PREJUDICE",
                       "It is a truth universally acknowledged, that a single man in possession",
                       13030),
    "sensesensibility": ("SENSE AND SENSIBILITY",
                         "The family of Dashwood had long been settled in Sussex.  Their estate",
                         12624),
}


# The six texts' corpus_digest, as the committed reports record it
# (benchmarks/results/quantize.json, phone.json: calibration.corpus_sha256).
RECORDED_DIGEST = "sha256:53797c8aac767d028574b25186f3bf427b753cb140f50a8f4b532264b2160d7a"


@pytest.fixture(scope="module")
def novels() -> dict[str, str]:
    return corpus.austen_novels()


def test_six_novels_with_their_openings(novels):
    assert sorted(novels) == sorted(KNOWN) == sorted(corpus.NOVELS)
    for title, (first_line, opening, lines) in KNOWN.items():
        text = novels[title]
        assert 400_000 < len(text) < 1_000_000, title
        assert text.split("\n")[0] == first_line
        assert opening in text.split("\n"), title
        assert text.count("\n") + 1 == lines, title
    assert "her £20,000" in novels["mansfieldpark"]  # a UTF-8-flagged string, decoded


def test_explicit_root_matches_default(novels):
    assert corpus.austen_novels(PACKAGE) == novels


def test_digest_stable_and_sensitive(novels):
    digest = corpus.corpus_digest(novels)
    assert digest == RECORDED_DIGEST
    assert corpus.corpus_digest(corpus.austen_novels()) == digest
    assert corpus.corpus_digest(dict(reversed(novels.items()))) == digest
    changed = dict(novels, emma=novels["emma"] + ".")
    assert corpus.corpus_digest(changed) != digest
    renamed = {("emma2" if t == "emma" else t): text for t, text in novels.items()}
    assert corpus.corpus_digest(renamed) != digest


@pytest.fixture()
def package_copy(tmp_path) -> Path:
    return Path(shutil.copytree(PACKAGE, tmp_path / "janeaustenr"))


def test_truncated_rdb_is_refused(package_copy):
    rdb = package_copy / "data" / "Rdata.rdb"
    with open(rdb, "r+b") as f:
        f.truncate(rdb.stat().st_size // 2)
    with pytest.raises(EdgepathError, match="truncated") as e:
        corpus.austen_novels(package_copy)
    assert str(rdb) in str(e.value)


def test_corrupt_rdb_is_refused(package_copy):
    rdb = package_copy / "data" / "Rdata.rdb"
    data = bytearray(rdb.read_bytes())
    data[1000:1100] = bytes(100)  # inside the first entry's zlib stream
    rdb.write_bytes(bytes(data))
    with pytest.raises(EdgepathError, match="corrupt") as e:
        corpus.austen_novels(package_copy)
    assert str(rdb) in str(e.value)


def test_unsupported_sexp_type_is_named():
    # The package's help database holds a type (247, PERSISTSXP) rdata does not read.
    rdb = PACKAGE / "help" / "janeaustenr.rdb"
    with pytest.raises(EdgepathError, match="not an R object rdata reads.*247") as e:
        corpus.read_lazyload_db(PACKAGE / "help" / "janeaustenr")
    assert str(rdb) in str(e.value)


def test_missing_corpus_names_the_fix(tmp_path):
    with pytest.raises(EdgepathError, match="fetch_corpora.sh") as e:
        corpus.austen_novels(tmp_path / "nowhere")
    assert "corpus missing" in str(e.value) and str(tmp_path / "nowhere") in str(e.value)
