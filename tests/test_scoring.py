"""The summaries every record and benchmark shares (``edgepath.scoring``): the spread
of repeated measurements, perplexity from per-token NLLs, next-token agreement and
how a check record keeps it, and what a record names as the software that made it."""

import math

import pytest

from edgepath.core import records
from edgepath.scoring import agreement, stats


def test_spread_is_the_median_and_range_rounded():
    assert stats.spread([3.0, 1.04, 2.26, 10.0], 1) == {"median": 2.6, "min": 1.0, "max": 10.0}
    assert list(stats.spread([5.5], 2)) == ["median", "min", "max"]  # the order records keep


def test_perplexity_pools_every_token_of_every_window():
    # pooled over the 3 tokens, not the mean of the two windows' perplexities
    nll = [[1.0, 2.0], [3.0]]
    assert stats.perplexity(nll) == pytest.approx(math.exp(2.0))
    assert stats.perplexity(nll) != pytest.approx((math.exp(1.5) + math.exp(3.0)) / 2)


def test_a_check_record_keeps_and_gives_back_each_references_agreement():
    sequences = {"code": [[1, 2, 3]], "prose": [[4, 5, 6]]}
    engine, reference = [[2, 3], [5, 6]], [[2, 0], [5, 6]]
    entry = agreement.comparison(agreement.agreement(engine, reference),
                                 agreement.agreement_by_genre(engine, reference, sequences))
    assert entry == {agreement.TOP1: 0.75, agreement.TOP1_BY_GENRE: {"code": 0.5, "prose": 1.0}}
    assert agreement.top1_against({"against": {"dequantized": entry}}, "dequantized") == 0.75


def test_greedy_continuations_are_compared_by_their_common_prefix():
    assert agreement.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert agreement.greedy_summary([[1, 2], [7]], [[1, 2], [8]]) == {
        "identical": 1, "prompts": 2, "mean_identical_leading_tokens": 1.0}


def test_versions_name_edgepath_first_and_a_missing_distribution_as_none():
    from edgepath import __version__

    got = records.versions("pyyaml", "no-such-distribution-edgepath")
    assert list(got) == ["edgepath", "pyyaml", "no-such-distribution-edgepath"]
    assert got["edgepath"] == __version__ and got["pyyaml"] and got["no-such-distribution-edgepath"] is None
    assert records.tool("pyyaml") == f"pyyaml {got['pyyaml']}"
