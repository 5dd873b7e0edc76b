"""jaxserve.kernels.pallas.paged_attention_mosaic: the Mosaic GPU (Hopper) paged decode kernel in
Mosaic GPU interpret mode against the plain-jnp reference, input validation, the default
blocking, and CUDA lowering (TMA / wgmma layouts and the SMEM budget are checked there) at the
engine's shapes.

Pools come from the Triton kernel's tests (`kernel_utils.shuffled_pool`): each sequence's pages
drawn from a shuffled pool, block-table columns past a sequence's last page at random pages,
and every slot that holds no context token NaN, so a stale key or value that reaches the
output, or an output the kernel forgets to write, fails the test.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_utils import bf16_and_f16_cases, shuffled_pool
from jaxserve.kernels.pallas.attention_mosaic import mosaic_attention_supports as mosaic_supports
from jaxserve.kernels.pallas.paged_attention import paged_attention_reference
from jaxserve.kernels.pallas.paged_attention_mosaic import _default_blocks, paged_attention_mosaic

INTERPRET = "pallas_mosaic_interpret"
# Kernel vs reference (f32 on the same 16-bit inputs): products of 16-bit values are exact in
# f32, so they differ by the f32 summation order (blocks, splits), p rounded to q's dtype for
# the p @ v product (relative 2^-8 bf16 / 2^-11 f16 per weight, p summing to 1 over values of
# O(1)) and one rounding of the output: 2 ulps of the dtype at the O(1) outputs.
TOLERANCES = {jnp.bfloat16: 2 * 2.0 ** -7, jnp.float16: 2 * 2.0 ** -10}
SEED = 20261126


def _case(rng, ctx_lens, *, q_heads, kv_heads, head_dim, page_size, pages_per_seq,
          dtype=jnp.bfloat16):
    k, v, tables, live = shuffled_pool(rng, ctx_lens, kv_heads=kv_heads, head_dim=head_dim,
                                       page_size=page_size, pages_per_seq=pages_per_seq)
    k[~live], v[~live] = np.nan, np.nan
    q = jnp.asarray(rng.standard_normal((len(ctx_lens), q_heads, head_dim)), dtype)
    return (q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(ctx_lens, jnp.int32))


def _assert_matches(out, args, dtype, **kw):
    ref = paged_attention_reference(*args, **kw)
    assert out.shape == ref.shape == args[0].shape and out.dtype == ref.dtype == jnp.dtype(dtype)
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (unwritten output or a stale slot read)"
    empty = np.asarray(args[4]) == 0
    assert (out32[empty] == 0).all(), "a context-0 (padding) row must output exactly 0"
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)
    return out32


# name: (context_lens, q_heads, kv_heads, head_dim, page_size, pages_per_seq, block_kv,
#        num_splits) -- None = the default
CASES = {
    # GQA 3 (SmolLM2), one partial 64-key block of 4 pages
    "ctx-short-gqa3": ([1, 37], 9, 3, 64, 16, 4, 64, 1),
    # block boundaries: a full block, a full block + 1 key, two whole blocks; 2 splits
    "block-boundaries-gqa4-d128": ([64, 65, 128], 8, 2, 128, 16, 8, 64, 2),
    # 11 pages of 8 -> 2 blocks of 64 (table padded by the kernel's clamp), splits 3: the
    # third always empty, the second empty for the short ones; padding rows (context 0)
    "splits-tail-padding-gqa8": ([0, 88, 5, 0, 70], 8, 1, 64, 8, 11, 64, 3),
    # 128-key blocks of 32-key pages, 3 blocks in flight over 2 slots, defaults for splits
    "long-gqa2-p32": ([300, 129], 4, 2, 64, 32, 12, 128, None),
    # MHA (GQA 1), one page is one block (page_size 64), the defaults for both
    "page64-defaults-gqa1": ([190, 64, 1], 3, 3, 64, 64, 3, None, None),
}


# f16 runs the same code with another element type: two cases (head_dim 64 and 128)
F16_CASES = ("ctx-short-gqa3", "block-boundaries-gqa4-d128")


@pytest.mark.parametrize("name,dtype", bf16_and_f16_cases(CASES, F16_CASES))
def test_kernel_matches_reference(name, dtype, mosaic_impl):
    ctx, hq, hkv, d, ps, pps, block_kv, splits = CASES[name]
    args = _case(np.random.default_rng(SEED), ctx, q_heads=hq, kv_heads=hkv, head_dim=d,
                 page_size=ps, pages_per_seq=pps, dtype=dtype)
    out = paged_attention_mosaic(*args, block_kv=block_kv, num_splits=splits, impl=mosaic_impl)
    _assert_matches(out, args, dtype)


def test_sm_scale_stages_and_wrong_block_table(mosaic_impl):
    """A non-default sm_scale reaches the kernel, one K/V slot (no prefetch) gives the same
    result; and the test can fail: the reference on a block table with two sequences' first
    pages swapped is far from the kernel's output."""
    args = _case(np.random.default_rng(SEED), [150, 70], q_heads=4, kv_heads=1, head_dim=64,
                 page_size=16, pages_per_seq=10)
    out = paged_attention_mosaic(*args, sm_scale=0.3, block_kv=64, num_splits=1,
                                 max_concurrent_steps=1, impl=mosaic_impl)
    got = _assert_matches(out, args, jnp.bfloat16, sm_scale=0.3)
    tol = TOLERANCES[jnp.bfloat16]
    assert np.abs(got - np.asarray(paged_attention_reference(*args), np.float32)).max() > 10 * tol
    q, kp, vp, tables, lens = args
    wrong = np.asarray(tables).copy()
    wrong[[0, 1], 0] = wrong[[1, 0], 0]
    wrong_ref = np.asarray(paged_attention_reference(q, kp, vp, jnp.asarray(wrong), lens,
                                                     sm_scale=0.3), np.float32)
    assert (np.abs(got - wrong_ref).max(axis=(1, 2)) > 10 * tol).all()


def test_default_blocks():
    """128-key blocks unless the table is at most 64 keys; splits bring the CTAs near 264
    with >= 2 blocks each."""
    # Llama-3-8B, 8k context, batch 1: 64 blocks, 2 per split (33 would reach 264 CTAs)
    assert _default_blocks(1, 8, 512, 16) == (128, 32)
    assert _default_blocks(64, 8, 32, 16) == (128, 1)  # 64 streams: 512 CTAs already
    assert _default_blocks(1, 3, 4, 16) == (64, 1)  # SmolLM2, a 64-key table: one block
    assert _default_blocks(2, 3, 64, 16) == (128, 4)  # 1k context: 8 blocks, 2 each
    assert _default_blocks(1, 1, 1, 128) == (128, 1)  # one 128-key page
    for batch, kvh, pps, ps in [(1, 8, 512, 16), (3, 2, 100, 8), (8, 1, 7, 32)]:
        block_kv, splits = _default_blocks(batch, kvh, pps, ps)
        blocks = -(-pps * ps // block_kv)
        assert splits == 1 or blocks // splits >= 2
        assert batch * kvh * splits <= 264 + batch * kvh


def test_supports():
    assert mosaic_supports(jnp.bfloat16, jnp.bfloat16, 128, 16, 4)
    assert mosaic_supports(jnp.float16, jnp.float16, 64, 8, 4)
    assert not mosaic_supports(jnp.float32, jnp.float32, 64, 16, 4)  # f32: the Triton kernel
    assert not mosaic_supports(jnp.bfloat16, jnp.int8, 64, 16, 4)  # quantised pages: Triton
    assert not mosaic_supports(jnp.bfloat16, jnp.bfloat16, 256, 16, 4)  # K, V, P over SMEM
    assert not mosaic_supports(jnp.bfloat16, jnp.bfloat16, 64, 4, 4)  # under one (8, 64) tile


def _bad_calls():
    S, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    q, kp, bt, cl = S((2, 4, 64), bf), S((9, 16, 2, 64), bf), S((2, 4), i32), S((2,), i32)
    return [
        ((S((2, 256), bf), kp, kp, bt, cl), {}, r"q must have shape \[\*, \*, \*\], got \[2, 256\]"),
        ((q, kp, kp, S((3, 4), i32), cl), {}, r"block_tables must have shape \[2, \*\]"),
        ((q, kp, kp, bt, S((2,), jnp.float32)), {}, r"context_lens must be one of \(int32\)"),
        ((S((2, 4, 64), jnp.float32), S((9, 16, 2, 64), jnp.float32),
          S((9, 16, 2, 64), jnp.float32), bt, cl), {}, r"needs q and pages both bf16 or both f16"),
        ((S((2, 4, 256), bf), S((9, 16, 2, 256), bf), S((9, 16, 2, 256), bf), bt, cl), {},
         r"head_dim in \(64, 128\) \(got 256\)"),
        ((q, S((9, 4, 2, 64), bf), S((9, 4, 2, 64), bf), bt, cl), {},
         r"page_size a power of two in 8..128 \(got 4\)"),
        ((q, kp, kp, bt, cl), dict(block_kv=32), r"block_kv must be one of \(64, 128\) .* got 32"),
        ((q, kp, kp, bt, cl), dict(num_splits=0), r"num_splits must be an int >= 1, got 0"),
        ((q, kp, kp, bt, cl), dict(max_concurrent_steps=5),
         r"max_concurrent_steps must be 1 to 4, got 5"),
        ((q, kp, kp, bt, cl), dict(impl="pallas"),
         r"impl must be one of \('pallas_mosaic', 'pallas_mosaic_interpret'\), got 'pallas'"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="paged_attention_mosaic: .*" + match):
        jax.eval_shape(functools.partial(paged_attention_mosaic, **{"impl": INTERPRET, **kwargs}),
                       *args)


# (q_heads, kv_heads, head_dim): SmolLM2-135M (GQA 3), Llama-3-8B (GQA 4), Llama-3-70B TP8
# per device (GQA 8), and a 64-head MHA-like group of 8 at head_dim 128.
MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128)}


@pytest.mark.parametrize("model,dtype", [(m, jnp.bfloat16) for m in MODELS]
                         + [("llama3-8b", jnp.float16)],
                         ids=[f"{m}-bf16" for m in MODELS] + ["llama3-8b-f16"])
def test_lowers_for_cuda_at_engine_shapes(model, dtype):
    """batch 1 / 8 / 64 x pages_per_seq 4 / 32 / 512 (page_size 16, default blocks and
    splits) and both block sizes: one Mosaic GPU call each (layouts, TMA shapes and the SMEM
    budget pass Mosaic's checks), output [batch, q_heads, head_dim] in q's dtype. (Every
    decode shape of the engine's warm-up lowers in tests/test_engine_kernels.py.)"""
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    hq, hkv, d = MODELS[model]
    start, count = time.perf_counter(), 0
    for batch, pps, block_kv in [(1, 4, None), (8, 32, None), (64, 32, 64), (1, 512, None)]:
        kv = S((batch * pps + 1, 16, hkv, d), dtype)
        fn = jax.jit(functools.partial(paged_attention_mosaic, block_kv=block_kv,
                                       impl="pallas_mosaic"))
        traced = fn.trace(S((batch, hq, d), dtype), kv, kv, S((batch, pps), i32), S((batch,), i32))
        assert traced.out_info.shape == (batch, hq, d) and traced.out_info.dtype == dtype
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 1, (model, batch, pps)
        count += 1
    assert count == 4
    assert time.perf_counter() - start < 60
