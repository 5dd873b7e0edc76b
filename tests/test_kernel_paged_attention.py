"""jaxserve.kernels.pallas.paged_attention: the paged decode kernel (interpret mode) against its plain-jnp
reference, the reference against an independent float64 numpy softmax, int8 / fp8 pages,
input validation, and CUDA lowering at the engine's shapes.

Every case draws each sequence's pages from a shuffled pool (block tables are not 0..n),
points the block-table columns past a sequence's last page at random pages, and poisons
every pool slot that holds no context token (NaN for float / fp8 pages, -128 for int8 with a
NaN scale on pages no context uses), so a read the kernel should not make, or an output it
forgets to write (interpret mode starts outputs at NaN), fails the test.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_utils import DTYPES, NARROW_POOLS, case_grid, narrow_pool, shuffled_pool
from jaxserve.kernels.pallas.common import FP8_E4M3, INT8
from jaxserve.kernels.pallas.paged_attention import (_default_blocks, paged_attention,
                                                     paged_attention_reference)

INTERPRET = "pallas_interpret"
# Kernel vs reference: same inputs, f32 scores and softmax in both; they differ by the f32
# summation order (online softmax, split merge) and, for bf16, by p rounded to bf16 for the
# p @ v dot (<= 2^-9 relative) and one rounding of the output (outputs are O(1)).
TOLERANCES = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# Reference (f32) vs float64 numpy: f32 rounding only.
F64_TOL = dict(rtol=2e-5, atol=2e-5)
FORMATS = {"int8": INT8, "fp8": FP8_E4M3}


def _case(rng, ctx_lens, *, q_heads, kv_heads, head_dim, page_size, pages_per_seq,
          dtype=jnp.float32, fmt=None, spare_pages=3):
    """(args, kwargs) for paged_attention: float pages (dead slots NaN) or, with fmt, pages
    quantised per page and head (dead slots poisoned, unused pages' scales NaN)."""
    k, v, tables, live = shuffled_pool(rng, ctx_lens, kv_heads=kv_heads, head_dim=head_dim,
                               page_size=page_size, pages_per_seq=pages_per_seq,
                               spare_pages=spare_pages)
    q = jnp.asarray(rng.standard_normal((len(ctx_lens), q_heads, head_dim)), dtype)
    meta = (jnp.asarray(tables), jnp.asarray(ctx_lens, jnp.int32))
    if fmt is None:
        k[~live], v[~live] = np.nan, np.nan
        return (q, jnp.asarray(k, dtype), jnp.asarray(v, dtype)) + meta, {}
    kw = {}
    pages = []
    for name, x in (("k_scales", k), ("v_scales", v)):
        stored, scale = fmt.quantize(jnp.asarray(x), (1, 3))  # scale [num_pages, 1, kv_heads, 1]
        stored, scale = np.array(stored), np.array(scale).reshape(x.shape[0], x.shape[2])
        stored[~live] = -128 if fmt is INT8 else np.nan
        scale[~live.any(axis=1)] = np.nan
        pages.append(jnp.asarray(stored))
        kw[name] = jnp.asarray(scale)
    return (q, *pages) + meta, kw


def _dequantized(args, kw, fmt, dtype):
    """args with the pages dequantised (f32, as the reference does) and cast to `dtype`."""
    q, kq, vq, tables, lens = args
    k = fmt.dequantize(kq, kw["k_scales"][:, None, :, None]).astype(dtype)
    v = fmt.dequantize(vq, kw["v_scales"][:, None, :, None]).astype(dtype)
    return q, k, v, tables, lens


def _dense_numpy(q, k_pages, v_pages, tables, ctx_lens, sm_scale):
    """Independent float64 softmax, one sequence / head at a time."""
    q, kp, vp = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k_pages, v_pages))
    _, page_size, kv_heads, head_dim = kp.shape
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for b, c in enumerate(np.asarray(ctx_lens)):
        if c == 0:
            continue
        keys = kp[np.asarray(tables)[b]].reshape(-1, kv_heads, head_dim)[:c]
        vals = vp[np.asarray(tables)[b]].reshape(-1, kv_heads, head_dim)[:c]
        for h in range(q.shape[1]):
            s = keys[:, h // group] @ q[b, h] * sm_scale
            p = np.exp(s - s.max())
            out[b, h] = p @ vals[:, h // group] / p.sum()
    return out


def _assert_matches(out, ref, args, dtype):
    """Kernel output == reference (per-dtype tolerance), finite, context-0 rows exactly 0."""
    assert out.shape == ref.shape == args[0].shape and out.dtype == ref.dtype == jnp.dtype(dtype)
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (unwritten output or unmasked read)"
    empty = np.asarray(args[4]) == 0
    assert (out32[empty] == 0).all(), "a context-0 (padding) row must output exactly 0"
    np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)), **TOLERANCES[dtype])
    return out32


# name: (context_lens, q_heads, kv_heads, head_dim, page_size, pages_per_seq,
#        pages_per_compute_block, num_splits) -- None = the default
CASES = {
    "ctx1-gqa1-d64": ([1], 2, 2, 64, 16, 4, None, None),
    "page-boundaries-gqa3": ([16, 32, 64], 6, 2, 64, 16, 4, 1, 2),
    "partial-last-page-gqa8-d128": ([21, 5, 40], 8, 1, 128, 16, 4, 2, 1),
    # 23 pages -> 12 blocks of 2 pages (table padded to 24), 3 blocks per split; ctx 20
    # leaves splits 1..3 empty, 184 fills the table
    "splits-tail-gqa3": ([150, 20, 184], 3, 1, 64, 8, 23, 2, 4),
    "mixed-padding-gqa4-d128": ([0, 1, 3, 127, 64], 8, 2, 128, 16, 8, 2, 2),
    "defaults-gqa8": ([200, 33], 16, 2, 64, 16, 16, None, None),
}


def _run_case(name, dtype, fmt=None, impl=INTERPRET):
    ctx, hq, hkv, d, ps, pps, ppcb, splits = CASES[name]
    args, kw = _case(np.random.default_rng(1234), ctx, q_heads=hq, kv_heads=hkv, head_dim=d,
                     page_size=ps, pages_per_seq=pps, dtype=dtype, fmt=fmt)
    out = paged_attention(*args, **kw, pages_per_compute_block=ppcb, num_splits=splits,
                          impl=impl)
    return out, args, kw


@pytest.mark.parametrize("name,dtype", case_grid(list(CASES), DTYPES))
def test_kernel_matches_reference(name, dtype, pallas_impl):
    out, args, _ = _run_case(name, dtype, impl=pallas_impl)
    _assert_matches(out, paged_attention_reference(*args), args, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", ["splits-tail-gqa3", "mixed-padding-gqa4-d128"])
def test_quantized_pages_match_dequantize_then_reference(name, fmt, dtype, pallas_impl):
    """int8 / fp8 pages with per-page-per-head scales vs the reference on the dequantised
    pages (in q's dtype) and vs the reference given the scales."""
    out, args, kw = _run_case(name, dtype, FORMATS[fmt], impl=pallas_impl)
    deq = _dequantized(args, kw, FORMATS[fmt], dtype)
    _assert_matches(out, paged_attention_reference(*deq), args, dtype)
    _assert_matches(out, paged_attention_reference(*args, **kw), args, dtype)


@pytest.mark.parametrize("name,pool", case_grid(["splits-tail-gqa3", "mixed-padding-gqa4-d128"],
                                                {p: p for p in NARROW_POOLS}))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_engine_narrow_pools_match_reference(name, pool, dtype, pallas_impl):
    """The engine's own narrow pools, without separate scales: fp8 e4m3fn pages (scale 1)
    and int8 rows carrying their f32 scale in their last 4 bytes (assembled in the kernel
    from the bytes): the reference on the same pool, whose dead slots (NaN, NaN scales)
    are never read; the rows' scales are applied (the reference on the f32 pool is close,
    the int8 values alone far)."""
    ctx, hq, hkv, d, ps, pps, ppcb, splits = CASES[name]
    (q, k, v, tables, lens), _ = _case(np.random.default_rng(1234), ctx, q_heads=hq,
                                       kv_heads=hkv, head_dim=d, page_size=ps,
                                       pages_per_seq=pps, dtype=jnp.float32)
    args = (q.astype(dtype), narrow_pool(k, pool), narrow_pool(v, pool), tables, lens)
    assert args[1].shape[-1] == d + (4 if pool == "int8-rows" else 0)
    out = paged_attention(*args, pages_per_compute_block=ppcb, num_splits=splits, impl=pallas_impl)
    got = _assert_matches(out, paged_attention_reference(*args), args, dtype)
    f32 = np.asarray(paged_attention_reference(q, k, v, tables, lens))
    assert np.abs(got - f32).max() < 0.2  # an 8-bit rounding of K/V
    if pool == "int8-rows":  # the values without their scales: another result
        one = jax.lax.bitcast_convert_type(jnp.float32(1), jnp.int8)  # [4] bytes
        unscaled = [x.at[..., d:].set(one) for x in args[1:3]]
        far = np.asarray(paged_attention_reference(q.astype(dtype), *unscaled, tables, lens)
                         .astype(jnp.float32))
        assert np.abs(got - far)[np.asarray(lens) > 0].max() > 1.0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_with_scales_is_reference_on_dequantized_pages(fmt):
    """Bit-exact: the reference dequantises (stored * scale, f32) and then runs its float
    path, so with f32 q it equals itself on the f32 dequantised pages."""
    args, kw = _case(np.random.default_rng(1234), [0, 7, 40, 64], q_heads=6, kv_heads=2,
                     head_dim=32, page_size=8, pages_per_seq=8, fmt=FORMATS[fmt])
    got = np.asarray(paged_attention_reference(*args, **kw))
    want = np.asarray(paged_attention_reference(*_dequantized(args, kw, FORMATS[fmt], jnp.float32)))
    assert np.isfinite(got).all() and (got[0] == 0).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ctx,hq,hkv", [([5], 2, 2), ([0, 9, 24, 1], 6, 2), ([17, 32], 8, 1)])
def test_reference_is_dense_softmax(ctx, hq, hkv):
    args, _ = _case(np.random.default_rng(1234), ctx, q_heads=hq, kv_heads=hkv, head_dim=16,
                    page_size=8, pages_per_seq=4)
    ref = np.asarray(paged_attention_reference(*args))
    np.testing.assert_allclose(ref, _dense_numpy(*args, sm_scale=16 ** -0.5), **F64_TOL)
    bf = paged_attention_reference(*(a.astype(jnp.bfloat16) if i < 3 else a
                                     for i, a in enumerate(args)))
    assert bf.dtype == jnp.bfloat16


def test_sm_scale_and_wrong_block_table(pallas_impl):
    """A non-default sm_scale reaches both; and the test can fail: the reference on a
    shuffled block table (same pages, wrong order) is far from the kernel's output."""
    args, _ = _case(np.random.default_rng(1234), [40, 23], q_heads=4, kv_heads=2, head_dim=32,
                    page_size=8, pages_per_seq=8, spare_pages=0)
    out = paged_attention(*args, sm_scale=0.3, pages_per_compute_block=2, num_splits=2,
                          impl=pallas_impl)
    got = _assert_matches(out, paged_attention_reference(*args, sm_scale=0.3), args, jnp.float32)
    atol = TOLERANCES[jnp.float32]["atol"]
    assert np.abs(got - np.asarray(paged_attention_reference(*args))).max() > 100 * atol
    q, kp, vp, tables, lens = args
    wrong = np.asarray(tables).copy()
    wrong[[0, 1], 0] = wrong[[1, 0], 0]  # the two sequences' first (full) pages swapped
    wrong_ref = np.asarray(paged_attention_reference(q, kp, vp, jnp.asarray(wrong), lens,
                                                     sm_scale=0.3))
    assert np.isfinite(wrong_ref).all()
    assert (np.abs(got - wrong_ref).max(axis=(1, 2)) > 100 * atol).all()


def test_default_blocks():
    """Defaults are powers of two; a block is 64-128 keys (>= 16, <= the table's pages
    where that allows 16 keys); long tables get split-K with >= 4 blocks per split."""
    for pps in (1, 2, 4, 32, 256, 512, 2048):
        for ps in (4, 8, 16, 32, 64):
            for d, item in ((64, 2), (128, 2), (64, 4), (128, 1)):
                ppcb, splits = _default_blocks(pps, ps, d, item)
                assert ppcb & (ppcb - 1) == 0 and splits & (splits - 1) == 0
                assert ppcb * ps >= 16 and 1 <= splits <= 16
                assert ppcb * ps <= 128 or ppcb == 1 or ppcb * ps // 2 < 16
                blocks = -(-pps // ppcb)
                assert splits == 1 or blocks // splits >= 4
    assert _default_blocks(512, 16, 128, 2) == (4, 16)  # Llama 8k context: 64 keys, 16 splits
    assert _default_blocks(64, 16, 64, 2) == (8, 2)  # SmolLM2 1k context: 128 keys, 2 splits
    assert _default_blocks(4, 16, 64, 2) == (4, 1)  # short table: one block


def _bad_calls():
    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    q, kp, bt, cl = S((2, 4, 64), f32), S((9, 8, 2, 64), f32), S((2, 4), i32), S((2,), i32)
    k8, sc = S((9, 8, 2, 64), jnp.int8), S((9, 2), f32)
    q8 = dict(k_scales=sc, v_scales=sc)
    return [
        ((S((2, 256), f32), kp, kp, bt, cl), {}, r"q must have shape \[\*, \*, \*\], got \[2, 256\]"),
        ((S((2, 4, 64), i32), kp, kp, bt, cl), {}, r"q must be one of \(float32, bfloat16, float16\), got int32"),
        ((q, S((9, 8, 2, 32), f32), kp, bt, cl), {}, r"k_pages must have shape \[\*, \*, \*, 64\], got \[9, 8, 2, 32\]"),
        ((q, S((9, 8, 2, 64), jnp.bfloat16), kp, bt, cl), {},
         r"k_pages must be one of \(float32, int8, float8_e4m3fn\), got bfloat16"),
        ((q, kp, S((9, 4, 2, 64), f32), bt, cl), {}, r"v_pages must have shape \[9, 8, 2, 64\], got \[9, 4, 2, 64\]"),
        ((q, k8, S((9, 8, 2, 64), jnp.float8_e4m3fn), bt, cl), q8,
         r"v_pages must be one of \(int8\), got float8_e4m3fn"),
        ((q, S((9, 8, 3, 64), f32), S((9, 8, 3, 64), f32), bt, cl), {},
         r"q_heads must be a multiple of kv_heads, got q_heads 4, kv_heads 3"),
        ((q, kp, kp, S((3, 4), i32), cl), {}, r"block_tables must have shape \[2, \*\], got \[3, 4\]"),
        ((q, kp, kp, S((2, 4), jnp.int16), cl), {}, r"block_tables must be one of \(int32\), got int16"),
        ((q, kp, kp, bt, S((2,), f32)), {}, r"context_lens must be one of \(int32\), got float32"),
        ((q, kp, kp, bt, S((3,), i32)), {}, r"context_lens must have shape \[2\], got \[3\]"),
        ((q, k8, k8, bt, cl), {}, r"k_scales \[num_pages, kv_heads\] f32 is required for int8 pages"),
        ((q, k8, k8, bt, cl), dict(k_scales=sc), r"v_scales .* is required for int8 pages"),
        ((q, kp, kp, bt, cl), q8, r"k_scales must be None for float32 pages"),
        ((q, k8, k8, bt, cl), dict(k_scales=S((9,), f32), v_scales=sc),
         r"k_scales must have shape \[9, 2\], got \[9\]"),
        ((q, k8, k8, bt, cl), dict(k_scales=sc, v_scales=S((9, 2), jnp.bfloat16)),
         r"v_scales must be one of \(float32\), got bfloat16"),
        # kernel-only limits (the reference takes any head_dim / page_size)
        ((S((2, 4, 48), f32), S((9, 8, 2, 48), f32), S((9, 8, 2, 48), f32), bt, cl), {},
         r"head_dim must be a power of two >= 16 for the kernel, got 48"),
        ((q, S((9, 12, 2, 64), f32), S((9, 12, 2, 64), f32), bt, cl), {},
         r"page_size must be a power of two for the kernel, got 12"),
        ((q, kp, kp, bt, cl), dict(pages_per_compute_block=3), r"pages_per_compute_block must be a power of two .* got 3"),
        ((q, kp, kp, bt, cl), dict(pages_per_compute_block=1),
         r"pages_per_compute_block \* page_size \(8\) >= 16, got 1"),
        ((q, kp, kp, bt, cl), dict(num_splits=3), r"num_splits must be a power of two >= 1, got 3"),
        ((q, kp, kp, bt, cl), dict(num_splits=0), r"num_splits must be a power of two >= 1, got 0"),
        ((q, kp, kp, bt, cl), dict(impl="triton"),
         r"impl must be one of \('pallas', 'pallas_interpret'\), got 'triton'"),
    ]


KERNEL_ONLY = ("head_dim", "page_size", "pages_per_compute_block", "num_splits", "impl")


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="paged_attention: .*" + match):
        jax.eval_shape(functools.partial(paged_attention, **{"impl": INTERPRET, **kwargs}), *args)
    if not any(match.startswith(w) for w in KERNEL_ONLY):  # the reference checks operands alike
        with pytest.raises(ValueError, match="paged_attention_reference: .*" + match):
            jax.eval_shape(functools.partial(paged_attention_reference, **kwargs), *args)


# (q_heads, kv_heads, head_dim): SmolLM2-135M (GQA 3), Llama-3-8B (GQA 4), Llama-3-70B TP8
# per device (8 q / 1 kv: GQA 8).
MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128)}
PAGES = {"f32": (jnp.float32, jnp.float32), "bf16": (jnp.bfloat16, jnp.bfloat16),
         "bf16-int8": (jnp.bfloat16, jnp.int8), "bf16-fp8": (jnp.bfloat16, jnp.float8_e4m3fn),
         # the engine's pools: int8 rows with their scales, fp8 of scale 1 (no scale arrays)
         "bf16-int8-rows": (jnp.bfloat16, "int8-rows"), "bf16-fp8-engine": (jnp.bfloat16, "fp8")}


@pytest.mark.parametrize("model,pages", case_grid(list(MODELS), {p: p for p in PAGES}))
def test_lowers_for_cuda_at_engine_shapes(model, pages, cuda_lowering):
    """batch 1 / 8 / 32 x pages_per_seq 4 / 32 (page_size 16, default blocks and splits):
    one Triton custom call each, output [batch, q_heads, head_dim] in q's dtype."""
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    (hq, hkv, d), (qdt, pdt) = MODELS[model], PAGES[pages]
    quant = pdt in (jnp.int8, jnp.float8_e4m3fn)
    width = d + 4 if pdt == "int8-rows" else d
    pdt = {"int8-rows": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(pdt, pdt)
    start, count = time.perf_counter(), 0
    for batch in (1, 8, 32):
        for pps in (4, 32):
            num_pages = batch * pps + 1
            kv = S((num_pages, 16, hkv, width), pdt)
            scales = dict(k_scales=S((num_pages, hkv), jnp.float32),
                          v_scales=S((num_pages, hkv), jnp.float32)) if quant else {}
            fn = jax.jit(lambda q, k, v, bt, cl, sc: paged_attention(q, k, v, bt, cl, **sc,
                                                                    impl="pallas"))
            traced = fn.trace(S((batch, hq, d), qdt), kv, kv, S((batch, pps), i32),
                              S((batch,), i32), scales)
            assert traced.out_info.shape == (batch, hq, d) and traced.out_info.dtype == qdt
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == 1, (model, pages, batch, pps)
            count += 1
    assert count == 6
    assert time.perf_counter() - start < 60
