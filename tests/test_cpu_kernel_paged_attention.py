"""jaxserve.kernels.cpu.paged_attention: the C++ FFI kernel against its plain-jnp reference (decode and
packed ragged prefill, GQA, the compile-time and generic head dims, every work split), that it
reads only a row's own live slots, its input checks, and the library build cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.common import quantize_kv_int8
from jaxserve.kernels.cpu.paged_attention import paged_attention, paged_attention_reference
from kernel_utils import shuffled_pool

SEED = 20261123
ATOL = 2e-5  # f32 kernel vs HIGHEST-precision reference: summation order + exp polynomial


@pytest.fixture(scope="module", autouse=True)
def _library(cpu_kernels_library):
    return cpu_kernels_library


def _problem(rng, ctx_lens, q_lens, *, heads, kv_heads, head_dim, page_size, pages_per_seq,
             pad_rows=0, poison=True):
    """A flat ragged batch: sequence b's q_lens[b] queries are its last q_lens[b] tokens,
    packed one sequence after another, then pad_rows padding rows. Head-major pool
    [K, N, ps, Dh] with every slot that holds no context token set to NaN (poison), and the
    same pool with those slots zeroed (for the reference)."""
    k, v, tables, live = shuffled_pool(rng, ctx_lens, kv_heads=kv_heads, head_dim=head_dim,
                                       page_size=page_size, pages_per_seq=pages_per_seq)
    clean_k, clean_v = np.where(live[..., None, None], k, 0), np.where(live[..., None, None], v, 0)
    bad_k = np.where(live[..., None, None], k, np.nan) if poison else clean_k
    bad_v = np.where(live[..., None, None], v, np.nan) if poison else clean_v
    hm = lambda a: jnp.asarray(a.transpose(2, 0, 1, 3))  # noqa: E731  token- -> head-major
    ctx = np.asarray(ctx_lens, np.int32)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(query_start[-1]) + pad_rows
    positions = np.zeros(T, np.int32)
    for b, n in enumerate(q_lens):
        positions[query_start[b]:query_start[b + 1]] = np.maximum(ctx[b] - n + np.arange(n), 0)
    q = jnp.asarray(rng.standard_normal((T, heads, head_dim)), jnp.float32)
    return dict(q=q, k_pages=hm(bad_k), v_pages=hm(bad_v), block_tables=jnp.asarray(tables),
                seq_lens=jnp.asarray(ctx), query_start=jnp.asarray(query_start),
                positions=jnp.asarray(positions)), (hm(clean_k), hm(clean_v))


def _check(args, clean, **kw):
    out = np.asarray(paged_attention(**args, **kw))
    ref_args = dict(args, k_pages=clean[0], v_pages=clean[1])
    ref = np.asarray(paged_attention_reference(**ref_args))
    assert out.shape == ref.shape and np.isfinite(out).all(), "read a poisoned (non-live) slot"
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=ATOL)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [
    (9, 3, 64, 16),    # SmolLM2: GQA 3, the Dh=64 specialisation
    (9, 3, 64, 48),    # 32-key softmax steps across page ends
    (4, 4, 128, 8),    # MHA, the Dh=128 specialisation
    (6, 2, 40, 4),     # the generic head-dim path
])
def test_decode_matches_reference(heads, kv_heads, head_dim, page_size):
    rng = np.random.default_rng(SEED)
    P = 6
    # empty (padding) row, one token, exactly one page, one past a page, a full table
    ctx = [0, 1, page_size, page_size + 1, P * page_size, 3 * page_size - 2]
    args, clean = _problem(rng, ctx, [1] * len(ctx), heads=heads, kv_heads=kv_heads,
                           head_dim=head_dim, page_size=page_size, pages_per_seq=P)
    out = _check(args, clean)
    assert (out[0] == 0).all(), "the row of a padding sequence (seq_len 0) gives 0"


def test_long_decode_contexts_split_and_stay_batch_invariant():
    """Decode rows over more than kSplitPages (4) pages are split into page ranges and
    merged (flash-decoding): still the reference's output, a row seeing only part of its
    last range included, and each sequence's row is bit for bit the same alone as in the
    batch (the split depends only on its own context)."""
    rng = np.random.default_rng(SEED + 7)
    ps, P = 16, 20
    ctx = [5 * ps, 4 * ps, 9 * ps + 3, P * ps, 4 * ps + 1, 0, 13]
    args, clean = _problem(rng, ctx, [1] * len(ctx), heads=9, kv_heads=3, head_dim=64,
                           page_size=ps, pages_per_seq=P)
    together = _check(args, clean)
    for b in range(len(ctx)):
        alone = {name: (a[b:b + 1] if name in ("q", "block_tables", "seq_lens", "positions")
                        else a) for name, a in args.items()}
        alone["query_start"] = jnp.asarray([0, 1], jnp.int32)
        np.testing.assert_array_equal(np.asarray(paged_attention(**alone))[0], together[b])


@pytest.mark.parametrize("head_dim,pool,page_size", [(64, "float32", 16), (128, "bfloat16", 16),
                                                    (64, "float32", 48), (64, "int8", 16),
                                                    (128, "int8", 48)])
def test_a_row_has_the_same_bits_in_decode_and_in_a_prefill(head_dim, pool, page_size):
    """A work item of many rows (a prefill block) scores 16 keys at a time from a
    transposed page, one of a few rows (decode: the GQA group) key by key from the page as
    stored; both sum in the same order, so each query row is bit for bit the same alone, in
    decode, as inside a prefill of 20 rows (any q_block), and causal limits mid-page hold.
    Pages of 48 keys: a 32-key softmax step spans the end of one page and the start of the
    next (keys 32..63)."""
    rng = np.random.default_rng(SEED + 13)
    ctx, n = 57, 20
    args, clean = _problem(rng, [ctx], [n], heads=6, kv_heads=2, head_dim=head_dim,
                           page_size=page_size, pages_per_seq=4)
    if pool == "bfloat16":
        args = dict(args, **{name: jax.lax.bitcast_convert_type(
            args[name].astype(jnp.bfloat16), jnp.uint16) for name in ("k_pages", "v_pages")})
    elif pool == "int8":  # rows and scales; NaN slots' scales are NaN: still never read
        args = dict(args, **{name: quantize_kv_int8(args[name]) for name in ("k_pages", "v_pages")})
    else:
        _check(args, clean)
    prefill = {q_block: np.asarray(paged_attention(**args, q_block=q_block)) for q_block in (1, 7, 32)}
    for t in (0, 5, n - 1):  # positions 37, 42, 56: mid-page causal limits
        alone = dict(args, q=args["q"][t:t + 1], positions=args["positions"][t:t + 1],
                     query_start=jnp.asarray([0, 1], jnp.int32))
        row = np.asarray(paged_attention(**alone))[0]
        for q_block, out in prefill.items():
            np.testing.assert_array_equal(out[t], row, err_msg=f"q_block {q_block}, row {t}")


def _built_attention(library, target: str):
    """paged_attention's FFI call through `library`'s handler (a build for another
    target), registered as `target`; returns the output as numpy."""
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.JaxservePagedAttention),
                                platform="cpu")

    def call(q, k_pages, v_pages, block_tables, seq_lens, query_start, positions, q_block=32):
        fn = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return np.asarray(fn(q, k_pages, v_pages, jnp.zeros((), jnp.int32), block_tables,
                             seq_lens, query_start, positions, q_block=np.int64(q_block)))
    return call


@pytest.mark.parametrize("pool", ["float32", "bfloat16", "float8_e4m3fn", "int8"])
def test_avx2_path_matches_reference_and_a_row_keeps_its_bits(avx2_cpu_kernels, pool):
    """The build for x86-64-v3 (AVX2 and FMA, no AVX-512: Zen 1-3, Intel's client CPUs).
    Head dims 64 and 128 with pages of a multiple of 8 keys take the tiled path on 8-lane
    vectors (32-key softmax steps over four 8-key tiles; prefill items of >= 8 rows score
    from K^T, 2 rows at a time, decode items from K widened once); a page of 12 keys, the
    per-row path on 8-lane vectors; head dim 40, the scalar loop. Each against the
    reference on the same K/V values for every pool dtype, decode and ragged prefill, with
    slots that hold no context token poisoned (NaN) where the dtype has a NaN; and a row
    alone in decode has the bits it has inside a prefill of any q_block, on both vector
    paths (GQA 3: 3 decode rows, 21 rows for q_block 7, pairs and a 1-row remainder; a
    causal limit mid-page and mid-tile: 9 keys on the last 16-key page, a tile of 8 and
    one more)."""
    attend = _built_attention(avx2_cpu_kernels, "jaxserve_paged_attention_avx2_test")
    rng = np.random.default_rng(SEED + 19)
    narrow = {"bfloat16": jnp.bfloat16, "float8_e4m3fn": jnp.float8_e4m3fn}.get(pool)

    def problem(head_dim, q_lens, ctx, page_size):
        args, clean = _problem(rng, ctx, q_lens, heads=6, kv_heads=2,
                               head_dim=head_dim, page_size=page_size,
                               pages_per_seq=-(-96 // page_size), poison=narrow is None)
        if narrow is not None:
            args = dict(args, k_pages=args["k_pages"].astype(narrow),
                        v_pages=args["v_pages"].astype(narrow))
            return args, args
        if pool == "int8":
            return (_int8_pool(dict(args, k_pages=clean[0], v_pages=clean[1]), clean),
                    _int8_pool(dict(args, k_pages=clean[0], v_pages=clean[1])))
        return args, dict(args, k_pages=clean[0], v_pages=clean[1])

    for case in ((64, [1] * 5, [0, 1, 17, 40, 96], 16), (128, [1, 14], [50, 33], 16),
                 (64, [3, 1, 30], [90, 9, 75], 8), (128, [1, 2, 9], [41, 70, 9], 8),
                 (64, [2, 1, 11], [40, 13, 60], 12), (40, [3, 1, 5], [3, 21, 40], 16)):
        args, ref_args = problem(*case)
        out = attend(**args)
        assert np.isfinite(out).all(), "read a slot holding no context token"
        np.testing.assert_allclose(out, np.asarray(paged_attention_reference(**ref_args)),
                                   atol=ATOL, rtol=ATOL, err_msg=f"case {case}")
    for page_size in (16, 12):  # the tiled path, the per-row path
        args, ref_args = problem(64, [20], [57], page_size)
        prefill = {q_block: attend(**args, q_block=q_block) for q_block in (1, 7, 32)}
        np.testing.assert_allclose(prefill[32], np.asarray(paged_attention_reference(**ref_args)),
                                   atol=ATOL, rtol=ATOL)
        for t in (0, 5, 19):  # positions 37, 42, 56
            alone = dict(args, q=args["q"][t:t + 1], positions=args["positions"][t:t + 1],
                         query_start=jnp.asarray([0, 1], jnp.int32))
            row = attend(**alone)[0]
            for q_block, got in prefill.items():
                np.testing.assert_array_equal(got[t], row, err_msg=f"page size {page_size}, "
                                              f"q_block {q_block}, row {t}")


@pytest.mark.parametrize("narrow, bits", [(jnp.bfloat16, jnp.uint16),
                                           (jnp.float8_e4m3fn, jnp.uint8)], ids=["bf16", "fp8"])
def test_narrow_pool_matches_reference_on_the_widened_pool(narrow, bits):
    """A bf16 pool (half the bytes read) or an fp8 e4m3fn one (a quarter): the reference
    on the same narrow values, decode and a ragged prefill, the Dh=64 and generic head-dim
    paths; the engine's storage of the pool as its bits reads the same."""
    rng = np.random.default_rng(SEED + 11)
    for head_dim, q_lens, ctx in ((64, [1] * 5, [0, 1, 17, 40, 96]), (40, [3, 1, 5], [3, 21, 40]),
                                  (64, [9, 12], [30, 12])):
        args, clean = _problem(rng, ctx, q_lens, heads=6, kv_heads=2, head_dim=head_dim,
                               page_size=16, pages_per_seq=6, poison=False)
        args = dict(args, k_pages=args["k_pages"].astype(narrow),
                    v_pages=args["v_pages"].astype(narrow))
        out = np.asarray(paged_attention(**args))
        ref = np.asarray(paged_attention_reference(**args))
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=ATOL)
        f32 = np.asarray(paged_attention_reference(**dict(args, k_pages=clean[0], v_pages=clean[1])))
        assert 1e-4 < np.abs(out - f32).max() < 0.25, "the narrow dtype rounds the K/V, a little"
        # the engine stores a narrow pool as its bits (jaxserve.model.kv_cache): the same
        as_bits = {n: jax.lax.bitcast_convert_type(args[n], bits) for n in ("k_pages", "v_pages")}
        np.testing.assert_array_equal(np.asarray(paged_attention(**dict(args, **as_bits))), out)
        np.testing.assert_array_equal(
            np.asarray(paged_attention_reference(**dict(args, **as_bits))), ref)
    with pytest.raises(ValueError, match="v_pages must be one of"):
        paged_attention(**dict(args, v_pages=args["v_pages"].astype(jnp.float32)))


def _int8_pool(args, poison_clean=None):
    """args' K/V pools quantised to int8 rows (jaxserve.kernels.common.quantize_kv_int8);
    with `poison_clean` (the zeroed pools of _problem), the slots that hold no context token
    get a NaN scale (the rows of the clean pool where it is 0 everywhere)."""
    out = {}
    for name, clean in zip(("k_pages", "v_pages"), poison_clean or (None, None)):
        rows = quantize_kv_int8(args[name])
        if clean is not None:
            dead = jnp.all(clean == 0, axis=-1, keepdims=True)
            nan = jax.lax.bitcast_convert_type(jnp.float32(jnp.nan), jnp.int8)
            rows = jnp.where(dead, jnp.concatenate(
                [rows[..., :-4], jnp.broadcast_to(nan, rows.shape[:-1] + (4,))], -1), rows)
        out[name] = rows
    return dict(args, **out)


def test_int8_pool_matches_reference_on_the_same_values():
    """An int8 pool (each (token, head) row: int8 values and their f32 scale): the
    reference on the same dequantised values, decode and a ragged prefill (the tiled path),
    head dims 64 / 128 / generic 40; a slot holding no context token (its scale NaN) is
    never read; against the f32 pool, the int8 rounding's error: each value within half its
    row's scale, so the output moves by more than nothing and less than the bound."""
    rng = np.random.default_rng(SEED + 17)
    for head_dim, q_lens, ctx in ((64, [1] * 5, [0, 1, 17, 40, 96]), (40, [3, 1, 5], [3, 21, 40]),
                                  (64, [9, 12], [30, 12]), (128, [1, 14], [50, 33])):
        f32_args, clean = _problem(rng, ctx, q_lens, heads=6, kv_heads=2, head_dim=head_dim,
                                   page_size=16, pages_per_seq=6)
        args = _int8_pool(dict(f32_args, k_pages=clean[0], v_pages=clean[1]), clean)
        assert args["k_pages"].dtype == jnp.int8 and args["k_pages"].shape[-1] == head_dim + 4
        out = np.asarray(paged_attention(**args))
        assert np.isfinite(out).all(), "read a slot holding no context token"
        ref = np.asarray(paged_attention_reference(**_int8_pool(
            dict(f32_args, k_pages=clean[0], v_pages=clean[1]))))
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=ATOL)
        f32 = np.asarray(paged_attention_reference(**dict(f32_args, k_pages=clean[0],
                                                          v_pages=clean[1])))
        # a value moves by at most its row's max / 254 (~0.02 for rows of standard
        # normals): the output's V part by that, its scores by |q| |dk| / sqrt(Dh) each
        assert 1e-5 < np.abs(out - f32).max() < 0.1
    with pytest.raises(ValueError, match=r"k_pages' last axis must be 132 \(head_dim 128 \+ 4"):
        paged_attention(**dict(args, k_pages=args["k_pages"][..., :-1],
                               v_pages=args["v_pages"][..., :-1]))


@pytest.mark.parametrize("head_dim, rows", [(64, 1), (64, 8), (40, 1)],
                         ids=["vector", "tiled", "scalar"])
def test_every_int8_value_is_dequantised_as_its_product(head_dim, rows):
    """Each int8 value -127..127 times its row's scale, as the only visible value of a
    sequence (softmax over one key is 1), comes out as the f32 product q * s exactly: the
    AVX-512 paths (decode, the tiled prefill's widened V) and the scalar one."""
    values = np.arange(-127, 128, dtype=np.int8)
    S = -(-values.size // head_dim)
    v_vals = np.zeros(S * head_dim, np.int8)
    v_vals[:values.size] = values
    scales = np.float32(0.0123) * (1 + np.arange(S, dtype=np.float32))  # not powers of 2
    ps = 16
    v = np.zeros((1, S + 1, ps, head_dim + 4), np.int8)
    v[0, 1:, 0, :head_dim] = v_vals.reshape(S, head_dim)
    v[0, 1:, 0, head_dim:] = scales.view(np.int8).reshape(S, 4)
    want = v_vals.reshape(S, head_dim).astype(np.float32) * scales[:, None]
    _assert_one_key_per_sequence_gives(v, want, rows)


def _assert_one_key_per_sequence_gives(v: np.ndarray, want: np.ndarray, rows: int) -> None:
    """Sequence b's one token on page b + 1 of the pool v [1, S + 1, ps, W] (K zero), `rows`
    query rows each, 2 query heads: every output row is V's value row want[b] exactly (a
    softmax over one key is 1)."""
    S, head_dim = want.shape
    q = jnp.asarray(np.random.default_rng(SEED).standard_normal((S * rows, 2, head_dim)),
                    jnp.float32)
    out = paged_attention(q, jnp.asarray(np.zeros_like(v)), jnp.asarray(v),
                          jnp.arange(1, S + 1, dtype=jnp.int32)[:, None],
                          jnp.ones(S, jnp.int32), jnp.arange(S + 1, dtype=jnp.int32) * rows,
                          jnp.zeros(S * rows, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out).reshape(S, rows, 2, head_dim),
                                  np.broadcast_to(want[:, None, None], (S, rows, 2, head_dim)))


@pytest.mark.parametrize("head_dim, rows", [(64, 1), (64, 8), (40, 1)],
                         ids=["vector", "tiled", "scalar"])
def test_every_fp8_value_is_widened_exactly(head_dim, rows):
    """Each of the 254 finite e4m3fn values (subnormals, both zeros, +-448 included) as the
    only visible value of a sequence comes out exactly (softmax over one key is 1): the
    AVX-512 conversion (Dh 64, decode and the tiled prefill's widened V) and the scalar one
    (generic Dh) both equal ml_dtypes' widening."""
    values = np.arange(256, dtype=np.uint8)
    values = values[(values & 0x7F) != 0x7F]  # not NaN
    S = -(-values.size // head_dim)
    v_rows = np.zeros(S * head_dim, np.uint8)
    v_rows[:values.size] = values
    ps = 16
    v = np.zeros((1, S + 1, ps, head_dim), np.uint8)
    v[0, 1:, 0] = v_rows.reshape(S, head_dim)  # sequence b's one token on page b + 1
    want = v_rows.view(jnp.float8_e4m3fn).astype(np.float32).reshape(S, head_dim)
    _assert_one_key_per_sequence_gives(v, want, rows)


@pytest.mark.parametrize("q_block", [1, 3, 32])
def test_ragged_prefill_is_causal_and_matches_reference(q_block):
    """Packed sequences of different query counts at their last positions: whole prompts,
    continuations over pages cached before them (chunked prefill), a padding sequence and
    padding rows; causal within a chunk (a query sees no later token of its own chunk);
    every query-block split gives the same."""
    rng = np.random.default_rng(SEED + q_block)
    args, clean = _problem(rng, [8, 3, 0, 21, 40], [8, 3, 0, 8, 13], heads=9, kv_heads=3,
                           head_dim=64, page_size=16, pages_per_seq=3, pad_rows=5)
    out = _check(args, clean, q_block=q_block)
    assert (out[-5:] == 0).all(), "rows past the last sequence give 0"
    # causality, checked directly: changing the last token's K/V leaves earlier queries alone
    last = int(args["seq_lens"][3]) - 1
    page = int(args["block_tables"][3, last // 16])
    moved = dict(args, k_pages=args["k_pages"].at[:, page, last % 16].add(5.0),
                 v_pages=args["v_pages"].at[:, page, last % 16].add(5.0))
    out2 = np.asarray(paged_attention(**moved, q_block=q_block))
    rows = slice(int(args["query_start"][3]), int(args["query_start"][4]))
    np.testing.assert_array_equal(out2[rows][:-1], out[rows][:-1])
    assert np.abs(out2[rows][-1] - out[rows][-1]).max() > 1e-3
    others = np.r_[0:rows.start, rows.stop:out.shape[0]]
    np.testing.assert_array_equal(out2[others], out[others])


@pytest.mark.parametrize("query_start", [[0, 2, 1], [0, 1, 9]])
def test_bad_query_start_raises_instead_of_writing_out_of_bounds(query_start):
    rng = np.random.default_rng(SEED)
    args, _ = _problem(rng, [4, 4], [1, 1], heads=9, kv_heads=3, head_dim=64, page_size=16,
                       pages_per_seq=1, pad_rows=1)
    args["query_start"] = jnp.asarray(query_start, jnp.int32)
    with pytest.raises(Exception, match="query_start"):
        jax.block_until_ready(paged_attention(**args))


def test_long_context_softmax_is_stable():
    """Large logits (|q.k| ~ 1e3) over many pages: the online softmax rescales without
    overflow and still matches the reference."""
    rng = np.random.default_rng(SEED)
    args, clean = _problem(rng, [200, 130], [1, 1], heads=9, kv_heads=3, head_dim=64, page_size=16,
                           pages_per_seq=16, poison=False)
    args["q"] = args["q"] * 30.0
    _check(args, clean)


def test_bad_page_id_raises_instead_of_reading_out_of_bounds():
    rng = np.random.default_rng(SEED)
    args, _ = _problem(rng, [20], [1], heads=9, kv_heads=3, head_dim=64, page_size=16, pages_per_seq=2)
    args["block_tables"] = args["block_tables"].at[0, 1].set(10_000)
    with pytest.raises(Exception, match="page id outside"):
        jax.block_until_ready(paged_attention(**args))


@pytest.mark.parametrize("field,value,match", [
    ("q", jnp.zeros((2, 9, 64), jnp.bfloat16), r"q must be one of \(float32\), got bfloat16"),
    ("q", jnp.zeros((2, 1, 9, 64), jnp.float32), r"q must have shape \[\*, \*, \*\]"),
    ("k_pages", jnp.zeros((3, 4, 16, 32), jnp.float32), r"k_pages' last axis must be 64 \(head_dim 64\), got 32"),
    ("v_pages", jnp.zeros((3, 5, 16, 64), jnp.float32), r"v_pages must have shape \[3, 4, 16, 64\]"),
    ("q", jnp.zeros((2, 8, 64), jnp.float32), "q_heads must be a multiple of kv_heads, got q_heads 8"),
    ("seq_lens", jnp.zeros((3,), jnp.int32), r"seq_lens must have shape \[2\]"),
    ("seq_lens", jnp.zeros((2,), jnp.float32), r"seq_lens must be one of \(int32\), got float32"),
    ("query_start", jnp.zeros((2,), jnp.int32), r"query_start must have shape \[3\]"),
    ("positions", jnp.zeros((2, 1), jnp.int32), r"positions must have shape \[2\]"),
])
def test_bad_inputs_name_the_field(field, value, match):
    args = dict(q=jnp.zeros((2, 9, 64), jnp.float32), k_pages=jnp.zeros((3, 4, 16, 64), jnp.float32),
                v_pages=jnp.zeros((3, 4, 16, 64), jnp.float32), block_tables=jnp.zeros((2, 2), jnp.int32),
                seq_lens=jnp.zeros((2,), jnp.int32), query_start=jnp.arange(3, dtype=jnp.int32),
                positions=jnp.zeros((2,), jnp.int32))
    args[field] = value
    with pytest.raises(ValueError, match=match):
        paged_attention(**args)


def test_a_stacked_pool_is_read_at_its_layer():
    """Stacked pools [L, K, N, ps, Dh] (a layer loop's) at `layer`, given as an int and
    traced inside lax.scan, f32 and bf16 bits: each layer's output is the one-layer call's
    exactly; a layer outside the stack fails the call, naming it."""
    rng = np.random.default_rng(SEED + 7)
    problems = [_problem(rng, [37, 5, 60], [1, 5, 12], heads=9, kv_heads=3, head_dim=64,
                         page_size=16, pages_per_seq=4, poison=False)[0] for _ in range(3)]
    args = problems[0]
    for dtype in (jnp.float32, jnp.uint16):
        pools = [(p["k_pages"], p["v_pages"]) for p in problems]
        if dtype == jnp.uint16:  # a bf16 pool as jaxserve stores it: the bits
            pools = [tuple(jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16), jnp.uint16)
                           for a in kv) for kv in pools]
        k = jnp.stack([kv[0] for kv in pools])
        v = jnp.stack([kv[1] for kv in pools])
        want = np.stack([np.asarray(paged_attention(**dict(args, k_pages=kv[0], v_pages=kv[1])))
                         for kv in pools])
        assert np.abs(want[0] - want[1]).max() > 0.1  # the layers differ
        for i in range(3):
            got = paged_attention(**dict(args, k_pages=k, v_pages=v), layer=i)
            np.testing.assert_array_equal(np.asarray(got), want[i])
        _, got = jax.lax.scan(
            lambda c, i: (c, paged_attention(**dict(args, k_pages=k, v_pages=v), layer=i)), 0,
            jnp.arange(3, dtype=jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(Exception, match="paged_attention: layer must be in"):
        np.asarray(paged_attention(**dict(args, k_pages=k, v_pages=v), layer=3))
    with pytest.raises(ValueError, match="k_pages must have shape"):
        paged_attention(**args, layer=0)  # a layer of one layer's pool


def test_library_is_built_once_and_cached(tmp_path, cpu_kernels_library):
    """The cached file is keyed by what goes into it, and a second load reuses it."""
    from jaxserve.kernels.cpu import build
    key_a = build.build_key(build.find_compiler(), sorted(build.SOURCE_DIR.glob("*.cc")))
    src = tmp_path / "extra.cc"
    src.write_text("// a change to any source changes the key\n")
    key_b = build.build_key(build.find_compiler(),
                             sorted(build.SOURCE_DIR.glob("*.cc")) + [src])
    assert key_a != key_b and len(key_a) == 16
    # and so does a flag (the tests' portable build is cached beside the native one)
    assert build.build_key(build.find_compiler(), sorted(build.SOURCE_DIR.glob("*.cc")),
                           ("-march=x86-64-v2",)) != key_a
    assert build.load_library(tmp_path) is cpu_kernels_library  # loaded once per process


def test_a_failed_build_names_the_compiler_output(tmp_path):
    from jaxserve.kernels.cpu import build
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    with pytest.raises(build.KernelBuildError, match="compiling the CPU kernels failed"):
        build._compile(build.find_compiler(), [bad], tmp_path / "out.so")
    assert not list(tmp_path.glob("*.so")), "no partial library left behind"
