"""N-gram prompt lookup (host side)."""

import numpy as np
import pytest

from jaxserve.spec_decode.ngram import NgramProposer


def _reference(ctx, k, lo, hi):
    """The rule, spelled out: longest n in [lo, hi] whose suffix occurs earlier; the
    latest occurrence; what followed it."""
    L = len(ctx)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = ctx[L - n:]
        for start in range(L - n - 1, -1, -1):
            if ctx[start:start + n] == suffix:
                return ctx[start + n:start + n + k]
    return []


def test_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(1, 3)
    #      0  1  2  3  4  5  6  7  8  9
    ctx = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # suffix (6, 7) occurs at 1..2 and 5..6; the latest (5..6) is followed by 1, 2, 6
    assert p.propose(ctx, 3) == [1, 2, 6]
    # a 3-gram (2, 6, 7) occurs nowhere earlier, so the 2-gram wins over the 1-gram
    assert p.propose(ctx, 1) == [1]


def test_longer_match_beats_a_later_shorter_one():
    p = NgramProposer(1, 3)
    ctx = [1, 2, 3, 4, 9, 3, 5, 1, 2, 3]
    # (1, 2, 3) occurs at 0..2, followed by 4; the later 1-gram (3) at 5 would give 5
    assert p.propose(ctx, 2) == [4, 9]


def test_min_n_and_limits():
    ctx = [1, 2, 3, 9, 3]
    assert NgramProposer(1, 4).propose(ctx, 2) == [9, 3]
    assert NgramProposer(2, 4).propose(ctx, 2) == []       # only a 1-gram matches
    assert NgramProposer(1, 4).propose(ctx, 0) == []
    assert NgramProposer(1, 4).propose([7], 3) == []
    # the continuation is cut where the context ends
    assert NgramProposer(1, 2).propose([4, 4], 5) == [4]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_reference_on_random_contexts(seed):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 4, size=int(rng.integers(2, 60))).tolist()
    lo = int(rng.integers(1, 4))
    hi = lo + int(rng.integers(0, 3))
    assert NgramProposer(lo, hi).propose(ctx, 4) == _reference(ctx, 4, lo, hi)
