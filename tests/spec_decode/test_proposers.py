"""Tests for kvlm.spec_decode: the ngram and suffix proposers and the per-request depth rule (no model)."""

from __future__ import annotations

import pytest

from kvlm.spec_decode import DraftDepth, NgramProposer, SuffixProposer, make_proposer
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


def test_depth_follows_acceptance_and_pauses_failing_requests() -> None:
    d = DraftDepth(k_max=4)
    assert d.want() == 4
    d.record(4, 1)
    assert d.want() == 2  # broke at the second draft: reach just past it
    d.record(2, 2)
    assert d.want() == 3
    for _ in range(MISSES):
        d.record(d.want(), 0)
    assert [d.want() for _ in range(PAUSE)] == [0] * PAUSE and d.want() == 1  # paused, then k = 1 again
    for _ in range(MISSES):  # still failing: the next pause is twice as long
        d.record(1, 0)
    assert [d.want() for _ in range(2 * PAUSE)] == [0] * (2 * PAUSE) and d.want() == 1
    d.record(1, 1)  # an accepted draft: depth grows, the pause length starts over
    assert d.pause == PAUSE and d.k == 2
    for _ in range(20):  # the pause never exceeds MAX_PAUSE
        for _ in range(MISSES):
            d.record(1, 0)
        d.paused = 0
    assert d.pause == MAX_PAUSE


def test_suffix_forgets_finished_requests_on_demand() -> None:
    p = SuffixProposer()
    p.finish("a", [1, 2, 3])
    p.propose("a", [1, 2, 3], 1)
    p.finish("a", [1, 2, 3])
    assert p.propose("b", [1, 2], 1) == [3]
    p.finish("b", [1, 2])
    p.forget_finished()
    assert p.propose("c", [1, 2], 1) == []
