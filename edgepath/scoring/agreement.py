"""Next-token agreement between an engine and a reference, over held-out windows of
every genre: the engine check's, patch-verify's, the GGUF check's and the benchmark's
one computation of it.

``sequences`` maps a genre to its token windows; an engine is given
``all_windows(sequences)``, genre after genre, and returns one list of predicted
next tokens per window, which ``agreement`` and ``agreement_by_genre`` compare with
a reference's lists for the same windows. A check record keeps one ``comparison``
per reference under ``against``; ``top1_against`` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TOP1 = "teacher_forced_top1_agreement"
"""A check record's field: the share of teacher-forced positions whose next token agrees."""
TOP1_BY_GENRE = "teacher_forced_top1_by_genre"


def all_windows(sequences: dict[str, list[list[int]]]) -> list[list[int]]:
    """Every genre's windows in one list, genre after genre: what the engine is given."""
    return [window for windows in sequences.values() for window in windows]


def agreement(engine: list[list[int]], reference: list[list[int]]) -> float:
    pairs = [(a, b) for e, r in zip(engine, reference) for a, b in zip(e, r)]
    return sum(a == b for a, b in pairs) / len(pairs)


def agreement_by_genre(engine: list[list[int]], reference: list[list[int]],
                       sequences: dict[str, list[list[int]]]) -> dict[str, float]:
    """Genre -> ``agreement`` over its windows; ``engine`` and ``reference`` hold one
    prediction list per window of ``all_windows(sequences)``, in that order."""
    result, start = {}, 0
    for genre, windows in sequences.items():
        end = start + len(windows)
        result[genre] = round(agreement(engine[start:end], reference[start:end]), 4)
        start = end
    return result


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_summary(engine: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    prefixes = [common_prefix(e, r) for e, r in zip(engine, reference)]
    return {"identical": sum(p == len(r) for p, r in zip(prefixes, reference)),
            "prompts": len(reference), "mean_identical_leading_tokens": sum(prefixes) / len(prefixes)}


def comparison(top1: float, by_genre: dict[str, float]) -> dict[str, Any]:
    """One reference's entry under a check record's ``against``: the agreement over all
    windows (rounded as records keep it) and per genre."""
    return {TOP1: round(top1, 4), TOP1_BY_GENRE: by_genre}


def top1_against(check: Mapping[str, Any], reference: str) -> float:
    """The agreement a check record (``engine_check``, ``gguf_check``, patch-verify's
    ``check``) holds against ``reference`` (``dequantized``, ``bf16``, ``reference``)."""
    return check["against"][reference][TOP1]
