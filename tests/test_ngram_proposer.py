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


# --- the same rule on device (jaxserve.spec_decode.ngram_device) --------------------------

@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 4), (2, 4, 3), (3, 3, 5), (1, 1, 2)])
def test_device_proposals_are_the_host_proposers(min_n, max_n, k):
    """ngram_propose over a padded batch of random contexts (a 6-token vocabulary, so
    n-grams recur; lengths 0 to the width, a row's padding filled with junk that must not
    count) gives NgramProposer's drafts row by row."""
    import jax
    from jaxserve.spec_decode.ngram_device import ngram_propose

    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k)
    S, L = 64, 40
    tokens = rng.integers(0, 6, (S, L)).astype(np.int32)
    lengths = rng.integers(0, L + 1, S).astype(np.int32)
    lengths[:6] = [0, 1, 2, 3, L, L - 1]
    fn = jax.jit(lambda t, n: ngram_propose(t, n, min_n=min_n, max_n=max_n, k=k))
    drafts, num = map(np.asarray, fn(tokens, lengths))
    host = NgramProposer(min_n, max_n)
    proposed = 0
    for b in range(S):
        want = host.propose(tokens[b, :lengths[b]].tolist(), k)
        assert num[b] == len(want), (b, tokens[b, :lengths[b]], want, drafts[b], num[b])
        assert drafts[b, :num[b]].tolist() == want, b
        assert not drafts[b, num[b]:].any()
        proposed += bool(want)
    assert 0 < proposed < S  # rows with and without a proposal


def test_device_proposer_refuses_bad_limits():
    import jax.numpy as jnp
    from jaxserve.spec_decode.ngram_device import ngram_propose
    t, n = jnp.zeros((1, 4), jnp.int32), jnp.ones((1,), jnp.int32)
    for bad in ({"min_n": 0, "max_n": 2, "k": 1}, {"min_n": 3, "max_n": 2, "k": 1},
                {"min_n": 1, "max_n": 2, "k": 0}):
        with pytest.raises(ValueError, match="min_n"):
            ngram_propose(t, n, **bad)
