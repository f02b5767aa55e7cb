"""How repeated measurements and per-token scores are summarized, once for every record
and benchmark: the spread of samples (median, min, max) and perplexity from
per-token negative log-likelihoods."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def spread(samples: Sequence[float], digits: int) -> dict[str, float]:
    """``{"median", "min", "max"}`` of ``samples``, each rounded to ``digits``. Timings on
    shared cores swing by tens of percent, so records quote the median with its range."""
    return {"median": round(statistics.median(samples), digits), "min": round(min(samples), digits),
            "max": round(max(samples), digits)}


def perplexity(nll: Iterable[Sequence[float]]) -> float:
    """exp(mean per-token NLL) over every token of every window of ``nll``."""
    tokens = [x for window in nll for x in window]
    return math.exp(sum(tokens) / len(tokens))
