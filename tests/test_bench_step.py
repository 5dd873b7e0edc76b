"""`jaxserve bench step`'s shapes and batches (jaxserve/bench/step.py): what it times is
the step the shape names. Host-side only: the timing itself is a benchmark, not a test."""

import numpy as np
import pytest

from jaxserve.bench.step import make_batch, parse_shape, shape_pages

PS = 16


@pytest.mark.parametrize("text, want", [
    ("decode:32x16", ("decode", 32, 16, 0)),
    ("prefill:1x512", ("prefill", 1, 512, 0)),
    ("mixed:31x16x225", ("mixed", 31, 16, 225)),
])
def test_shapes_parse(text, want):
    assert parse_shape(text) == want


@pytest.mark.parametrize("text", ["decode:32", "mixed:31x16", "prefill:1x512x3", "decode:0x16",
                                  "mixed:2x-1x4", "verify:1x4", "decode:ax16"])
def test_a_malformed_shape_is_named(text):
    with pytest.raises(ValueError, match="expected decode:BxPAGES"):
        parse_shape(text)


def _rows_of(b, i):
    return slice(int(b.query_start[i]), int(b.query_start[i + 1]))


def test_a_mixed_batch_is_the_decode_rows_then_a_prompt_on_pages_of_its_own():
    B, L, T = 5, 3, 37
    num_pages = 1 + shape_pages("mixed", B, L, T, PS)
    assert num_pages == 1 + B * L + 3
    b, s = make_batch("mixed", B, L, PS, num_pages, np.random.default_rng(0), room=2, T=T)
    assert len(b.tokens) == B + T and b.block_tables.shape == (B + 1, L) and not b.decode
    assert list(b.query_start) == list(range(B + 1)) + [B + T]
    assert list(b.logits_indices) == list(range(B)) + [B + T - 1]
    tables = [b.block_tables[i] for i in range(B + 1)]
    used = [int(p) for t in tables[:B] for p in t] + [int(p) for p in tables[B][:3]]
    assert len(set(used)) == len(used) and 0 not in used  # no page shared, none the null page
    assert all(int(p) == 0 for p in tables[B][3:])  # the prompt's 3 pages, the rest null
    for i in range(B + 1):
        rows = _rows_of(b, i)
        ctx = L * PS - 2 if i < B else T
        assert b.seq_lens[i] == ctx
        assert list(b.positions[rows]) == (list(range(ctx - 1, ctx)) if i < B else list(range(T)))
        pos = b.positions[rows]
        np.testing.assert_array_equal(b.slot_mapping[rows],
                                      tables[i][pos // PS] * PS + pos % PS)
    assert s.temperature.shape[0] == B + 1


def test_decode_and_prefill_batches_keep_their_layout():
    rng = np.random.default_rng(1)
    b, _ = make_batch("decode", 4, 2, PS, 1 + shape_pages("decode", 4, 2, 0, PS), rng)
    assert b.decode and list(b.query_start) == [0, 1, 2, 3, 4]
    assert list(b.seq_lens) == [2 * PS - 3] * 4 and list(b.positions) == [2 * PS - 4] * 4
    b, _ = make_batch("prefill", 2, 20, PS, 1 + shape_pages("prefill", 2, 20, 0, PS), rng)
    assert not b.decode and list(b.query_start) == [0, 20, 40] and b.block_tables.shape == (2, 2)
    assert list(b.positions[:20]) == list(range(20)) and list(b.logits_indices) == [19, 39]


def test_a_pool_too_small_for_the_shape_is_named():
    with pytest.raises(ValueError, match=r"mixed:4x2x40 needs 11 pages, the pool has 9"):
        make_batch("mixed", 4, 2, PS, 10, np.random.default_rng(0), T=40)
