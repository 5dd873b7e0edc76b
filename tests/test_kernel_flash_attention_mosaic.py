"""jaxserve.kernels.pallas.flash_attention_mosaic: the Mosaic GPU (Hopper) ragged prefill kernel in
Mosaic GPU interpret mode against the plain-jnp reference, input validation, and CUDA lowering
(TMA / wgmma layouts and the SMEM budget are checked there) at the engine's shapes.

Inputs come from the Triton kernel's tests (`kernel_utils.ragged_prefill_case`): shuffled,
non-contiguous block tables, NaN wherever no sequence's context lives, so a stale key or value
that reaches the output, or a row the kernel forgets to write, fails the test.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_utils import bf16_and_f16_cases, ragged_prefill_case
from jaxserve.kernels.pallas.flash_attention import flash_attention_reference
from jaxserve.kernels.pallas.flash_attention_mosaic import flash_attention_mosaic

INTERPRET = "pallas_mosaic_interpret"
# Kernel vs reference (f32 on the same 16-bit inputs): products of 16-bit values are exact in
# f32, so they differ by the f32 summation order, p rounded to q's dtype for the p @ v product
# and one rounding of the output: 2 ulps of the dtype at the O(1) outputs.
TOLERANCES = {jnp.bfloat16: 2 * 2.0 ** -7, jnp.float16: 2 * 2.0 ** -10}
SEED = 20261126


def _assert_matches(out, args, dtype, **kw):
    ref = flash_attention_reference(*args, **kw)
    assert out.shape == ref.shape == args[0].shape and out.dtype == ref.dtype == jnp.dtype(dtype)
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (unwritten row or a stale slot read)"
    end = int(args[4][-1])
    assert (out32[end:] == 0).all(), "padding rows past cu_q_lens[batch] must be 0"
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol)
    return out32


# name: (seqs [(q_len, kv_len)], total, q_heads, kv_heads, head_dim, page_size,
#        pages_per_seq, block_kv) -- None = the default
CASES = {
    # MHA: 64 tokens per tile, one tile, one 64-key block (the diagonal)
    "prompt-gqa1": ([(24, 24)], 24, 2, 2, 64, 8, 4, None),
    # GQA 3 (padded to 4: 16 tokens per tile) continuing cached prefixes
    "cached-prefix-gqa3": ([(10, 37), (16, 48)], 32, 6, 2, 64, 8, 8, None),
    # GQA 8 (8 tokens per tile), head_dim 128, one-token sequences among a prompt
    "qlen1-in-ragged-gqa8-d128": ([(1, 20), (12, 12), (1, 1)], 16, 8, 1, 128, 8, 4, None),
    # sequences with no new tokens (no tiles), an empty one, padding rows
    "ragged-mix-empty-padding-gqa3": ([(1, 3), (0, 9), (30, 45), (2, 2), (0, 0)], 40, 6, 2, 64,
                                      8, 8, None),
    # 128-key blocks: two unmasked, the diagonal one masked; two tiles of 16 + 4 tokens
    "many-kv-blocks-gqa4-d128": ([(20, 300)], 32, 4, 1, 128, 16, 20, None),
    # four 32-token tiles over three 64-key blocks: each tile's own diagonal, 12 padding rows
    "long-prompt-gqa2-blocks64": ([(100, 130)], 112, 4, 2, 64, 16, 9, 64),
}


# f16 runs the same code with another element type: two cases (head_dim 64 and 128)
F16_CASES = ("cached-prefix-gqa3", "many-kv-blocks-gqa4-d128")


@pytest.mark.parametrize("name,dtype", bf16_and_f16_cases(CASES, F16_CASES))
def test_kernel_matches_reference(name, dtype, mosaic_impl):
    seqs, total, hq, hkv, d, ps, pps, block_kv = CASES[name]
    args = ragged_prefill_case(np.random.default_rng(SEED), seqs, total=total, q_heads=hq,
                               kv_heads=hkv, head_dim=d, page_size=ps, pages_per_seq=pps,
                               dtype=dtype)
    out = flash_attention_mosaic(*args, block_kv=block_kv, impl=mosaic_impl)
    _assert_matches(out, args, dtype)


def test_sm_scale_one_slot_and_wrong_order(mosaic_impl):
    """A non-default sm_scale reaches the kernel and one K/V slot gives the same result; and
    the test can fail: the reference with two sequences swapped in the packed batch (rows
    attend to the other's context) is far from the kernel's output."""
    args = ragged_prefill_case(np.random.default_rng(SEED), [(9, 70), (7, 40)], total=16,
                               q_heads=4, kv_heads=2, head_dim=64, page_size=16, pages_per_seq=5,
                               dtype=jnp.bfloat16)
    out = flash_attention_mosaic(*args, sm_scale=0.3, max_concurrent_steps=1, block_kv=64,
                                 impl=mosaic_impl)
    got = _assert_matches(out, args, jnp.bfloat16, sm_scale=0.3)
    tol = TOLERANCES[jnp.bfloat16]
    assert np.abs(got - np.asarray(flash_attention_reference(*args), np.float32)).max() > 10 * tol
    q, kp, vp, tables, cu, kv = args
    swapped = np.asarray(flash_attention_reference(q, kp, vp, tables[::-1], cu, kv[::-1],
                                                   sm_scale=0.3), np.float32)
    assert np.abs(got[:7] - swapped[:7]).max() > 10 * tol


def _bad_calls():
    S, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    q, kp, bt = S((16, 4, 64), bf), S((9, 16, 2, 64), bf), S((2, 4), i32)
    cu, kv = S((3,), i32), S((2,), i32)
    f32 = jnp.float32
    return [
        ((S((16, 256), bf), kp, kp, bt, cu, kv), {}, r"q must have shape \[\*, \*, \*\]"),
        ((q, kp, kp, bt, S((2,), i32), kv), {}, r"cu_q_lens must have shape \[3\], got \[2\]"),
        ((q, kp, kp, bt, cu, S((2,), f32)), {}, r"kv_lens must be one of \(int32\)"),
        ((S((16, 4, 64), f32), S((9, 16, 2, 64), f32), S((9, 16, 2, 64), f32), bt, cu, kv), {},
         r"needs q and pages both bf16 or both f16"),
        ((S((16, 4, 256), bf), S((9, 16, 2, 256), bf), S((9, 16, 2, 256), bf), bt, cu, kv), {},
         r"head_dim in \(64, 128\) \(got 256\)"),
        ((q, S((9, 4, 2, 64), bf), S((9, 4, 2, 64), bf), bt, cu, kv), {},
         r"page_size a power of two in 8..128 \(got 4\)"),
        ((S((16, 128, 64), bf), S((9, 16, 1, 64), bf), S((9, 16, 1, 64), bf), bt, cu, kv), {},
         r"q_heads / kv_heads <= 64 \(got 128\)"),
        ((q, kp, kp, bt, cu, kv), dict(block_kv=256), r"block_kv must be one of \(64, 128\)"),
        ((q, kp, kp, bt, cu, kv), dict(max_concurrent_steps=0),
         r"max_concurrent_steps must be 1 to 4, got 0"),
        ((q, kp, kp, bt, cu, kv), dict(impl="pallas"), r"impl must be one of \('pallas_mosaic'"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="flash_attention_mosaic: .*" + match):
        jax.eval_shape(functools.partial(flash_attention_mosaic, **{"impl": INTERPRET, **kwargs}),
                       *args)


# (q_heads, kv_heads, head_dim): SmolLM2-135M (GQA 3), Llama-3-8B (GQA 4), Llama-3-70B TP8
# per device (GQA 8).
MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128)}


@pytest.mark.parametrize("model", list(MODELS))
def test_lowers_for_cuda_at_engine_shapes(model):
    """(tokens, sequences, table pages) of a long prompt's chunk, a packed batch and a wide
    table, page_size 16, bf16: one Mosaic GPU call each, output [tokens, q_heads, head_dim]."""
    S, i32, bf = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    hq, hkv, d = MODELS[model]
    start = time.perf_counter()
    for tokens, batch, pps in [(512, 1, 64), (256, 16, 16), (2048, 4, 512)]:
        kv = S((batch * pps + 1, 16, hkv, d), bf)
        fn = jax.jit(functools.partial(flash_attention_mosaic, impl="pallas_mosaic"))
        traced = fn.trace(S((tokens, hq, d), bf), kv, kv, S((batch, pps), i32),
                          S((batch + 1,), i32), S((batch,), i32))
        assert traced.out_info.shape == (tokens, hq, d) and traced.out_info.dtype == bf
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stablehlo.custom_call @mosaic_gpu") == 1, (model, tokens, batch)
    assert time.perf_counter() - start < 60
