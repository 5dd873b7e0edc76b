"""jaxserve.kernels.pallas.quantized_matmul_mosaic: the Mosaic GPU (Hopper) kernel in Mosaic GPU
interpret mode against the plain-jnp reference (GEMV with split-K, GEMM, per-channel and group
scales, int8 and e4m3, bf16 and f16), input validation, the engine's choice between it and the
Triton kernel, and CUDA lowering (TMA / wgmma layouts are checked there) at the engine's shapes."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.pallas.quantized_matmul import quantize_weights, quantized_matmul_reference
from jaxserve.kernels.pallas.quantized_matmul_mosaic import (mosaic_supports,
                                                             quantized_matmul_mosaic)

INTERPRET = "pallas_mosaic_interpret"
# Kernel vs reference: the weights are widened exactly and the products of 16-bit x and an
# int8 / e4m3 value are exact in f32, so they differ by the f32 summation order (tiles,
# splits) and one rounding of the output to x's dtype: 2 ulps of it (bf16 2^-7, f16 2^-10
# relative), absolute part scaled by the largest output.
TOLERANCES = {jnp.bfloat16: 2 * 2.0 ** -7, jnp.float16: 2 * 2.0 ** -10}
SEED = 20261126
WEIGHT_DTYPE = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn}


def _operands(rng, m, k, n, fmt="int8", group=None, dtype=jnp.bfloat16):
    """x [m, k] dtype (scaled so outputs are O(1)) and quantised weights whose columns (and
    groups) have magnitudes spread over ~e^+-1, so distinct scales matter."""
    w = rng.standard_normal((k, n)) * np.exp(rng.standard_normal(n))[None, :]
    if group is not None:
        w *= np.repeat(np.exp(rng.standard_normal((k // group, n))), group, axis=0)
    w_q, scales = quantize_weights(jnp.asarray(w, jnp.float32), fmt, group)
    x = jnp.asarray(rng.standard_normal((m, k)) / np.sqrt(k), dtype)
    return x, w_q, scales


def _assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype == jnp.dtype(dtype)
    out32, ref32 = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (an unwritten tile)"
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(out32, ref32, rtol=tol, atol=tol * max(1.0, np.abs(ref32).max()))


# (fmt, group, k, n): K tiles 8 / 9 / 16 (split-K picks 2, 1, 4 ranges), N tiles of 64 / 128.
CASES = [("int8", None, 512, 256), ("int8", None, 576, 192), ("fp8_e4m3", None, 512, 384),
         ("int8", 128, 1024, 128), ("int8", 64, 576, 256)]


# fast tier: bf16 (what the engine runs); f16 in the full tier
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.full)],
                         ids=["bf16", "f16"])
@pytest.mark.parametrize("fmt,group,k,n", CASES, ids=[f"{f}-g{g}-{k}x{n}" for f, g, k, n in CASES])
def test_kernel_matches_reference(fmt, group, k, n, dtype, mosaic_impl):
    """M = 1 and 37 (GEMV: one 64-row tile, split-K) and 130 (GEMM: three 128-row tiles,
    the last mostly padding)."""
    rng = np.random.default_rng(SEED)
    for m in (1, 37, 130):
        x, w_q, scales = _operands(rng, m, k, n, fmt, group, dtype)
        out = quantized_matmul_mosaic(x, w_q, scales, impl=mosaic_impl)
        _assert_close(out, quantized_matmul_reference(x, w_q, scales), dtype)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_every_split_count_gives_the_product(splits, mosaic_impl):
    """Explicit split-K ranges (8 tiles of K): the partials of every range are summed once."""
    x, w_q, scales = _operands(np.random.default_rng(SEED), 3, 512, 128)
    out = quantized_matmul_mosaic(x, w_q, scales, splits=splits, impl=mosaic_impl)
    _assert_close(out, quantized_matmul_reference(x, w_q, scales), jnp.bfloat16)


def test_group_scales_are_applied_per_group(mosaic_impl):
    """Swapping two groups' scale rows, or flattening them to one per channel, changes the
    result far beyond the tolerance: each group's partial sum really gets its own row."""
    x, w_q, scales = _operands(np.random.default_rng(SEED), 4, 512, 128, group=128)
    ref = np.asarray(quantized_matmul_reference(x, w_q, scales).astype(jnp.float32))
    good = quantized_matmul_mosaic(x, w_q, scales, impl=mosaic_impl)
    _assert_close(good, quantized_matmul_reference(x, w_q, scales), jnp.bfloat16)
    for bad in (scales[jnp.array([1, 0, 2, 3])], jnp.broadcast_to(scales.mean(axis=0), scales.shape)):
        out = np.asarray(quantized_matmul_mosaic(x, w_q, bad, impl=mosaic_impl).astype(jnp.float32))
        assert np.abs(out - ref).max() > 20 * TOLERANCES[jnp.bfloat16] * np.abs(ref).max()


def test_supported_shapes():
    """What the engine sends to this kernel and what stays on the Triton one."""
    assert mosaic_supports(jnp.bfloat16, jnp.int8, 4096, 1024, None)
    assert mosaic_supports(jnp.float16, jnp.int8, 576, 192, 64)
    assert mosaic_supports(jnp.bfloat16, jnp.float8_e4m3fn, 4096, 14336, None)
    assert not mosaic_supports(jnp.float32, jnp.int8, 4096, 4096, None)  # no f32 wgmma here
    assert not mosaic_supports(jnp.bfloat16, jnp.float8_e4m3fn, 576, 192, None)  # e4m3: N % 128
    assert not mosaic_supports(jnp.bfloat16, jnp.int8, 96, 128, None)  # K % 64
    assert not mosaic_supports(jnp.bfloat16, jnp.int8, 512, 80, None)  # N % 64
    assert not mosaic_supports(jnp.bfloat16, jnp.int8, 512, 128, 32)  # group % 64


def _bad_calls():
    S = jax.ShapeDtypeStruct
    x, w8, s = S((4, 512), jnp.bfloat16), S((512, 256), jnp.int8), S((256,), jnp.float32)
    return [
        ((S((4, 512), jnp.float32), w8, s), {}, r"needs x bf16 / f16 \(got float32\)"),
        ((S((4, 96), jnp.bfloat16), S((96, 256), jnp.int8), s), {}, r"in_features % 64 == 0 \(got 96\)"),
        ((x, S((512, 80), jnp.int8), S((80,), jnp.float32)), {}, r"out_features % 64 == 0.*\(got 80\)"),
        ((x, S((512, 192), jnp.float8_e4m3fn), S((192,), jnp.float32)), {}, r"% 128 for e4m3 \(got 192\)"),
        ((x, w8, S((16, 256), jnp.float32)), {}, r"group size % 64 == 0 \(got 32\)"),
        ((x, w8, S((16,), jnp.float32)), {}, r"scales must have shape \[256\], got \[16\]"),
        ((x, w8, s), dict(tile_n=96), r"tile_n must be 64 \(int8 only\), 128 or 256 .* got 96"),
        ((x, w8, s), dict(splits=3), r"splits must divide in_features / 64 = 8 .*got 3"),
        ((S((100, 512), jnp.bfloat16), w8, s), dict(splits=2), r"be 1 for M > 64\), got 2"),
        ((x, w8, s), dict(max_concurrent_steps=0), r"max_concurrent_steps must be >= 1, got 0"),
        ((x, w8, s), dict(impl="pallas"), r"impl must be one of \('pallas_mosaic', "
                                          r"'pallas_mosaic_interpret'\), got 'pallas'"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="quantized_matmul_mosaic: .*" + match):
        jax.eval_shape(functools.partial(quantized_matmul_mosaic, **{"impl": INTERPRET, **kwargs}),
                       *args)


def test_engine_matmul_picks_mosaic_where_supported(cuda_lowering):
    """PallasMatmul(mosaic=True) runs the Mosaic kernel for bf16 x and the Triton kernel for
    f32 x (one custom call of each kind in the lowered module), same numbers as the reference."""
    from jaxserve.model.linear import matmul_backend
    backend = matmul_backend("pallas_mosaic")
    S = jax.ShapeDtypeStruct
    for dtype, call in ((jnp.bfloat16, "mosaic_gpu"), (jnp.float32, "xla.gpu.triton")):
        f = jax.jit(lambda x, w, s: backend._quantized(x, w, s))
        text = f.trace(S((1, 512), dtype), S((512, 256), jnp.int8), S((256,), jnp.float32)) \
            .lower(lowering_platforms=("cuda",)).as_text()
        other = "xla.gpu.triton" if call == "mosaic_gpu" else "mosaic_gpu"
        assert call in text and other not in text, dtype
    x, w_q, scales = _operands(np.random.default_rng(SEED), 2, 512, 256)
    out = matmul_backend("pallas_mosaic_interpret")._quantized(x, w_q, scales)
    _assert_close(out, quantized_matmul_reference(x, w_q, scales), jnp.bfloat16)


# The engine's projection shapes [in_features, out_features].
SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]
LLAMA3_8B_SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]


# fast tier: SmolLM2's shapes; Llama-3-8B's (the same code paths at larger sizes) in the full
@pytest.mark.parametrize("model", ["smollm2", pytest.param("llama3_8b", marks=pytest.mark.full)])
def test_lowers_for_cuda_at_engine_shapes(model):
    """Every supported (shape, int8 per channel / int8 group 128 (64 where K is not a multiple
    of 128) / e4m3, M 1 / 64 / 256) lowers to one Mosaic GPU custom call with the right output:
    Mosaic checks the TMA and wgmma layouts as it lowers. The unsupported ones (e4m3 with
    out_features 576 or 192, SmolLM2's) are the Triton kernel's."""
    S = jax.ShapeDtypeStruct
    fn = jax.jit(functools.partial(quantized_matmul_mosaic, impl="pallas_mosaic"))
    start, count = time.perf_counter(), 0
    shapes = SMOLLM2_SHAPES if model == "smollm2" else LLAMA3_8B_SHAPES
    for k, n in shapes:
        g = 128 if k % 128 == 0 else 64
        for fmt, group in (("int8", None), ("int8", g), ("fp8_e4m3", None)):
            if not mosaic_supports(jnp.bfloat16, WEIGHT_DTYPE[fmt], k, n, group):
                assert fmt == "fp8_e4m3" and n % 128 != 0
                continue
            scales = S((n,) if group is None else (k // group, n), jnp.float32)
            for m in (1, 64, 256):
                traced = fn.trace(S((m, k), jnp.bfloat16), S((k, n), WEIGHT_DTYPE[fmt]), scales)
                assert traced.out_info.shape == (m, n) and traced.out_info.dtype == jnp.bfloat16
                text = traced.lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("stablehlo.custom_call @mosaic_gpu") == 1, (k, n, fmt, group, m)
                count += 1
    assert count == {"smollm2": (4 * 3 - 3) * 3, "llama3_8b": 4 * 3 * 3}[model]
    assert time.perf_counter() - start < 60


def test_bench_tool_reports_bytes_rates_and_skips():
    """tools/bench_quantized_matmul on this machine: the bf16 baseline and the reference are
    timed, GB/s is the minimal bytes over the time, and the GPU kernels are skipped with the
    reason (they are timed on a GPU: the tool's use)."""
    from tools.bench_quantized_matmul import bench

    # a weight of 8 MB: a call takes ~1 ms on CPU, so 16 calls against 1 (the tool's timing)
    # measure more than noise
    res = bench(["1024x4096"], [2], ["xla_bf16", "xla", "reference", "pallas", "pallas_mosaic"],
                ["int8"], None, 3, sweep=True)
    by_impl = {r["impl"]: r for r in res["rows"]}
    # no GPU here: the sweep's variants run only where their kernel does
    assert set(by_impl) == {"xla_bf16", "xla", "reference", "pallas", "pallas_mosaic"}
    io = (2 * 1024 + 2 * 4096) * 2
    assert by_impl["xla_bf16"]["bytes"] == 1024 * 4096 * 2 + io
    assert by_impl["xla"]["bytes"] == by_impl["reference"]["bytes"] == 1024 * 4096 + 4096 * 4 + io
    for r in (by_impl["xla_bf16"], by_impl["xla"], by_impl["reference"]):
        assert r["gb_s"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["of_peak"] == pytest.approx(r["gb_s"] / res["read_gb_s"])
    assert by_impl["xla_bf16"]["vs_bf16"] == 1.0
    if res["platform"] != "gpu":
        assert by_impl["pallas"]["skipped"] == "needs a GPU"
        assert by_impl["pallas_mosaic"]["skipped"] == "needs a GPU"
