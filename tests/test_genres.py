"""The multi-genre corpus (calibration.corpus: mix), read from the real files
scripts/fetch_corpora.sh fetches: under the venv by default, or in the directory
EDGEPATH_TEST_CORPORA names (the DEST it was given). Skipped, saying so, where it
has not been fetched."""

import dataclasses
import gzip
import os
import shutil
from pathlib import Path

import pytest

from edgepath.core.errors import EdgepathError
from edgepath.text import calibration, genres
from edgepath.text.calibration import Corpus

ROOT = Path(os.environ.get("EDGEPATH_TEST_CORPORA") or genres.default_root())
pytestmark = pytest.mark.skipif(not (ROOT / "mix" / "corpora.lock").is_file(),
                                reason=f"multi-genre corpus not fetched into {ROOT} (scripts/fetch_corpora.sh)")

HELD_OUT = {
    "prose": {"persuasion", "war-of-the-worlds", "alice"},
    "code": {"click-code", "brotli-decoder"},
    "docs": {"developers-reference", "maint-guide"},
    "dialogue": {"chitchat-odd", "debian-faq"},
    "lists": {"debian-reference", "click-changes", "iso-codes-tables"},
}
# corpus_digest of the mix as fetched from this corpora.lock (docs/quantize.md)
DIGEST = "sha256:9ae121ad8e1430aa533622cc7f34d70b3dd92b4399bd75baac0b08599fd89981"


@pytest.fixture(scope="module")
def mix() -> Corpus:
    return calibration.load_corpus("mix", ["persuasion"], ROOT)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model / "hf")


def test_five_genres_split_by_the_fixed_rule_with_origins_and_licenses(mix):
    assert mix.genres == sorted(genres.GENRES)
    assert not set(mix.calibration) & set(mix.holdout)
    for genre, held_out in HELD_OUT.items():
        assert set(mix.of_genre(genre, True)) == held_out, genre
        assert mix.of_genre(genre, False), genre  # every genre calibrates too
    pins = genres.versions()
    for name, doc in {**mix.calibration, **mix.holdout}.items():
        source, _, version = doc.origin.split(": ")[0].partition("==")
        assert version == pins.get(source, "1.0.0-1"), name  # janeaustenr is fetched apart
        assert doc.license and (doc.text or doc.conversations), name
    assert mix.calibration["emma"].text.startswith("EMMA")
    assert "Call me" not in mix.holdout["war-of-the-worlds"].text  # not Moby Dick: Wells
    assert mix.calibration["paradise-lost"].text.startswith("Book I")
    assert "def " in mix.holdout["click-code"].text and "#include" in mix.holdout["brotli-decoder"].text
    assert mix.digest == DIGEST


def test_dialogue_is_conversations_in_roles(mix):
    for name in ("chitchat-even", "chitchat-odd", "r-faq", "debian-faq"):
        doc = mix.calibration.get(name) or mix.holdout[name]
        assert not doc.text and len(doc.conversations) >= 70, name
        for conversation in doc.conversations:
            roles = [m["role"] for m in conversation]
            assert roles[0] == "user" and len(roles) >= 2
            assert all(a != b for a, b in zip(roles, roles[1:]))  # one sender's turns merged
            assert all(m["content"].strip() for m in conversation)
    assert len(mix.holdout["debian-faq"].conversations) == 100
    assert len(mix.calibration["r-faq"].conversations) == 73


def test_named_holdout_moves_a_document_out_of_calibration():
    corpus = calibration.load_corpus("mix", ["persuasion", "emma"], ROOT)
    assert "emma" in corpus.holdout and "emma" not in corpus.calibration
    assert corpus.digest == DIGEST  # the same texts, split otherwise
    with pytest.raises(EdgepathError, match="not in it"):
        calibration.load_corpus("mix", ["ulysses"], ROOT)


def test_each_genre_holds_out_16_windows_of_512_tokens(mix, tokenizer):
    sets = calibration.evaluation_sets(tokenizer, mix, 16, 512)
    assert sorted(sets) == sorted(genres.GENRES)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    for genre, windows in sets.items():
        assert windows.shape == (16, 512), genre
        assert (im_start in windows.flatten().tolist()) == (genre == "dialogue"), genre
    # prose's windows are shared out over its three held-out novels: Alice's come first
    assert tokenizer.decode(sets["prose"][0]).lstrip().startswith("ALICE'S ADVENTURES")
    assert calibration.evaluation_sets(tokenizer, mix, 16, 512)["code"].equal(sets["code"])
    assert calibration.evaluation_set(tokenizer, mix, 2, 64).shape == (2, 64)  # the existing callers'


def test_held_out_genres_are_the_mix_split_whatever_calibrates(mix, tokenizer):
    austen = calibration.load_corpus("austen", ["persuasion"], ROOT)
    sets = calibration.held_out_genres(tokenizer, austen, 2, 64, ROOT)
    assert sorted(sets) == sorted(genres.GENRES) and all(w.shape == (2, 64) for w in sets.values())
    # a mix calibration holding Emma out as well scores the same text: figures stay comparable
    more_held_out = calibration.load_corpus("mix", ["persuasion", "emma"], ROOT)
    for corpus in (mix, more_held_out):
        assert all(w.equal(sets[g]) for g, w in calibration.held_out_genres(tokenizer, corpus, 2, 64, ROOT).items())
    record = calibration.held_out_record(more_held_out, ROOT)
    assert record == calibration.held_out_record(austen, ROOT)
    assert record["genres"] == {g: sorted(names) for g, names in HELD_OUT.items()} and record["dropped"] == []
    assert record["corpus"] == "mix" and record["documents_sha256"].startswith("sha256:")


def test_a_held_out_document_that_calibration_uses_is_dropped_and_recorded(tokenizer, tmp_path):
    # Austen calibrating on Persuasion (Emma held out instead): prose is scored on Alice and Wells
    austen = calibration.load_corpus("austen", ["emma"], ROOT)
    record = calibration.held_out_record(austen, ROOT)
    assert record["dropped"] == ["persuasion"] and record["genres"]["prose"] == ["alice", "war-of-the-worlds"]
    prose = calibration.held_out_genres(tokenizer, austen, 4, 64, ROOT)["prose"]
    assert tokenizer.decode(prose[2]).startswith("The War of the Worlds")  # Alice's two windows, then Wells'
    # a user's files, dropped by name; a genre left without documents is not scored
    for name in ("alice", "chitchat-odd", "debian-faq", "notes"):
        (tmp_path / f"{name}.txt").write_text(f"{name}: a few words of the user's own.\n")
    record = calibration.held_out_record(calibration.load_corpus(str(tmp_path), ["notes"]), ROOT)
    assert record["dropped"] == ["alice", "chitchat-odd", "debian-faq"]
    assert "dialogue" not in record["genres"] and record["genres"]["prose"] == ["persuasion", "war-of-the-worlds"]


def _small(mix: Corpus) -> Corpus:
    """The mix cut short (a few thousand tokens a genre), so drawing from it is quick."""
    def cut(d):
        return dataclasses.replace(d, text=d.text[:20_000]) if d.text else dataclasses.replace(
            d, conversations=d.conversations[:20])
    return Corpus("mix", {k: cut(d) for k, d in mix.calibration.items()}, mix.holdout)


def test_calibration_draws_each_genre_its_share(mix, tokenizer):
    small = _small(mix)
    calib = calibration.calibration_set(tokenizer, small, samples=12, length=64, chat_fraction=0.25, seed=0)
    assert calib.genre_samples == {"code": 3, "docs": 2, "lists": 2, "prose": 2, "dialogue": 3}
    assert calib.tokens.shape == (12, 64) and calib.chat_samples == 3
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    chat_rows = [im_start in row for row in calib.tokens.tolist()]
    # the dialogue's windows come from its conversations in the template (a window may
    # fall inside one long message); no other genre's has a template token
    assert not any(chat_rows[:9]) and any(chat_rows[9:])
    record = calib.record
    assert record["genres"]["dialogue"] == {"samples": 3, "documents": ["chitchat-even", "r-faq"],
                                            "held_out": ["chitchat-odd", "debian-faq"]}
    assert record["corpus"] == "mix" and record["samples"] == 12
    even = calibration.calibration_set(tokenizer, small, samples=10, length=64, chat_fraction=0.2, seed=0)
    assert set(even.genre_samples.values()) == {2}
    plain = calibration.calibration_set(tokenizer, small, samples=8, length=64, chat_fraction=0, seed=0)
    assert plain.genre_samples == {"code": 2, "docs": 2, "lists": 2, "prose": 2} and plain.chat_samples == 0


def test_chat_share_without_calibration_dialogue_is_refused(mix, tokenizer):
    small = _small(mix)
    no_dialogue = Corpus("mix", {k: d for k, d in small.calibration.items() if d.genre != "dialogue"}, mix.holdout)
    with pytest.raises(EdgepathError, match="no calibration dialogue"):
        calibration.calibration_set(tokenizer, no_dialogue, samples=8, length=64, chat_fraction=0.25, seed=0)


@pytest.fixture()
def copy(tmp_path) -> Path:
    """A copy of the fetched corpora to damage."""
    for name in ("janeaustenr", "mix"):
        shutil.copytree(ROOT / name, tmp_path / name)
    return tmp_path


def _one_line_naming(error: pytest.ExceptionInfo, path: Path) -> None:
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_missing_mix_names_the_fix(tmp_path):
    with pytest.raises(EdgepathError, match="multi-genre corpus missing.*fetch_corpora.sh") as e:
        genres.mix_documents(tmp_path)
    _one_line_naming(e, tmp_path / "mix")


def test_a_copy_from_another_lock_is_refused(copy):
    lock = copy / "mix" / "corpora.lock"
    lock.write_text(lock.read_text().replace("0.21.2", "0.21.1"))
    with pytest.raises(EdgepathError, match="another edgepath/text/corpora.lock; re-run scripts/fetch_corpora.sh") as e:
        genres.mix_documents(copy)
    _one_line_naming(e, copy / "mix")


@pytest.mark.parametrize("rel", [
    "debian/usr/share/doc/maint-guide/maint-guide.en.txt.gz",
    "debian/usr/lib/R/site-library/tidytext/extdata/books.rda",
    "pypi/Brotli-1.1.0.tar.gz",
    "pypi/chitchat_dataset-0.9.0-py3-none-any.whl",
    "debian/usr/share/dictd/vera.dict.dz",
])
def test_a_truncated_source_file_gives_one_line_naming_it(copy, rel):
    path = copy / "mix" / rel
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(EdgepathError) as e:
        genres.mix_documents(copy)
    _one_line_naming(e, path)


def test_a_missing_source_file_names_it(copy):
    path = copy / "mix" / "debian/usr/share/iso-codes/json/iso_4217.json"
    path.unlink()
    with pytest.raises(EdgepathError, match="no such file") as e:
        genres.mix_documents(copy)
    _one_line_naming(e, path)


def test_text_that_is_not_utf8_names_its_file(copy):
    path = copy / "mix" / "debian/usr/share/developers-reference/developers-reference.txt.gz"
    path.write_bytes(gzip.compress(b"caf\xe9\n"))
    with pytest.raises(EdgepathError, match="UnicodeDecodeError") as e:
        genres.mix_documents(copy)
    _one_line_naming(e, path)
