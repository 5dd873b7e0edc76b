"""jaxserve.kernels.pallas.quantized_matmul: the Pallas kernel (interpret mode) against its plain-jnp
reference, the reference against an independent numpy dequantise-then-matmul, the
quantisation round trip, input validation, and CUDA lowering at the engine's shapes."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.pallas.quantized_matmul import (quantize_weights, quantized_matmul,
                                                      quantized_matmul_reference,
                                                      quantized_matmul_xla)
from kernel_utils import DTYPES, case_grid

INTERPRET = "pallas_interpret"
# Kernel vs reference. Both see the same x values and exactly representable weights, so
# they differ by the f32 summation order and, for bf16, one rounding of the output.
TOLERANCES = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
# Reference vs numpy (float64): f32 summation error only (outputs are O(1)).
F64_TOL = dict(rtol=1e-5, atol=1e-5)
FP8_REL_ERROR = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative
FP8_MIN_NORMAL = 2.0 ** -6
SEED = 20261122  # fixed: a failure must reproduce
WEIGHT_DTYPE = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}


def _weights(rng, k: int, n: int, group: int | None = None) -> jax.Array:
    """[k, n] f32 normal weights with per-column (and per-group) magnitudes spread over
    ~e^+-1, so distinct scales matter."""
    w = rng.standard_normal((k, n)) * np.exp(rng.standard_normal(n))[None, :]
    if group is not None:
        w *= np.repeat(np.exp(rng.standard_normal((k // group, n))), group, axis=0)
    return jnp.asarray(w, jnp.float32)


def _acts(rng, m: int, k: int, dtype) -> jax.Array:
    """[m, k] activations scaled by 1/sqrt(k), so outputs are O(1)."""
    return jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), dtype)


def _assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype == jnp.dtype(dtype)
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (an unwritten or unmasked element)"
    ref32 = np.asarray(ref.astype(jnp.float32))
    # Summation-order error grows with the size of the terms, not of the (possibly cancelled)
    # output element: scale the absolute tolerance by the largest output of the product.
    tol = dict(TOLERANCES[dtype])
    tol["atol"] *= max(1.0, float(np.abs(ref32).max()))
    np.testing.assert_allclose(out32, ref32, **tol)


# (fmt, group, in_features, out_features): in/out not multiples of the default blocks where
# the format allows (groups need in_features % group == 0: 384 = 3 x 128, 576 = 9 x 64).
FORMATS = [("int8", None, 96, 80), ("int8", None, 576, 200), ("fp8_e4m3", None, 96, 80),
           ("fp8_e4m3", None, 576, 200), ("int8", 32, 96, 80), ("int8", 64, 576, 200),
           ("int8", 128, 384, 80)]


@pytest.mark.parametrize("fmt,group,k,n,dtype",
                         case_grid(FORMATS, DTYPES, [f"{f}-g{g}-{k}x{n}" for f, g, k, n in FORMATS]))
def test_kernel_matches_reference(fmt, group, k, n, dtype, pallas_impl):
    """Default blocks; every M in one test (one compile each) to keep the grid small."""
    rng = np.random.default_rng(SEED)
    w_q, scales = quantize_weights(_weights(rng, k, n, group), fmt, group)
    for m in (1, 5, 16, 37):
        x = _acts(rng, m, k, dtype)
        out = quantized_matmul(x, w_q, scales, impl=pallas_impl)
        _assert_close(out, quantized_matmul_reference(x, w_q, scales), dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_xla_form_matches_reference(dtype):
    """quantized_matmul_xla (matmul_impl "xla": the widened weight as the dot's operand,
    scales on the f32 sum) gives the reference's product within the kernels' bounds, per
    channel and per group, and a wrong scale changes it."""
    rng = np.random.default_rng(SEED)
    for fmt, group, k, n in FORMATS:
        w_q, scales = quantize_weights(_weights(rng, k, n, group), fmt, group)
        x = _acts(rng, 5, k, dtype)
        ref = quantized_matmul_reference(x, w_q, scales)
        _assert_close(quantized_matmul_xla(x, w_q, scales), ref, dtype)
        if group is None:
            bad = np.asarray(quantized_matmul_xla(x, w_q, scales.at[3].mul(2)).astype(jnp.float32))
            ref32 = np.asarray(ref.astype(jnp.float32))
            assert not np.allclose(bad[:, 3], ref32[:, 3], rtol=0.1)
            np.testing.assert_array_equal(np.delete(bad, 3, 1), np.delete(
                np.asarray(quantized_matmul_xla(x, w_q, scales).astype(jnp.float32)), 3, 1))


@pytest.mark.parametrize("fmt,group,blocks", [
    ("int8", None, (16, 16, 64)),     # K=96: last K block half empty; N=80: last N block 1/16 full
    ("int8", 64, (32, 32, 16)),       # 4 K blocks per group: group row picked by kb * 16 // 64
    ("fp8_e4m3", None, (16, 64, 32)),
])
def test_explicit_blocks_with_ragged_edges(fmt, group, blocks, pallas_impl):
    rng = np.random.default_rng(SEED)
    k, n, m = (128, 80, 37) if group else (96, 80, 37)
    bm, bn, bk = blocks
    w_q, scales = quantize_weights(_weights(rng, k, n, group), fmt, group)
    x = _acts(rng, m, k, jnp.float32)
    out = quantized_matmul(x, w_q, scales, block_m=bm, block_n=bn, block_k=bk, impl=pallas_impl)
    _assert_close(out, quantized_matmul_reference(x, w_q, scales), jnp.float32)


@pytest.mark.parametrize("group", [None, 16])
def test_split_k_ranges_sum_to_the_product(group, pallas_impl):
    """Split-K over 7 K blocks: 1, 2, 3 (3 + 3 + 1 blocks) and 7 ranges give the
    reference's product, per channel and per group; the default splits decode-sized M only."""
    from jaxserve.kernels.pallas.quantized_matmul import default_splits
    rng = np.random.default_rng(SEED)
    k, n = 112, 48
    w_q, scales = quantize_weights(_weights(rng, k, n, group), "int8", group)
    x = _acts(rng, 3, k, jnp.float32)
    ref = quantized_matmul_reference(x, w_q, scales)
    for splits in (1, 2, 3, 7):
        out = quantized_matmul(x, w_q, scales, block_k=16, splits=splits, impl=pallas_impl)
        _assert_close(out, ref, jnp.float32)
    assert default_splits(1, 4096, 32, 64) == 4  # Llama-3-8B q/o at decode: 64 tiles x 4
    assert default_splits(1, 1024, 32, 64) == 8  # k/v: 16 tiles x 8 (>= 4 K blocks each)
    assert default_splits(256, 4096, 32, 64) == 1


# fast tier: reduce_magic (what matmul_impl "pallas_gemv" runs)
@pytest.mark.parametrize("gemv", [pytest.param("reduce", marks=pytest.mark.full), "reduce_magic"])
def test_cuda_core_gemv_matches_reference(gemv, pallas_impl):
    """The multiply-and-reduce GEMV variants (gemv "reduce" / "reduce_magic", M <= 4):
    every format with ragged K and N edges (K 96 and N 80 against blocks of 32 and 64),
    whole tiles, and split-K (5 splits: with group scales each holds whole groups, some
    then none), give the reference's product (x f32 and bf16 in turn);
    int8's exact integer-add widening covers every int8 value (-128 .. 127 in one
    weight)."""
    rng = np.random.default_rng(SEED)
    dtypes = list(DTYPES.values())
    for i, (fmt, group, k, n) in enumerate(FORMATS):
        dtype = dtypes[i % len(dtypes)]
        w_q, scales = quantize_weights(_weights(rng, k, n, group), fmt, group)
        for m, kw in ((1, {}), (3, dict(block_n=64)), (4, dict(block_k=16, splits=5))):
            x = _acts(rng, m, k, dtype)
            out = quantized_matmul(x, w_q, scales, impl=pallas_impl, gemv=gemv, **kw)
            _assert_close(out, quantized_matmul_reference(x, w_q, scales), dtype)
    w_q = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8).reshape(64, 4)
    scales = jnp.ones(4, jnp.float32)
    x = _acts(rng, 2, 64, jnp.float32)
    _assert_close(quantized_matmul(x, w_q, scales, impl=pallas_impl, gemv=gemv),
                  quantized_matmul_reference(x, w_q, scales), jnp.float32)


def test_wrong_scales_change_the_result(pallas_impl):
    """The kernel really applies per-group scales: swapping two groups' scale rows (or
    flattening them to per-channel) changes its output well beyond the tolerance."""
    rng = np.random.default_rng(SEED)
    k, n, g = 128, 32, 32
    w_q, scales = quantize_weights(_weights(rng, k, n, g), "int8", g)
    x = _acts(rng, 16, k, jnp.float32)
    good = np.asarray(quantized_matmul(x, w_q, scales, impl=pallas_impl))
    swapped = np.asarray(quantized_matmul(x, w_q, scales[jnp.array([1, 0, 2, 3])],
                                          impl=pallas_impl))
    channel = np.asarray(quantized_matmul(x, w_q, scales.mean(axis=0), impl=pallas_impl))
    ref = np.asarray(quantized_matmul_reference(x, w_q, scales))
    np.testing.assert_allclose(good, ref, **TOLERANCES[jnp.float32])
    for bad in (swapped, channel):
        assert np.abs(bad - ref).max() > 100 * TOLERANCES[jnp.float32]["atol"]


@pytest.mark.parametrize("group", [None, 16, 64])
def test_int8_round_trip_error_at_most_half_a_step(group):
    rng = np.random.default_rng(SEED)
    k, n = 128, 48
    w = _weights(rng, k, n, group)
    w_q, scales = quantize_weights(w, "int8", group)
    assert w_q.dtype == jnp.int8 and scales.dtype == jnp.float32
    assert scales.shape == ((n,) if group is None else (k // group, n))
    s = np.asarray(scales)[None, :] if group is None else np.repeat(np.asarray(scales), group, axis=0)
    q = np.asarray(w_q).astype(np.float64)
    err = np.abs(np.asarray(w, np.float64) - q * s)
    assert (err <= s / 2 * (1 + 1e-6)).all(), err.max()
    # the absmax of each scaling slice maps to +-127
    slices = np.abs(q).reshape(-1 if group is None else k // group, group or k, n).max(axis=1)
    assert (slices == 127).all()


def test_fp8_round_trip_relative_error():
    rng = np.random.default_rng(SEED)
    w = _weights(rng, 64, 48)
    w_q, scales = quantize_weights(w, "fp8_e4m3")
    assert w_q.dtype == jnp.float8_e4m3fn and scales.shape == (48,)
    s = np.asarray(scales)[None, :]
    q = np.asarray(w_q.astype(jnp.float32)).astype(np.float64)
    w64 = np.asarray(w, np.float64)
    bound = FP8_REL_ERROR * np.abs(w64) + FP8_MIN_NORMAL * 2.0 ** -3 * s  # normal / subnormal step
    assert (np.abs(w64 - q * s) <= bound * (1 + 1e-6)).all()
    assert np.allclose(np.abs(q).max(axis=0), 448.0)


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int8", 32), ("fp8_e4m3", None)])
def test_reference_is_dequantise_then_matmul(fmt, group):
    """Against numpy in float64, and against the float matmul within the quantisation
    error bound sum_k |x_k| * |w_k - w_deq_k|."""
    rng = np.random.default_rng(SEED)
    k, n, m = 96, 40, 7
    w = _weights(rng, k, n, group)
    w_q, scales = quantize_weights(w, fmt, group)
    x = _acts(rng, m, k, jnp.float32)
    ref = np.asarray(quantized_matmul_reference(x, w_q, scales), np.float64)
    s = np.asarray(scales)[None, :] if group is None else np.repeat(np.asarray(scales), group, axis=0)
    w_deq = np.asarray(w_q.astype(jnp.float32)).astype(np.float64) * s
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(ref, x64 @ w_deq, **F64_TOL)
    bound = np.abs(x64) @ np.abs(np.asarray(w, np.float64) - w_deq)
    assert (np.abs(ref - x64 @ np.asarray(w, np.float64)) <= bound + 1e-5).all()
    x16 = x.astype(jnp.bfloat16)
    assert quantized_matmul_reference(x16, w_q, scales).dtype == jnp.bfloat16


def _bad_calls():
    S = jax.ShapeDtypeStruct
    x, w8, s = S((4, 64), jnp.float32), S((64, 32), jnp.int8), S((32,), jnp.float32)
    f8 = S((64, 32), jnp.float8_e4m3fn)
    return [
        ((S((64,), jnp.float32), w8, s), {}, r"x must have shape \[\*, \*\], got \[64\]"),
        ((S((4, 48), jnp.float32), w8, s), {}, r"w_q must have shape \[48, \*\], got \[64, 32\]"),
        ((S((4, 64), jnp.int32), w8, s), {}, r"x must be one of .*got int32"),
        ((x, S((64, 32), jnp.float32), s), {}, r"w_q must be one of \(int8, float8_e4m3fn\), got float32"),
        ((x, w8, S((16,), jnp.float32)), {}, r"scales must have shape \[32\], got \[16\]"),
        ((x, w8, S((32,), jnp.bfloat16)), {}, r"scales must be one of \(float32\), got bfloat16"),
        ((x, w8, S((3, 32), jnp.float32)), {}, r"groups dividing in_features 64, got 3"),
        ((S((4, 96), jnp.float32), S((96, 32), jnp.int8), S((2, 32), jnp.float32)), {},
         r"group size .* power of two >= 16, got 96 // 2"),
        ((x, w8, S((8, 32), jnp.float32)), {}, r"power of two >= 16, got 64 // 8"),
        ((x, w8, S((2, 16), jnp.float32)), {}, r"scales must have shape \[\*, 32\], got \[2, 16\]"),
        ((x, f8, S((2, 32), jnp.float32)), {}, r"only supported for int8 weights, got float8_e4m3fn"),
        ((x, w8, s), dict(block_m=24), r"block_m must be a power of two >= 16, got 24"),
        ((x, w8, s), dict(block_n=8), r"block_n must be a power of two >= 16, got 8"),
        ((x, w8, s), dict(block_k=48), r"block_k must be a power of two >= 16, got 48"),
        ((x, w8, S((2, 32), jnp.float32)), dict(block_k=64), r"block_k must divide the group size 32, got 64"),
        ((x, w8, s), dict(splits=0), r"splits must be in \[1, cdiv\(in_features, block_k\) = 1\], got 0"),
        ((x, w8, s), dict(impl="triton"), r"impl must be one of \('pallas', 'pallas_interpret'\), got 'triton'"),
        ((x, w8, s), dict(gemv="mma"), r"gemv must be one of \('dot', 'reduce', 'reduce_magic'\), got 'mma'"),
        ((S((5, 64), jnp.float32), w8, s), dict(gemv="reduce"), r"gemv 'reduce' takes at most 4 rows of x, got 5"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_matmul_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="quantized_matmul: .*" + match):
        jax.eval_shape(functools.partial(quantized_matmul, **{"impl": INTERPRET, **kwargs}), *args)
    if not kwargs:  # the reference checks the operands the same way
        with pytest.raises(ValueError, match="quantized_matmul_reference: .*" + match):
            jax.eval_shape(quantized_matmul_reference, *args)


@pytest.mark.parametrize("shape,dtype,fmt,group,match", [
    ((64,), jnp.float32, "int8", None, r"w must have shape \[\*, \*\]"),
    ((64, 32), jnp.int8, "int8", None, r"w must be one of .*got int8"),
    ((64, 32), jnp.float32, "int4", None, r"fmt must be one of \('int8', 'fp8_e4m3'\), got 'int4'"),
    ((64, 32), jnp.float32, "fp8_e4m3", 32, r"group_size is only supported for int8"),
    ((64, 32), jnp.float32, "int8", 8, r"group_size must be a power of two >= 16 dividing in_features 64, got 8"),
    ((64, 32), jnp.float32, "int8", 48, r"got 48"),
    ((96, 32), jnp.float32, "int8", 64, r"dividing in_features 96, got 64"),
])
def test_quantize_rejects_bad_inputs(shape, dtype, fmt, group, match):
    with pytest.raises(ValueError, match="quantize_weights: .*" + match):
        jax.eval_shape(functools.partial(quantize_weights, fmt=fmt, group_size=group),
                       jax.ShapeDtypeStruct(shape, dtype))


# The engine's projection shapes [in_features, out_features].
SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
LLAMA3_8B_SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]


# fast tier: SmolLM2's shapes; Llama-3-8B's (the same code paths at larger sizes) in the full
@pytest.mark.parametrize("model", ["smollm2", pytest.param("llama3_8b", marks=pytest.mark.full)])
def test_lowers_for_cuda_at_engine_shapes(model, cuda_lowering):
    """Every (shape, M in 1/16/256, int8 per channel / int8 group 128 / fp8, x bf16/f32)
    lowers to one Triton custom call with the right output type. Group 128 becomes group 64
    where in_features (576) is not a multiple of 128."""
    S = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(quantized_matmul, impl="pallas"))
    start, count = time.perf_counter(), 0
    shapes = SMOLLM2_SHAPES if model == "smollm2" else LLAMA3_8B_SHAPES
    for k, n in shapes:
        g = 128 if k % 128 == 0 else 64
        for fmt, group in (("int8", None), ("int8", g), ("fp8_e4m3", None)):
            scales = S((n,) if group is None else (k // group, n), jnp.float32)
            for dtype in (jnp.bfloat16, jnp.float32):
                for m in (1, 16, 256):
                    traced = fn.trace(S((m, k), dtype), S((k, n), WEIGHT_DTYPE[fmt]), scales)
                    assert traced.out_info.shape == (m, n) and traced.out_info.dtype == dtype
                    text = traced.lower(lowering_platforms=("cuda",)).as_text()
                    assert text.count("xla.gpu.triton") == 1, (k, n, fmt, group, dtype, m)
                    count += 1
    assert count == len(shapes) * 3 * 2 * 3
    assert time.perf_counter() - start < 60


def test_cuda_core_gemv_lowers_for_cuda_at_llama3_8b_shapes(cuda_lowering):
    """The multiply-and-reduce GEMV variants lower to one Triton custom call at
    Llama-3-8B's fused projection shapes (what tools/bench_quantized_matmul --sweep times),
    int8 per channel and per group, fp8, M 1."""
    S = jax.ShapeDtypeStruct
    for gemv in ("reduce", "reduce_magic"):
        fn = jax.jit(functools.partial(quantized_matmul, impl="pallas", gemv=gemv))
        for k, n in ((4096, 28672), (14336, 4096), (4096, 6144)):
            for fmt, group in (("int8", None), ("int8", 128), ("fp8_e4m3", None)):
                scales = S((n,) if group is None else (k // group, n), jnp.float32)
                traced = fn.trace(S((1, k), jnp.bfloat16), S((k, n), WEIGHT_DTYPE[fmt]), scales)
                assert traced.out_info.shape == (1, n)
                text = traced.lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("xla.gpu.triton") == 1, (gemv, k, n, fmt, group)
