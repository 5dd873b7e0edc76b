"""The speculative rejection sampler: exact target distribution (chi-square), greedy
prefix acceptance, the request's sampling parameters, seeded reproducibility."""

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.sample.sampler import SamplingBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.sample.rejection_sampler import rejection_sample

ALPHA = 1e-3   # significance of every chi-square test below
N = 20_000     # independent draws (rows, each with its own seed) per test
V = 6          # vocabulary

_verify = jax.jit(rejection_sample)
_verify_ngram = jax.jit(lambda lg, d, n, sb: rejection_sample(lg, d, n, sb))


def _batch(params, seeds, steps=None):
    return SamplingBatch.from_params(params, seeds, steps or [0] * len(params), len(params))


def _dist(logits, sp):
    """The distribution a request samples from, in numpy: softmax(logits / temperature),
    then top-k, renormalised, then top-p (the smallest head holding top_p of the mass) and
    min-p (tokens below min_p x the top token's probability dropped), renormalised."""
    x = np.asarray(logits, np.float64) / sp.temperature
    order = np.argsort(-x)
    p = np.exp(x - x.max())
    if sp.top_k > 0:
        p[order[sp.top_k:]] = 0
    p /= p.sum()
    keep = np.zeros(len(x), bool)
    mass = 0.0
    for rank, t in enumerate(order):
        if rank and (mass >= sp.top_p or p[t] < sp.min_p * p[order[0]] or p[t] == 0):
            break
        keep[t] = True
        mass += p[t]
    p = np.where(keep, p, 0)
    return p / p.sum()


def _draw(rng, probs, n):
    return rng.choice(len(probs), size=n, p=probs).astype(np.int32)


def _first_two(p_logits, q_logits, sp, *, tell_q=None, deterministic=False, seed=0):
    """(first, second) output tokens of N independent verify steps with K = 2 drafts drawn
    from q (the draft's processed distribution) over a target whose distribution is
    p_logits[j] at position j whatever came before. A sequence whose step ended after
    one token draws its second from p_1 (what its next step would do), so the pair must
    be distributed as p_0 x p_1. tell_q: the draft logits the sampler is told (default
    the true ones); deterministic: tell it nothing (as n-gram drafts)."""
    rng = np.random.default_rng(seed)
    q = [_dist(q_logits[j], sp) for j in range(2)]
    drafts = np.stack([_draw(rng, q[0], N), _draw(rng, q[1], N)], axis=1)
    logits = np.broadcast_to(np.asarray(p_logits, np.float32), (N, 3, V))
    told = np.asarray(q_logits if tell_q is None else tell_q, np.float32)
    sb = _batch([sp] * N, list(range(seed * N, seed * N + N)))
    num = np.full(N, 2, np.int32)
    if deterministic:
        toks, _, n = _verify_ngram(logits, drafts, num, sb)
    else:
        toks, _, n = _verify(logits, drafts, num, sb, np.broadcast_to(told, (N, 2, V)))
    toks, n = np.asarray(toks), np.asarray(n)
    assert ((n >= 1) & (n <= 3)).all()
    second = np.where(n >= 2, toks[:, 1], _draw(rng, _dist(p_logits[1], sp), N))
    return toks[:, 0], second


def _pvalue(first, second, p0, p1):
    """Chi-square p-value of the observed pairs against p0 x p1 (cells with expected
    count 0 must stay empty: any draw there is an error)."""
    expected = np.outer(p0, p1).ravel() * N
    observed = np.bincount(first * V + second, minlength=V * V)
    assert observed[expected == 0].sum() == 0, "a token outside the target's support"
    live = expected > 0
    return stats.chisquare(observed[live], expected[live] * observed[live].sum()
                           / expected[live].sum()).pvalue


def _logits(*rows):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(rows, np.float64))


# no ties within a row: top-k / top-p of tied tokens is the sort's choice
P = _logits([0.3, 0.25, 0.2, 0.12, 0.08, 0.05], [0.05, 0.09, 0.11, 0.2, 0.25, 0.3],
            [0.5, 0.14, 0.12, 0.1, 0.08, 0.06])
PAIRS = {
    "different": (P, _logits([0.08, 0.1, 0.12, 0.19, 0.21, 0.3],
                             [0.4, 0.3, 0.11, 0.09, 0.06, 0.04])),
    "disjoint": (_logits([0.5, 0.3, 0.2, 0, 0, 0], [0.2, 0.2, 0.6, 0, 0, 0], [1 / 6] * 6),
                 _logits([0, 0, 0, 0.3, 0.3, 0.4], [0, 0, 0, 0.5, 0.5, 0])),
    "equal": (P, P[:2]),
    "draft_peaked": (P, _logits([0.9, 0.02, 0.02, 0.02, 0.02, 0.02],
                                [0.02, 0.02, 0.02, 0.02, 0.02, 0.9])),
}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_output_is_distributed_as_the_target(pair):
    p_logits, q_logits = PAIRS[pair]
    sp = SamplingParams(temperature=1.0)
    first, second = _first_two(p_logits, q_logits, sp)
    assert _pvalue(first, second, _dist(p_logits[0], sp), _dist(p_logits[1], sp)) > ALPHA


def test_request_parameters_apply_to_target_and_draft():
    # temperature, top-k and top-p change both distributions; the output follows the
    # processed target, never a token the filters drop
    p_logits, q_logits = PAIRS["different"]
    sp = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    first, second = _first_two(p_logits, q_logits, sp, seed=1)
    assert _pvalue(first, second, _dist(p_logits[0], sp), _dist(p_logits[1], sp)) > ALPHA


def test_deterministic_drafts_keep_the_target_distribution():
    # an n-gram proposal is a point mass: told nothing, the sampler must still be exact
    p_logits = P
    q_logits = _logits([0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0])
    sp = SamplingParams(temperature=1.0)
    first, second = _first_two(p_logits, q_logits, sp, deterministic=True, seed=2)
    assert _pvalue(first, second, _dist(p_logits[0], sp), _dist(p_logits[1], sp)) > ALPHA


@pytest.mark.parametrize("told", ["peaked", "target"])
def test_a_biased_sampler_fails_the_same_test(told):
    # the test has the power to see a wrong sampler: drafts drawn from q but verified as
    # if drawn from another distribution (a peaked one, or the target itself: then every
    # draft is accepted and the output follows q). (Random drafts verified as point masses
    # are no such control: for each fixed draft that verification is exact.)
    p_logits, q_logits = PAIRS["different"]
    sp = SamplingParams(temperature=1.0)
    tell = PAIRS["draft_peaked"][1] if told == "peaked" else p_logits[:2]
    first, second = _first_two(p_logits, q_logits, sp, tell_q=tell)
    assert _pvalue(first, second, _dist(p_logits[0], sp), _dist(p_logits[1], sp)) < ALPHA


def _greedy_case():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 4, 20)).astype(np.float32)
    top = logits.argmax(-1)
    drafts = top[:, :3].copy()
    drafts[0, 1] += 1          # row 0: first matches, second does not
    drafts[1, 0] += 1          # row 1: none accepted
    num = np.array([3, 3, 3, 2], np.int32)  # row 2: all 3 accepted (+ bonus); row 3: 2 of 2
    return logits, drafts % 20, num, top


def test_greedy_accepts_the_longest_matching_prefix_then_the_argmax():
    logits, drafts, num, top = _greedy_case()
    sb = _batch([SamplingParams(temperature=0)] * 4, [0, 1, 2, 3])
    toks, lps, n = (np.asarray(x) for x in _verify_ngram(logits, drafts, num, sb))
    np.testing.assert_array_equal(n, [2, 1, 4, 3])
    np.testing.assert_array_equal(toks[0, :2], [drafts[0, 0], top[0, 1]])
    assert toks[1, 0] == top[1, 0]
    np.testing.assert_array_equal(toks[2], top[2])
    np.testing.assert_array_equal(toks[3, :3], top[3, :3])
    ref = np.asarray(jax.nn.log_softmax(logits, -1))
    for r, k in enumerate(n):
        np.testing.assert_allclose(lps[r, :k], ref[r, np.arange(k), toks[r, :k]], rtol=1e-5)
        assert (toks[r, k:] == 0).all()


def test_greedy_rows_beside_random_rows_stay_greedy():
    logits, drafts, num, top = _greedy_case()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    toks, _, n = (np.asarray(x) for x in _verify_ngram(logits, drafts, num,
                                                       _batch(params, [0, 1, 2, 3])))
    assert n[0] == 2 and (toks[0, :2] == [drafts[0, 0], top[0, 1]]).all()
    assert n[2] == 4 and (toks[2] == top[2]).all()


def test_no_drafts_is_a_plain_sample():
    logits, drafts, _, top = _greedy_case()
    sb = _batch([SamplingParams(temperature=0)] * 4, [0, 1, 2, 3])
    toks, _, n = (np.asarray(x) for x in _verify_ngram(logits, drafts, np.zeros(4, np.int32), sb))
    np.testing.assert_array_equal(n, 1)
    np.testing.assert_array_equal(toks[:, 0], top[:, 0])


def test_seeded_draws_are_reproducible_and_batch_independent():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(8, 3, V)).astype(np.float32)
    drafts = rng.integers(0, V, size=(8, 2)).astype(np.int32)
    num = np.full(8, 2, np.int32)
    sp = SamplingParams(temperature=1.0)
    sb = _batch([sp] * 8, list(range(100, 108)), [5] * 8)
    a = [np.asarray(x) for x in _verify_ngram(logits, drafts, num, sb)]
    b = [np.asarray(x) for x in _verify_ngram(logits, drafts, num, sb)]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    # row 3 alone (its own seed and step) draws what it drew in the batch of 8
    one = [np.asarray(x) for x in _verify_ngram(logits[3:4], drafts[3:4], num[3:4],
                                                 _batch([sp], [103], [5]))]
    np.testing.assert_array_equal(one[0][0], a[0][3])
    np.testing.assert_array_equal(one[2][0], a[2][3])
    # another seed draws differently somewhere
    c = np.asarray(_verify_ngram(logits, drafts, num, _batch([sp] * 8, list(range(8)), [5] * 8))[0])
    assert (c != a[0]).any()
