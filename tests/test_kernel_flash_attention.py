"""jaxserve.kernels.pallas.flash_attention: the ragged paged prefill kernel (interpret mode) against its
plain-jnp reference, the reference against an independent float64 numpy causal softmax,
input validation, and CUDA lowering at the engine's shapes.

Every case uses shuffled, non-contiguous block tables and poisons the pool with NaN
wherever no sequence's context lives (unreferenced pages, slots past kv_len, the block-table
columns past a sequence's last page point anywhere), so a read the kernel should not make,
or an output row it forgets to write (interpret mode starts outputs at NaN), fails the test.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.pallas.flash_attention import flash_attention, flash_attention_reference
from kernel_utils import DTYPES, NARROW_POOLS, case_grid, narrow_pool
from kernel_utils import ragged_prefill_case as _case

INTERPRET = "pallas_interpret"
# Kernel vs reference: same inputs, f32 scores and softmax in both; they differ by the f32
# summation order of the online softmax and, for bf16, by p rounded to bf16 for the p @ v
# dot (<= 2^-9 relative) and one rounding of the output (outputs are O(1)).
TOLERANCES = {jnp.float32: dict(rtol=5e-5, atol=5e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# Reference (f32) vs float64 numpy: f32 rounding only.
F64_TOL = dict(rtol=2e-5, atol=2e-5)


def _dense_numpy(q, k_pages, v_pages, tables, cu, kv_lens, sm_scale):
    """Independent float64 causal softmax, one sequence / token / head at a time."""
    q, kp, vp = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k_pages, v_pages))
    tables, cu, kv_lens = np.asarray(tables), np.asarray(cu), np.asarray(kv_lens)
    _, page_size, kv_heads, head_dim = kp.shape
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    for b, kv in enumerate(kv_lens):
        keys = kp[tables[b]].reshape(-1, kv_heads, head_dim)[:kv]  # contiguous context
        vals = vp[tables[b]].reshape(-1, kv_heads, head_dim)[:kv]
        q_len = cu[b + 1] - cu[b]
        for j in range(q_len):
            pos = kv - q_len + j
            for h in range(q.shape[1]):
                s = keys[:pos + 1, h // group] @ q[cu[b] + j, h] * sm_scale
                p = np.exp(s - s.max())
                out[cu[b] + j, h] = p @ vals[:pos + 1, h // group] / p.sum()
    return out


def _assert_matches(out, args, dtype, **kw):
    """Kernel output == reference (per-dtype tolerance), finite, padding rows exactly 0."""
    ref = flash_attention_reference(*args, **kw)
    assert out.shape == ref.shape == args[0].shape and out.dtype == ref.dtype == jnp.dtype(dtype)
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (unwritten row or unmasked read)"
    end = int(args[4][-1])
    assert (out32[end:] == 0).all(), "padding rows past cu_q_lens[batch] must be 0"
    np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)), **TOLERANCES[dtype])
    return out32


# name: (seqs [(q_len, kv_len)], total, q_heads, kv_heads, head_dim, page_size,
#        pages_per_seq, block_q, block_kv)  -- None blocks = the defaults
CASES = {
    "prompt-gqa1-d64": ([(24, 24)], 24, 2, 2, 64, 8, 4, None, None),
    "cached-prefix-gqa3-d64": ([(10, 37), (16, 48)], 32, 6, 2, 64, 8, 8, None, 16),
    "qlen1-in-ragged-gqa8-d128": ([(1, 20), (12, 12), (1, 1)], 16, 8, 1, 128, 8, 4, 2, 16),
    "page-boundaries-gqa4": ([(16, 16), (8, 32), (1, 8)], 32, 8, 2, 64, 8, 4, 4, 16),
    "partial-last-page-gqa3": ([(5, 13), (11, 27)], 16, 3, 1, 64, 8, 4, 8, 16),
    "ragged-mix-empty-padding-gqa3": ([(1, 3), (0, 9), (30, 45), (2, 2), (0, 0)], 40, 6, 2, 64,
                                      8, 8, 8, 16),
    "many-kv-blocks-gqa4-d128": ([(20, 100)], 32, 4, 1, 128, 8, 16, 4, 16),
    "block-within-page": ([(9, 50)], 16, 4, 2, 64, 32, 2, 8, 16),
    "block-spans-8-pages": ([(13, 41), (3, 7)], 16, 2, 1, 64, 4, 16, 16, 32),
}


@pytest.mark.parametrize("name,dtype", case_grid(list(CASES), DTYPES))
def test_kernel_matches_reference(name, dtype, pallas_impl):
    seqs, total, hq, hkv, d, ps, pps, bq, bkv = CASES[name]
    args = _case(np.random.default_rng(1234), seqs, total=total, q_heads=hq, kv_heads=hkv,
                 head_dim=d, page_size=ps, pages_per_seq=pps, dtype=dtype)
    out = flash_attention(*args, block_q=bq, block_kv=bkv, impl=pallas_impl)
    _assert_matches(out, args, dtype)


@pytest.mark.parametrize("name,pool", case_grid(
    ["cached-prefix-gqa3-d64", "qlen1-in-ragged-gqa8-d128", "ragged-mix-empty-padding-gqa3"],
    {p: p for p in NARROW_POOLS}))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_engine_narrow_pools_match_reference(name, pool, dtype, pallas_impl):
    """The engine's narrow pools: fp8 e4m3fn pages (scale 1, widened in registers) and
    int8 rows carrying their f32 scale (values widened exactly; each key's K scale on its
    scores, its V scale on its p): the reference on the same pool, dead slots (NaN, NaN
    scales) never read; close to the f32 pool's result (an 8-bit rounding of K/V)."""
    seqs, total, hq, hkv, d, ps, pps, bq, bkv = CASES[name]
    q, k, v, tables, cu, kv_lens = _case(np.random.default_rng(1234), seqs, total=total,
                                         q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps,
                                         pages_per_seq=pps)
    args = (q.astype(dtype), narrow_pool(k, pool), narrow_pool(v, pool), tables, cu, kv_lens)
    out = flash_attention(*args, block_q=bq, block_kv=bkv, impl=pallas_impl)
    got = _assert_matches(out, args, dtype)
    f32 = np.asarray(flash_attention_reference(q, k, v, tables, cu, kv_lens))
    assert np.abs(got - f32).max() < 0.2


def test_sm_scale_and_default_blocks(pallas_impl):
    """A non-default sm_scale reaches both; default blocks on a ragged batch."""
    args = _case(np.random.default_rng(1234), [(7, 19), (9, 9)], total=24, q_heads=4, kv_heads=2,
                 head_dim=64, page_size=16, pages_per_seq=2)
    out = flash_attention(*args, sm_scale=0.3, impl=pallas_impl)
    got = _assert_matches(out, args, jnp.float32, sm_scale=0.3)
    default = np.asarray(flash_attention_reference(*args))
    assert np.abs(got - default).max() > 100 * TOLERANCES[jnp.float32]["atol"]


def test_context_past_the_block_table_is_clamped(pallas_impl):
    """The engine may pass kv_len > pages_per_seq * page_size for padding tokens: keys past
    the table count as absent (no column past the table is read; the pool stays NaN
    outside the live context), and the output is finite and equals the reference's."""
    rng = np.random.default_rng(1234)
    q, kp, vp, tables, cu, _ = _case(rng, [(8, 16), (8, 16)], total=16, q_heads=2, kv_heads=1,
                                     head_dim=64, page_size=8, pages_per_seq=2)
    kv_lens = jnp.array([20, 16], jnp.int32)  # sequence 0's last 4 tokens sit past its table
    out = flash_attention(q, kp, vp, tables, cu, kv_lens, block_q=8, block_kv=16, impl=pallas_impl)
    _assert_matches(out, (q, kp, vp, tables, cu, kv_lens), jnp.float32)


def test_wrong_block_table_gives_a_different_result(pallas_impl):
    """The test can fail: the reference on a shuffled block table (same pages, wrong order)
    is far from the kernel's output on the true one. (Swapping two pages that every query
    sees in full would not do: attention is invariant to permuting the keys it sees.)"""
    rng = np.random.default_rng(1234)
    args = _case(rng, [(16, 32), (6, 20)], total=24, q_heads=4, kv_heads=2, head_dim=64,
                 page_size=8, pages_per_seq=4, spare_pages=0)
    out = np.asarray(flash_attention(*args, block_q=8, block_kv=16, impl=pallas_impl))
    q, kp, vp, tables, cu, kv_lens = args
    np.testing.assert_allclose(out, np.asarray(flash_attention_reference(*args)),
                               **TOLERANCES[jnp.float32])
    swapped = np.asarray(tables).copy()
    swapped[0] = swapped[0, [0, 3, 2, 1]]  # keys 8..15 <-> 24..31: rows at 16..23 see a change
    wrong = np.asarray(flash_attention_reference(q, kp, vp, jnp.asarray(swapped), cu, kv_lens))
    assert np.abs(out[:16] - wrong[:16]).max() > 100 * TOLERANCES[jnp.float32]["atol"]


@pytest.mark.parametrize("seqs,total,hq,hkv", [
    ([(6, 6)], 6, 2, 2),                                  # plain prompt, MHA
    ([(3, 11), (0, 5), (1, 1), (5, 17)], 12, 6, 2),        # ragged, prefix, empty, padding, GQA 3
])
def test_reference_is_dense_causal_softmax(seqs, total, hq, hkv):
    args = _case(np.random.default_rng(1234), seqs, total=total, q_heads=hq, kv_heads=hkv,
                 head_dim=16, page_size=4, pages_per_seq=5)
    ref = np.asarray(flash_attention_reference(*args))
    np.testing.assert_allclose(ref, _dense_numpy(*args, sm_scale=16 ** -0.5), **F64_TOL)
    assert (ref[int(args[4][-1]):] == 0).all()
    assert flash_attention_reference(*(a.astype(jnp.bfloat16) if i < 3 else a
                                       for i, a in enumerate(args))).dtype == jnp.bfloat16


def _bad_calls():
    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    q, kp = S((16, 4, 64), f32), S((9, 8, 2, 64), f32)
    bt, cu, kvl = S((2, 4), i32), S((3,), i32), S((2,), i32)
    ok = (q, kp, kp, bt, cu, kvl)

    def with_(i, x):  # the good operands with operand i replaced
        return ok[:i] + (x,) + ok[i + 1:]

    return [
        (with_(0, S((16, 256), f32)), {}, r"q must have shape \[\*, \*, \*\], got \[16, 256\]"),
        (with_(0, S((16, 4, 64), i32)), {},
         r"q must be one of \(float32, bfloat16, float16\), got int32"),
        (with_(0, S((0, 4, 64), f32)), {}, r"total_tokens >= 1"),
        (with_(1, S((9, 8, 2, 32), f32)), {},
         r"k_pages must have shape \[\*, \*, \*, 64\], got \[9, 8, 2, 32\]"),
        (with_(1, S((9, 8, 2, 64), jnp.bfloat16)), {},
         r"k_pages must be one of \(float32, float8_e4m3fn, int8\), got bfloat16"),
        (with_(1, S((9, 8, 2, 64), jnp.int8)), {},  # int8 rows carry 4 scale bytes
         r"k_pages must have shape \[\*, \*, \*, 68\], got \[9, 8, 2, 64\]"),
        (with_(2, S((9, 4, 2, 64), f32)), {},
         r"v_pages must have shape \[9, 8, 2, 64\], got \[9, 4, 2, 64\]"),
        ((q, S((9, 8, 3, 64), f32), S((9, 8, 3, 64), f32), bt, cu, kvl), {},
         r"q_heads must be a multiple of kv_heads, got q_heads 4, kv_heads 3"),
        (with_(3, S((2, 4), jnp.int16)), {}, r"block_tables must be one of \(int32\), got int16"),
        (with_(3, S((8,), i32)), {}, r"block_tables must have shape \[\*, \*\], got \[8\]"),
        (with_(4, S((2,), i32)), {}, r"cu_q_lens must have shape \[3\], got \[2\]"),
        (with_(5, S((2,), f32)), {}, r"kv_lens must be one of \(int32\), got float32"),
        (with_(5, S((3,), i32)), {}, r"kv_lens must have shape \[2\], got \[3\]"),
        ((S((16, 4, 48), f32), S((9, 8, 2, 48), f32), S((9, 8, 2, 48), f32), bt, cu, kvl), {},
         r"head_dim must be a power of two >= 16 for the kernel, got 48"),
        (ok, dict(block_q=12), r"block_q must be a power of two .* got 12"),
        (ok, dict(block_q=4), r"block_q \* 2 \(padded group\) >= 16, got 4"),
        (ok, dict(block_kv=8), r"block_kv must be a power of two >= 16, got 8"),
        (ok, dict(block_kv=48), r"block_kv must be a power of two >= 16, got 48"),
        (ok, dict(impl="triton"),
         r"impl must be one of \('pallas', 'pallas_interpret'\), got 'triton'"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="flash_attention: .*" + match):
        jax.eval_shape(functools.partial(flash_attention, **{"impl": INTERPRET, **kwargs}), *args)
    if not kwargs and "head_dim" not in match:  # the reference checks the operands the same way
        with pytest.raises(ValueError, match="flash_attention_reference: .*" + match):
            jax.eval_shape(flash_attention_reference, *args)


# (q_heads, kv_heads, head_dim): SmolLM2-135M, Llama-3-8B (GQA 4), Llama-3-70B TP8 per device
# (8 q / 1 kv: GQA 8).
MODELS = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128)}


# q dtype, pool (a dtype, or the engine's int8 rows with their scales, head_dim + 4 wide)
POOLS = {"f32": (jnp.float32, jnp.float32), "bf16": (jnp.bfloat16, jnp.bfloat16),
         "bf16-fp8": (jnp.bfloat16, jnp.float8_e4m3fn), "bf16-int8-rows": (jnp.bfloat16, "int8-rows")}


@pytest.mark.parametrize("model,pool", case_grid(list(MODELS), {p: p for p in POOLS}))
def test_lowers_for_cuda_at_engine_shapes(model, pool, cuda_lowering):
    """total_tokens 16 / 128 / 512 x batch 1 / 4 x pages_per_seq 8 / 32 (page_size 16): one
    Triton custom call each, output [total_tokens, q_heads, head_dim] in q's dtype."""
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    hq, hkv, d = MODELS[model]
    dtype, pages_dtype = POOLS[pool]
    width = d + 4 if pages_dtype == "int8-rows" else d
    pages_dtype = jnp.int8 if pages_dtype == "int8-rows" else pages_dtype
    fn = jax.jit(functools.partial(flash_attention, impl="pallas"))
    start, count = time.perf_counter(), 0
    for total in (16, 128, 512):
        for batch in (1, 4):
            for pps in (8, 32):
                pages = S((batch * pps + 1, 16, hkv, width), pages_dtype)
                traced = fn.trace(S((total, hq, d), dtype), pages, pages, S((batch, pps), i32),
                                  S((batch + 1,), i32), S((batch,), i32))
                assert traced.out_info.shape == (total, hq, d) and traced.out_info.dtype == dtype
                text = traced.lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("xla.gpu.triton") == 1, (model, total, batch, pps)
                count += 1
    assert count == 12
    assert time.perf_counter() - start < 60
