"""The figures that held-out perplexity per genre is reported by, in the quantization
report and the benchmark record alike: each genre's increase over the reference, and
as headline their mean and the worst genre."""

from __future__ import annotations

from typing import Any


def increase_percent(perplexity: float, reference: float) -> float:
    """How much higher ``perplexity`` is than ``reference``, in percent."""
    return 100 * (perplexity / reference - 1)


def headline(increases: dict[str, float]) -> dict[str, Any]:
    """The mean of the per-genre increases and the worst genre (the first in name order
    on a tie), rounded as the per-genre figures are; both null where nothing was measured."""
    if not increases:
        return {"mean_increase_pct": None, "worst": None}
    worst = max(sorted(increases), key=lambda g: increases[g])
    return {"mean_increase_pct": round(sum(increases.values()) / len(increases), 2),
            "worst": {"genre": worst, "increase_pct": round(increases[worst], 2)}}
