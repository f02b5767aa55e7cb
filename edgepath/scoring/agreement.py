"""Next-token agreement between an engine and a reference, over held-out windows of
every genre: the engine check's, patch-verify's, the GGUF check's and the benchmark's
one computation of it.

``sequences`` maps a genre to its token windows; an engine is given
``all_windows(sequences)``, genre after genre, and returns one list of predicted
next tokens per window, which ``agreement`` and ``agreement_by_genre`` compare with
a reference's lists for the same windows.
"""

from __future__ import annotations

from typing import Any

from .evaluate import common_prefix


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


def greedy_summary(engine: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    prefixes = [common_prefix(e, r) for e, r in zip(engine, reference)]
    return {"identical": sum(p == len(r) for p, r in zip(prefixes, reference)),
            "prompts": len(reference), "mean_identical_leading_tokens": sum(prefixes) / len(prefixes)}
