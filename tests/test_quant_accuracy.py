"""tools/quant_accuracy.py's parts that need no model: the windows of the text and the
distances between two sets of next-token distributions (the real model's bounds are in
tests/test_gguf_serving.py)."""

import math

import numpy as np
import pytest

from tools import quant_accuracy as qa


def test_windows_start_with_bos_and_cover_the_text_once():
    ids = list(range(10, 30))  # 20 tokens
    w = qa.windows(ids, 8, bos=1)
    assert all(x[0] == 1 for x in w) and all(len(x) <= 8 for x in w)
    assert [t for x in w for t in x[1:]] == ids  # each token once, in order
    assert qa.windows(list(range(15)), 8, bos=0) == [[0, *range(7)], [0, *range(7, 14)]]
    # the last piece, 1 token: dropped
    assert qa.windows([5, 6, 7, 8, 9, 10, 11, 12], 8, bos=0) == [[0, 5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(ValueError, match="window must be >= 3"):
        qa.windows(ids, 2, bos=1)


def test_compare_gives_kl_top1_and_perplexity():
    ref = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]]))
    same = qa.compare(ref, ref, np.array([0, 1]))
    assert same["kl"] == pytest.approx(0.0, abs=1e-12) and same["top1"] == 1.0
    assert same["ppl"] == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.6)) / 2))
    other = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.6, 0.3]]))
    r = qa.compare(ref, other, np.array([0, 1]))
    # row 0: 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) = 0.25 ln 2; row 1: 0
    assert r["kl"] == pytest.approx(0.25 * math.log(2) / 2)
    assert r["top1"] == 0.5 and r["positions"] == 2
    assert r["ppl"] == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.6)) / 2))
    # row 0's top two are ln 2 < 1 nat apart (not confident); row 1's ln 2 too: no
    # confident position, counted as agreeing
    assert r["confident"] == 0.0 and r["top1_confident"] == 1.0
    sharp = np.log(np.array([[0.9, 0.05, 0.05], [0.1, 0.6, 0.3]]))  # row 0: ln 18 apart
    flipped = np.log(np.array([[0.05, 0.9, 0.05], [0.1, 0.6, 0.3]]))
    r = qa.compare(sharp, flipped, np.array([0, 1]))
    assert r["confident"] == 0.5 and r["top1_confident"] == 0.0 and r["top1"] == 0.5


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="unknown variant.*'q5_k'"):
        qa.measure(["f32", "q5_k"], "text", 16)
