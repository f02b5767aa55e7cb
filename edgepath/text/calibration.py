"""Calibration and evaluation token sets, drawn from real text and recorded.

Lifecycle: ``load_corpus`` reads the documents (``corpus.Document``: Jane Austen's
six novels from Debian's ``r-cran-janeaustenr``, the multi-genre ``mix`` of
edgepath/text/genres.py, or a user's ``.txt`` files), each a calibration document or a
held-out one, never both; ``calibration_set`` tokenizes the calibration documents
and draws ``samples`` windows of ``length`` tokens without overlap;
``evaluation_set`` cuts the held-out documents into perplexity windows, and
``evaluation_sets`` does so per genre. ``CalibrationSet.record`` is what the
quantization report keeps: corpus, digests, samples x length, and for a corpus of
several genres each genre's documents and sample count.

Evaluation: ``held_out_genres`` gives every arm the same held-out text, per genre,
whatever corpus calibrated it: the mix's held-out documents (edgepath/text/genres.py's
split), less any document the calibration corpus calibrates on by that name
(Austen's Persuasion when ``holdout`` no longer names it; a user's file named like
one), which ``held_out_record`` names as dropped. Documents that a ``mix``
calibration holds out beyond the split (``holdout``) stay out of calibration but
are not evaluated, so the figures of every calibration are comparable.

Chat: an instruct model runs on chat text, so its activations there must be
calibrated too. ``chat_fraction`` is the share of samples in the model's chat
template. In a corpus of one genre (Austen, a directory) those samples are
passages recast as a user turn and the assistant's continuation; in the mix they
are the dialogue genre's real conversations, and the other genres share the
remaining samples evenly (at ``chat_fraction`` = 1 / the genre count, every genre
has an even share).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from pathlib import Path
from typing import Any

import torch

from ..core import files
from ..core.errors import EdgepathError
from . import corpus as corpora
from . import genres
from .corpus import Document

AUSTEN = "austen"
MIX = "mix"
DIALOGUE = "dialogue"


@dataclasses.dataclass(frozen=True)
class Corpus:
    name: str
    calibration: dict[str, Document]
    holdout: dict[str, Document]

    @property
    def digest(self) -> str:
        return corpora.corpus_digest({k: d.content for k, d in {**self.calibration, **self.holdout}.items()})

    @property
    def genres(self) -> list[str]:
        return sorted({d.genre for d in [*self.calibration.values(), *self.holdout.values()]})

    def of_genre(self, genre: str, held_out: bool) -> dict[str, Document]:
        return {k: d for k, d in (self.holdout if held_out else self.calibration).items() if d.genre == genre}


def load_corpus(source: str, holdout: list[str], root: Path | None = None) -> Corpus:
    """``source``: ``"austen"``, ``"mix"`` or a directory of ``.txt`` files (document
    name = file stem, genre ``text``), each read as ``files.read_text`` reads (a regular
    UTF-8 file within its size limit, else refused by name). ``holdout``: document names
    kept out of calibration for evaluation; the mix holds out its own (edgepath/text/genres.py's
    split) and these besides. ``root``: where ``scripts/fetch_corpora.sh`` put the
    corpora (default: under ``sys.prefix``)."""
    if source == AUSTEN:
        origin = "r-cran-janeaustenr==1.0.0-1: data/Rdata"
        novels = corpora.austen_novels(None if root is None else root / "janeaustenr")
        documents = {k: Document("prose", False, f"{origin} {k}", "MIT; public domain (Project Gutenberg)", text)
                     for k, text in novels.items()}
    elif source == MIX:
        documents = _mix_documents(genres.default_root() if root is None else root)
    else:
        directory = files.path_of(source, "calibration corpus")
        texts = sorted(directory.glob("*.txt")) if directory.is_dir() else []
        if not texts:
            raise EdgepathError(f"calibration corpus {source}: not a directory of .txt files")
        documents = {f.stem: Document("text", False, str(f), "the user's", files.read_text(f)) for f in texts}
    unknown = sorted(set(holdout) - set(documents))
    if unknown:
        raise EdgepathError(f"calibration corpus {source}: held-out documents {unknown} are not in it "
                            f"(it has {sorted(documents)})")
    documents = {k: dataclasses.replace(d, held_out=True) if k in holdout else d for k, d in documents.items()}
    calibration = {k: d for k, d in documents.items() if not d.held_out}
    if not calibration:
        raise EdgepathError(f"calibration corpus {source}: every document is held out; nothing left to calibrate on")
    return Corpus(source, calibration, {k: d for k, d in documents.items() if d.held_out})


@functools.lru_cache(maxsize=1)
def _mix_documents(root: Path) -> dict[str, Document]:
    """The mix's documents, read once per process: a quantize run calibrates on it,
    measures perplexity on it and checks the engine on it (reading it takes seconds)."""
    return genres.mix_documents(root)


@dataclasses.dataclass(frozen=True)
class CalibrationSet:
    tokens: torch.Tensor
    """[samples, length] token ids."""
    chat_samples: int
    corpus: Corpus
    seed: int
    genre_samples: dict[str, int]
    """Samples drawn from each genre (one entry for a corpus of one genre)."""

    @property
    def record(self) -> dict[str, Any]:
        s, length = self.tokens.shape
        by_genre = {} if len(self.corpus.genres) == 1 else {"genres": {
            g: {"samples": self.genre_samples.get(g, 0), "documents": sorted(self.corpus.of_genre(g, False)),
                "held_out": sorted(self.corpus.of_genre(g, True))} for g in self.corpus.genres}}
        return {
            "corpus": self.corpus.name,
            "corpus_sha256": self.corpus.digest,
            "documents": sorted(self.corpus.calibration),
            "held_out": sorted(self.corpus.holdout),
            "samples": s,
            "length": length,
            "chat_samples": self.chat_samples,
            **by_genre,
            "seed": self.seed,
            "tokens_sha256": tokens_sha256(self.tokens),
        }


def tokens_sha256(tokens: torch.Tensor) -> str:
    """The sha256 of token ids as little-endian int64: how records name the exact ids a
    calibration or evaluation used, so that another run can check it scores the same."""
    return hashlib.sha256(tokens.to(torch.int64).numpy().tobytes()).hexdigest()


def _require_chat_template(tokenizer, why: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise EdgepathError(f"{why} but the model's tokenizer has no chat template; "
                            "set calibration.chat_fraction: 0")


def document_ids(tokenizer, document: Document, limit: int | None = None) -> list[int]:
    """A document's token ids: its text and an end-of-sequence token, or its
    conversations each rendered through the model's chat template (which ends every
    turn itself). ``limit``: stop rendering conversations once that many are there
    (a chat corpus is millions of tokens; evaluation needs the first few thousand)."""
    if not document.conversations:
        ids = tokenizer(document.text, add_special_tokens=False)["input_ids"]
        return ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    _require_chat_template(tokenizer, f"{document.origin} is dialogue")
    ids = []
    for conversation in document.conversations:
        ids += tokenizer.apply_chat_template(list(conversation), tokenize=True, return_dict=False)
        if limit is not None and len(ids) >= limit:
            break
    return ids


def _token_stream(tokenizer, documents: dict[str, Document], limit: int | None = None) -> list[int]:
    """The documents' ids in name order, concatenated (up to about ``limit``)."""
    stream: list[int] = []
    for name in sorted(documents):
        stream += document_ids(tokenizer, documents[name], None if limit is None else limit - len(stream))
        if limit is not None and len(stream) >= limit:
            break
    return stream


def _chat_sample(tokenizer, window: list[int], length: int) -> list[int]:
    """A passage as a user turn and its continuation as the assistant's reply, cut or
    topped up from the passage to ``length`` tokens."""
    text = tokenizer.decode(window)
    cut = text.find(" ", len(text) // 3)
    messages = [
        {"role": "user", "content": f"Continue this passage:\n\n{text[:cut]}"},
        {"role": "assistant", "content": text[cut + 1:]},
    ]
    ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))[:length]
    return ids + window[: length - len(ids)]  # the template fills most


def calibration_set(tokenizer, corpus: Corpus, samples: int, length: int,
                    chat_fraction: float, seed: int) -> CalibrationSet:
    """``samples`` disjoint windows of ``length`` tokens from the calibration documents,
    ``round(samples * chat_fraction)`` of them in chat form (module docstring); in a
    corpus of several genres, each genre's windows drawn from its own documents."""
    if samples < 1 or length < 8:
        raise EdgepathError(f"calibration needs samples >= 1 and length >= 8 (got {samples} x {length})")
    if not 0 <= chat_fraction <= 1:
        raise EdgepathError(f"calibration chat_fraction must be within [0, 1] (got {chat_fraction})")
    chat = round(samples * chat_fraction)
    if chat:
        _require_chat_template(tokenizer, "chat calibration was asked for (chat_fraction > 0)")
    rng = random.Random(seed)
    if len(corpus.genres) == 1:
        (genre,) = corpus.genres
        windows = _draw(tokenizer, corpus.calibration, samples, length, rng, corpus.name)
        rows = [_chat_sample(tokenizer, w, length) if i < chat else w for i, w in enumerate(windows)]
        return CalibrationSet(torch.tensor(rows, dtype=torch.int64), chat, corpus, seed, {genre: samples})
    counts = _genre_shares(corpus, samples, chat)
    rows = []
    for genre, count in counts.items():
        rows += _draw(tokenizer, corpus.of_genre(genre, False), count, length, rng, f"{corpus.name} {genre}")
    return CalibrationSet(torch.tensor(rows, dtype=torch.int64), chat, corpus, seed, counts)


def _genre_shares(corpus: Corpus, samples: int, chat: int) -> dict[str, int]:
    """Samples per genre: ``chat`` to dialogue, the rest evenly over the other genres
    with calibration documents (the remainder one each to the first, in name order)."""
    others = [g for g in corpus.genres if g != DIALOGUE and corpus.of_genre(g, False)]
    if chat and not corpus.of_genre(DIALOGUE, False):
        raise EdgepathError(f"calibration corpus {corpus.name}: chat_fraction > 0 asks for dialogue samples, "
                            "but it has no calibration dialogue")
    if samples - chat and not others:
        raise EdgepathError(f"calibration corpus {corpus.name}: chat_fraction < 1 asks for samples of other "
                            "genres, but it has calibration dialogue only")
    base, extra = divmod(samples - chat, max(len(others), 1))
    counts = {g: base + (i < extra) for i, g in enumerate(others)}
    return {**counts, DIALOGUE: chat} if chat else counts


def _draw(tokenizer, documents: dict[str, Document], count: int, length: int, rng: random.Random,
          what: str) -> list[list[int]]:
    """``count`` disjoint ``length``-token windows of the documents' stream, at random
    window positions, in a random order."""
    if not count:
        return []
    stream = _token_stream(tokenizer, documents)
    available = len(stream) // length
    if available < count:
        raise EdgepathError(
            f"calibration corpus {what} is too short: {len(stream)} tokens hold {available} "
            f"windows of {length}, {count} were asked for")
    starts = sorted(rng.sample(range(available), count))
    rng.shuffle(starts)
    return [stream[start * length:(start + 1) * length] for start in starts]


def evaluation_set(tokenizer, corpus: Corpus, windows: int, length: int) -> torch.Tensor:
    """[windows, length] consecutive, non-overlapping token windows from the
    held-out documents in name order (the same text on every run)."""
    if not corpus.holdout:
        raise EdgepathError(f"corpus {corpus.name}: no held-out document to evaluate on")
    stream = _token_stream(tokenizer, corpus.holdout, windows * length)
    if len(stream) < windows * length:
        raise EdgepathError(f"held-out text of {corpus.name} has {len(stream)} tokens, fewer than "
                            f"{windows} x {length}")
    return torch.tensor(stream[: windows * length], dtype=torch.int64).view(windows, length)


def evaluation_sets(tokenizer, corpus: Corpus, windows: int, length: int) -> dict[str, torch.Tensor]:
    """Genre -> [windows, length] held-out token windows, for every genre with held-out
    documents: the windows shared out over the genre's documents in name order (the
    remainder one each to the first), each document's windows consecutive from its
    start, so every held-out source is scored, the same text on every run."""
    sets = {}
    for genre in corpus.genres:
        documents = corpus.of_genre(genre, True)
        if not documents:
            continue
        base, extra = divmod(windows, len(documents))
        rows = []
        for i, name in enumerate(sorted(documents)):
            need = (base + (i < extra)) * length
            ids = document_ids(tokenizer, documents[name], need)
            if len(ids) < need:
                raise EdgepathError(f"held-out document {name} ({genre}) of {corpus.name} has {len(ids)} tokens, "
                                    f"fewer than the {need // length} x {length} its share of {windows} windows needs")
            rows += [ids[j:j + length] for j in range(0, need, length)]
        sets[genre] = torch.tensor(rows, dtype=torch.int64).view(windows, length)
    if not sets:
        raise EdgepathError(f"corpus {corpus.name}: no held-out document to evaluate on")
    return sets


def _evaluation_corpus(calibration: Corpus, root: Path | None) -> tuple[Corpus, list[str]]:
    """(the mix with only its own split's held-out documents less those ``calibration``
    calibrates on, the names of those dropped)."""
    documents = _mix_documents(genres.default_root() if root is None else root)
    held_out = {k: d for k, d in documents.items() if d.held_out}
    dropped = sorted(set(held_out) & set(calibration.calibration))
    return Corpus(MIX, {k: d for k, d in documents.items() if not d.held_out},
                  {k: d for k, d in held_out.items() if k not in dropped}), dropped


def held_out_genres(tokenizer, calibration: Corpus, windows: int, length: int,
                    root: Path | None = None) -> dict[str, torch.Tensor]:
    """Genre -> [windows, length] held-out token ids on which every arm is evaluated,
    never calibrated on by ``calibration`` (module docstring; ``evaluation_sets``
    cuts them). ``root``: where the corpora were fetched, as in ``load_corpus``."""
    corpus, _ = _evaluation_corpus(calibration, root)
    return evaluation_sets(tokenizer, corpus, windows, length)


# A build's check in its engine is teacher-forced on 2 windows of 96 held-out tokens per
# genre, 960 tokens (950 scored positions) over the five genres, within the 8 x 128 of
# Persuasion that the vLLM check scored before (1016 positions, W4A8 agreement 0.86 on
# SmolLM2, well clear of its threshold), so it takes no longer.
CHECK_WINDOWS_PER_GENRE, CHECK_LENGTH = 2, 96


def check_sequences(tokenizer, corpus: Corpus) -> dict[str, list[list[int]]]:
    """Genre -> the held-out token windows a build's check in its engine is teacher-forced
    on, never calibrated on by ``corpus``, the build's calibration corpus."""
    return {genre: windows.tolist()
            for genre, windows in held_out_genres(tokenizer, corpus, CHECK_WINDOWS_PER_GENRE, CHECK_LENGTH).items()}


def held_out_record(calibration: Corpus, root: Path | None = None) -> dict[str, Any]:
    """What ``held_out_genres`` scores, for a record: each genre's documents, their
    digest, and the held-out documents dropped because ``calibration`` calibrates on
    a document of that name."""
    corpus, dropped = _evaluation_corpus(calibration, root)
    return {"corpus": corpus.name,
            "documents_sha256": corpora.corpus_digest({k: d.content for k, d in corpus.holdout.items()}),
            "genres": {g: sorted(corpus.of_genre(g, True)) for g in corpus.genres if corpus.of_genre(g, True)},
            "dropped": dropped}
