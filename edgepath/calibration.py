"""Calibration and evaluation token sets, drawn from real text and recorded.

Lifecycle: ``load_corpus`` reads the documents (Jane Austen's six novels from
Debian's ``r-cran-janeaustenr`` by default, or a user's ``.txt`` files), split
by name into calibration documents and held-out documents (never both);
``calibration_set`` tokenizes the calibration documents and draws
``samples`` windows of ``length`` tokens without overlap, a share of them
rendered through the model's chat template (an instruct model runs on chat
text, so its activations there must be calibrated too); ``evaluation_set``
cuts the held-out documents into perplexity windows. ``CalibrationSet.record``
is what the quantization report keeps: corpus, digests, samples x length.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Any

import torch

from . import corpus as corpora
from . import files
from .errors import EdgepathError

AUSTEN = "austen"


@dataclasses.dataclass(frozen=True)
class Corpus:
    name: str
    calibration: dict[str, str]
    holdout: dict[str, str]

    @property
    def digest(self) -> str:
        return corpora.corpus_digest({**self.calibration, **self.holdout})


def load_corpus(source: str, holdout: list[str]) -> Corpus:
    """``source``: ``"austen"`` or a directory of ``.txt`` files (document name = file
    stem), each read as ``files.read_text`` reads (a regular UTF-8 file within its size
    limit, else refused by name). ``holdout``: document names kept out of calibration
    for evaluation."""
    if source == AUSTEN:
        documents = corpora.austen_novels()
    else:
        root = files.path_of(source, "calibration corpus")
        texts = sorted(root.glob("*.txt")) if root.is_dir() else []
        if not texts:
            raise EdgepathError(f"calibration corpus {source}: not a directory of .txt files")
        documents = {f.stem: files.read_text(f) for f in texts}
    unknown = sorted(set(holdout) - set(documents))
    if unknown:
        raise EdgepathError(f"calibration corpus {source}: held-out documents {unknown} are not in it "
                            f"(it has {sorted(documents)})")
    calibration = {k: v for k, v in documents.items() if k not in holdout}
    if not calibration:
        raise EdgepathError(f"calibration corpus {source}: every document is held out; nothing left to calibrate on")
    return Corpus(source, calibration, {k: documents[k] for k in holdout})


@dataclasses.dataclass(frozen=True)
class CalibrationSet:
    tokens: torch.Tensor
    """[samples, length] token ids."""
    chat_samples: int
    corpus: Corpus
    seed: int

    @property
    def record(self) -> dict[str, Any]:
        s, length = self.tokens.shape
        return {
            "corpus": self.corpus.name,
            "corpus_sha256": self.corpus.digest,
            "documents": sorted(self.corpus.calibration),
            "held_out": sorted(self.corpus.holdout),
            "samples": s,
            "length": length,
            "chat_samples": self.chat_samples,
            "seed": self.seed,
            "tokens_sha256": hashlib.sha256(self.tokens.to(torch.int64).numpy().tobytes()).hexdigest(),
        }


def _token_stream(tokenizer, documents: dict[str, str]) -> list[int]:
    stream: list[int] = []
    for name in sorted(documents):
        stream += tokenizer(documents[name], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    return stream


def _chat_sample(tokenizer, window: list[int], length: int) -> list[int]:
    """A passage as a user turn and its continuation as the assistant's reply."""
    text = tokenizer.decode(window)
    cut = text.find(" ", len(text) // 3)
    messages = [
        {"role": "user", "content": f"Continue this passage:\n\n{text[:cut]}"},
        {"role": "assistant", "content": text[cut + 1:]},
    ]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    return list(ids)[:length]


def calibration_set(tokenizer, corpus: Corpus, samples: int, length: int,
                    chat_fraction: float, seed: int) -> CalibrationSet:
    """``samples`` disjoint windows of ``length`` tokens from the calibration documents;
    ``round(samples * chat_fraction)`` of them in chat form."""
    if samples < 1 or length < 8:
        raise EdgepathError(f"calibration needs samples >= 1 and length >= 8 (got {samples} x {length})")
    if not 0 <= chat_fraction <= 1:
        raise EdgepathError(f"calibration chat_fraction must be within [0, 1] (got {chat_fraction})")
    chat = round(samples * chat_fraction)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise EdgepathError("chat calibration was asked for (chat_fraction > 0) but the model's tokenizer "
                            "has no chat template; set calibration.chat_fraction: 0")
    stream = _token_stream(tokenizer, corpus.calibration)
    available = len(stream) // length
    if available < samples:
        raise EdgepathError(
            f"calibration corpus {corpus.name} is too short: {len(stream)} tokens hold {available} "
            f"windows of {length}, {samples} were asked for")
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(available), samples))
    rng.shuffle(starts)
    rows = []
    for i, start in enumerate(starts):
        window = stream[start * length:(start + 1) * length]
        if i < chat:
            ids = _chat_sample(tokenizer, window, length)
            if len(ids) < length:  # the template fills most; top up from the passage
                ids += window[: length - len(ids)]
            window = ids
        rows.append(window)
    return CalibrationSet(torch.tensor(rows, dtype=torch.int64), chat, corpus, seed)


def evaluation_set(tokenizer, corpus: Corpus, windows: int, length: int) -> torch.Tensor:
    """[windows, length] consecutive, non-overlapping token windows from the
    held-out documents, in order (the same text on every run)."""
    if not corpus.holdout:
        raise EdgepathError(f"corpus {corpus.name}: no held-out document to evaluate on")
    stream = _token_stream(tokenizer, corpus.holdout)
    if len(stream) < windows * length:
        raise EdgepathError(f"held-out text of {corpus.name} has {len(stream)} tokens, fewer than "
                            f"{windows} x {length}")
    return torch.tensor(stream[: windows * length], dtype=torch.int64).view(windows, length)
