"""The figures that held-out perplexity per genre is reported by, in the quantization
report and the benchmark record alike: each genre's increase over the reference, and
as headline their mean and the worst genre; and the llama.cpp controls a build's
increase is compared with, in the benchmark record and the manifest alike."""

from __future__ import annotations

from typing import Any

# The control types (the control stage's) every build is compared with, by their key in
# the benchmark's ``ratios``: Q4_K_M, llama.cpp's usual 4-bit choice; Q4_0, plain
# round-to-nearest 4-bit (issue 20's goal: below Q4_0 on every genre, at most 1.5x
# Q4_K_M's mean increase); Q4_0-imatrix, the strongest llama.cpp offers at Q4_0's size
# (issue 21's goal: below it).
COMPARED_CONTROLS = {"llama_q4_k_m": "Q4_K_M", "llama_q4_0": "Q4_0", "llama_q4_0_imatrix": "Q4_0-imatrix"}


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
