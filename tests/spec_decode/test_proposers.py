"""Tests for kvlm.spec_decode: the ngram and suffix proposers and the per-request depth rule (no model)."""

from __future__ import annotations

import pytest

from kvlm.spec_decode import DraftDepth, NgramProposer, SuffixProposer, make_proposer, plan_depths
from kvlm.spec_decode.depth import MAX_PAUSE, MISSES, PAUSE


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    p = NgramProposer(min_n=2, max_n=2)
    toks = [2, 3, 4, 2, 3, 7, 1, 2, 3]
    assert p.propose("r", toks, 3) == [7, 1, 2]  # [2, 3] at 0..1 and 3..4: the latest one's continuation


def test_ngram_longest_match_first() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    toks = [1, 2, 3, 4, 5, 2, 3, 6, 1, 2, 3]
    assert p.propose("r", toks, 2) == [4, 5]  # [1, 2, 3] at 0..2 beats the later [2, 3] (followed by 6)


def test_ngram_grows_incrementally_and_stops_at_the_end() -> None:
    p = NgramProposer(min_n=2, max_n=2)
    toks = [5, 6, 7]
    assert p.propose("r", toks, 4) == []
    toks += [5, 6]
    assert p.propose("r", toks, 4) == [7, 5, 6]  # what follows [5, 6] up to the end of the history
    p.finish("r", toks)
    assert p.index == {}


def test_suffix_uses_finished_requests_and_counts() -> None:
    p = SuffixProposer(min_n=1, max_n=4, max_cached_requests=2)
    p.propose("a", [1, 2, 3, 4, 5], 1)
    p.finish("a", [1, 2, 3, 4, 5])
    assert p.propose("b", [9, 2, 3], 3) == [4, 5]  # from a's history; nothing follows 5
    p.finish("b", [9, 2, 3, 8])
    p.propose("c", [7], 1)
    p.finish("c", [2, 3, 8])
    assert p.propose("d", [2, 3], 1) == [8]  # 8 followed [2, 3] twice, 4 once
    p.finish("d", [0])  # the cache keeps 2 requests: a's counts age out
    assert p.propose("e", [3], 1) == [8] and p.propose("e2", [4], 1) == []


def test_make_proposer_refuses_unknown_methods() -> None:
    assert isinstance(make_proposer("suffix"), SuffixProposer)
    with pytest.raises(ValueError, match="ngram, suffix"):
        make_proposer("eagle")
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_plan_drafts_where_they_raise_tokens_per_row_time() -> None:
    # alone: every draft pays at p = 1, one at p = 0.5 (a second adds 0.25 < 1.5 / 5.6), none at p = 0.2
    assert plan_depths([1.0], [5], 1) == [5]
    assert plan_depths([0.5], [5], 1) == [1]
    assert plan_depths([0.2], [5], 1) == [0]
    assert plan_depths([0.99], [3], 1) == [3]  # never past the limit
    # busy: at B = 16 a draft must beat 16 / 19.6 = 0.82 tokens
    assert plan_depths([0.8] * 16, [5] * 16, 16) == [0] * 16
    assert sum(plan_depths([0.95] * 16, [5] * 16, 16)) > 16
    # the best requests first: the confident one drafts deeper than the doubtful one
    ks = plan_depths([0.9, 0.6], [5, 5], 2)
    assert ks[0] > ks[1] > 0
    assert plan_depths([0.9, 0.9], [0, 2], 2) == [0, 2]
    assert plan_depths([], [], 0) == []


def test_depth_estimate_follows_acceptance_and_probes_back_off() -> None:
    d = DraftDepth()
    assert d.p == 0.5  # the prior
    for _ in range(5):
        d.record(4, 4)
    assert d.p > 0.9
    for _ in range(10):
        d.record(2, 0)
    assert d.p < 0.3  # recent drafts weigh most
    # a request the plan leaves out probes after `pause` idle steps; a failed probe doubles the pause
    d = DraftDepth()
    assert [d.probe() for _ in range(PAUSE + 1)] == [False] * PAUSE + [True]
    d.record(1, 0)
    assert d.pause == 2 * PAUSE and not d.probing
    assert [d.probe() for _ in range(2 * PAUSE + 1)][-2:] == [False, True]
    d.record(1, 1)  # an accepted draft: the pause starts over
    assert d.pause == PAUSE
    for _ in range(20):
        while not d.probe():
            pass
        d.record(1, 0)
    assert d.pause == MAX_PAUSE


def test_depth_without_the_cost_rule_pauses_failing_requests() -> None:
    d = DraftDepth()
    for _ in range(MISSES):
        assert not d.paused()
        d.record(4, 0)
    assert [d.paused() for _ in range(PAUSE + 1)] == [True] * PAUSE + [False] and d.probing
    d.record(1, 0)  # the probe failed: paused again, twice as long
    assert [d.paused() for _ in range(2 * PAUSE + 1)] == [True] * (2 * PAUSE) + [False]
    d.record(1, 1)
    assert not d.paused() and d.pause == PAUSE


def test_suffix_forgets_finished_requests_on_demand() -> None:
    p = SuffixProposer()
    p.finish("a", [1, 2, 3])
    p.propose("a", [1, 2, 3], 1)
    p.finish("a", [1, 2, 3])
    assert p.propose("b", [1, 2], 1) == [3]
    p.finish("b", [1, 2])
    p.forget_finished()
    assert p.propose("c", [1, 2], 1) == []
