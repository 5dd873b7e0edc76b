"""jaxserve.kernels.pallas.ggml_matmul: GGML blocks (Q4_0, Q4_1, Q8_0) unpacked in the Pallas
kernel (interpret mode) against its plain-jnp reference (ggml's own dequantisation, bit for
bit with gguf-py's: tests/test_gguf*.py), split-K, ragged edges, input validation, the
model's projections through it, and CUDA lowering at the engine's shapes."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.ggml_blocks import dequantize_blocks
from jaxserve.kernels.pallas.ggml_matmul import ggml_matmul, ggml_matmul_reference
from kernel_utils import DTYPES, case_grid

INTERPRET = "pallas_interpret"
SEED = 20261126
F32_TOL = 2e-5  # f32 x: the same weights, another f32 summation order (relative to sum |x w|)


def _fields(rng, fmt: str, n: int, k: int):
    """Random blocks of an [n, k] weight: every nibble / int8 value, f16 scales over ~e^+-1
    (Q4_1: negative minimums, as real Q4_1 files have)."""
    blocks = k // 32
    if fmt == "q8_0":
        qs = jnp.asarray(rng.integers(-127, 128, (n, blocks, 32)), jnp.int8)
    else:
        qs = jnp.asarray(rng.integers(0, 256, (n, blocks, 16)), jnp.uint8)
    d = jnp.asarray(0.02 * np.exp(rng.standard_normal((n, blocks))), jnp.float16)
    m = jnp.asarray(-8 * np.asarray(d, np.float32) * rng.random((n, blocks)), jnp.float16) \
        if fmt == "q4_1" else None
    return qs, d, m


def _assert_close(out, ref, x, qs, d, m, fmt, dtype):
    """Within the rounding the kernel adds: f32 x, summation order (F32_TOL of sum |x| |w|);
    bf16 x, each weight rounded to bf16 for the dot (<= 2^-9 relative: 2^-9 sum |x| |w|),
    and both outputs rounded to bf16, which puts values that close at most one bf16 ulp
    apart besides (an ulp is <= 2^-7 of the value)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32, ref32 = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
    assert np.isfinite(out32).all(), "kernel left NaN/inf (an unwritten or unmasked element)"
    w = np.abs(np.asarray(dequantize_blocks(qs, d, m, fmt)))
    mass = np.abs(np.asarray(x.astype(jnp.float32))) @ w.T  # sum |x| |w| per element
    bound = F32_TOL * mass
    if dtype != jnp.float32:
        bound = bound + 2.0 ** -9 * mass + 2.0 ** -7 * np.abs(ref32)
    assert (np.abs(out32 - ref32) <= bound + 1e-30).all(), np.abs(out32 - ref32).max()


# (fmt, in_features, out_features): SmolLM2's 576 inputs (4.5 blocks of 128), an N not a
# multiple of the blocks
SHAPES = [("q4_0", 96, 80), ("q4_1", 96, 80), ("q8_0", 96, 80), ("q4_1", 576, 200),
          ("q8_0", 576, 200)]


@pytest.mark.parametrize("fmt,k,n,dtype", case_grid(SHAPES, DTYPES,
                                                    [f"{f}-{k}x{n}" for f, k, n in SHAPES]))
def test_kernel_matches_reference(fmt, k, n, dtype, pallas_impl):
    """Default blocks and splits; rows 1 (decode, split-K), 5, 37."""
    rng = np.random.default_rng(SEED)
    qs, d, m = _fields(rng, fmt, n, k)
    for rows in (1, 5, 37):
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        out = ggml_matmul(x, qs, d, m, fmt, impl=pallas_impl)
        assert out.dtype == jnp.dtype(dtype)
        _assert_close(out, ggml_matmul_reference(x, qs, d, m, fmt), x, qs, d, m, fmt, dtype)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_blocks_splits_and_f32_logits(fmt, pallas_impl):
    """Explicit tiles with ragged edges (K = 160: the last 64-input step half empty; N = 80,
    M = 37), split-K into 1, 2 and 3 ranges of the 5 K steps of 32, and out_dtype f32 from
    bf16 x (the LM head's logits): the reference's product each time; and the test can
    fail: the same blocks read as the other 4-bit format are far off."""
    rng = np.random.default_rng(SEED + 1)
    qs, d, m = _fields(rng, fmt, 80, 160)
    x = jnp.asarray(rng.standard_normal((37, 160)), jnp.float32)
    ref = ggml_matmul_reference(x, qs, d, m, fmt)
    out = ggml_matmul(x, qs, d, m, fmt, block_m=16, block_n=64, block_k=64, impl=pallas_impl)
    _assert_close(out, ref, x, qs, d, m, fmt, jnp.float32)
    for splits in (1, 2, 3):
        out = ggml_matmul(x[:1], qs, d, m, fmt, block_k=32, splits=splits, impl=pallas_impl)
        _assert_close(out, ref[:1], x[:1], qs, d, m, fmt, jnp.float32)
    xb = x.astype(jnp.bfloat16)
    logits = ggml_matmul(xb, qs, d, m, fmt, out_dtype=jnp.float32, impl=pallas_impl)
    want = ggml_matmul_reference(xb, qs, d, m, fmt, out_dtype=jnp.float32)
    assert logits.dtype == jnp.float32
    _assert_close(logits, want, xb, qs, d, m, fmt, jnp.bfloat16)
    if fmt != "q8_0":
        other = "q4_0" if fmt == "q4_1" else "q4_1"
        m2 = d if other == "q4_1" else None
        wrong = np.asarray(ggml_matmul_reference(x, qs, d, m2, other))
        assert np.abs(wrong - np.asarray(ref)).max() > 0.1 * np.abs(np.asarray(ref)).max()


# fast tier: Q4_1 (the default GGUF's blocks); Q4_0 and Q8_0 in the full
@pytest.mark.parametrize("fmt", [pytest.param("q4_0", marks=pytest.mark.full), "q4_1",
                                 pytest.param("q8_0", marks=pytest.mark.full)])
def test_cuda_core_gemv_matches_reference(fmt, pallas_impl):
    """gemv "reduce" (M <= 4: each block's quants, scale and x halves loaded whole, the
    scale applied once a block): 1-4 rows, f32 and bf16 x, the default tiles, a ragged last
    K step and N edge (K = 160 in steps of 64, N = 80 in tiles of 64), split-K, and f32
    logits: the reference's product each time; more than 4 rows is refused."""
    rng = np.random.default_rng(SEED + 3)
    for k, n in ((96, 80), (576, 200), (160, 80)):
        qs, d, m = _fields(rng, fmt, n, k)
        for rows, dtype, kw in ((1, jnp.float32, {}), (2, jnp.bfloat16, {}),
                                (4, jnp.float32, dict(block_n=64, block_k=64, splits=2)),
                                (3, jnp.bfloat16, dict(out_dtype=jnp.float32))):
            x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
            out = ggml_matmul(x, qs, d, m, fmt, impl=pallas_impl, gemv="reduce", **kw)
            ref = ggml_matmul_reference(x, qs, d, m, fmt, out_dtype=kw.get("out_dtype"))
            # f32 products of the exact weights: the f32 bound for either x, plus the
            # output's own rounding for bf16 out
            out_dt = kw.get("out_dtype", dtype)
            _assert_close(out, ref, x.astype(jnp.float32), qs, d, m, fmt,
                          jnp.float32 if out_dt == jnp.float32 else dtype)
    with pytest.raises(ValueError, match="gemv 'reduce' takes at most 4 rows of x, got 5"):
        jax.eval_shape(functools.partial(ggml_matmul, fmt=fmt, impl=INTERPRET, gemv="reduce"),
                       jnp.zeros((5, 96), jnp.float32), qs[:, :3], d[:, :3],
                       None if m is None else m[:, :3])


def test_reference_is_numpy_dequantise_then_matmul():
    """Independent of jnp: the blocks dequantised in numpy from the format table
    (jaxserve.kernels.ggml_blocks) and multiplied in float64."""
    rng = np.random.default_rng(SEED + 2)
    for fmt in ("q4_0", "q4_1", "q8_0"):
        qs, d, m = _fields(rng, fmt, 24, 64)
        q = np.asarray(qs)
        if fmt != "q8_0":
            q = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.float64)
            q = q - 8 if fmt == "q4_0" else q
        w = q * np.asarray(d, np.float64)[..., None]
        if fmt == "q4_1":
            w = w + np.asarray(m, np.float64)[..., None]
        x = rng.standard_normal((3, 64))
        want = x @ w.reshape(24, 64).T
        got = np.asarray(ggml_matmul_reference(jnp.asarray(x, jnp.float32), qs, d, m, fmt))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _bad_calls():
    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    x, qs, d = S((4, 96), f32), S((80, 3, 16), jnp.uint8), S((80, 3), jnp.float16)
    return [
        ((x, qs, d, None, "q5_0"), {}, r"fmt must be one of \('q4_0', 'q4_1', 'q8_0'\), got 'q5_0'"),
        ((S((4, 100), f32), qs, d, None, "q4_0"), {}, r"in_features a multiple of 32, got \[4, 100\]"),
        ((S((4, 96), jnp.int32), qs, d, None, "q4_0"), {}, r"x must be one of \(float32, bfloat16, float16\)"),
        ((x, S((80, 3, 32), jnp.uint8), d, None, "q4_0"), {}, r"qs must have shape \[\*, 3, 16\]"),
        ((x, qs, d, None, "q8_0"), {}, r"qs must have shape \[\*, 3, 32\]"),
        ((x, S((80, 3, 16), jnp.int8), d, None, "q4_0"), {}, r"qs must be one of \(uint8\), got int8"),
        ((x, qs, S((80, 3), f32), None, "q4_0"), {}, r"d must be one of \(float16\), got float32"),
        ((x, qs, S((81, 3), jnp.float16), None, "q4_0"), {}, r"d must have shape \[80, 3\]"),
        ((x, qs, d, None, "q4_1"), {}, r"m \[out_features, in_features / 32\] f16 is required for q4_1"),
        ((x, qs, d, d, "q4_0"), {}, r"m must be None for q4_0"),
        ((x, qs, d, None, "q4_0"), dict(block_k=16), r"block_k must be a power of two >= 32, got 16"),
        ((x, qs, d, None, "q4_0"), dict(block_n=24), r"block_n must be a power of two >= 16, got 24"),
        ((x, qs, d, None, "q4_0"), dict(splits=4, block_k=32), r"splits must be in \[1, .* = 3\], got 4"),
        ((x, qs, d, None, "q4_0"), dict(impl="triton"), r"impl must be one of"),
    ]


@pytest.mark.parametrize("args,kwargs,match", _bad_calls())
def test_rejects_bad_inputs(args, kwargs, match):
    with pytest.raises(ValueError, match="ggml_matmul: .*" + match):
        jax.eval_shape(functools.partial(ggml_matmul, fmt=args[4], **{"impl": INTERPRET, **kwargs}),
                       *args[:4])
    if not kwargs:
        with pytest.raises(ValueError, match="ggml_matmul_reference: .*" + match):
            jax.eval_shape(functools.partial(ggml_matmul_reference, fmt=args[4]), *args[:4])


def test_model_projections_and_lm_head_run_the_kernel():
    """A tiny model's projections and tied LM head as GGML blocks (jaxserve.model.ggml_weight)
    under PallasMatmul (interpret; and "pallas_gemv_interpret", whose one-row decode steps
    take the CUDA-core GEMV): the logits of XlaMatmul's reference path (dequantise, f32
    matmul) within f32 summation order, through prefill and decode steps."""
    import gguf
    from jaxserve.model.ggml_weight import GGMLWeight, from_gguf_bytes
    from jaxserve.model.params import init_params
    from jaxserve.model.transformer import Kernels
    from model_utils import PagedDriver, tiny_config

    cfg = tiny_config(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                      head_dim=16, vocab_size=128)
    params = init_params(cfg, jax.random.key(3), scale=0.3)

    def blocks(w, n_in, fmt):  # [*in, *out] -> GGML blocks [out, in]
        w2 = np.asarray(w, np.float32).reshape(int(np.prod(w.shape[:n_in])), -1).T
        qtype = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
                 "q8_0": gguf.GGMLQuantizationType.Q8_0}[fmt]
        g = from_gguf_bytes(gguf.quants.quantize(np.ascontiguousarray(w2), qtype), fmt)
        return GGMLWeight(qs=jnp.asarray(g.qs), d=jnp.asarray(g.d),
                          m=None if g.m is None else jnp.asarray(g.m), fmt=fmt,
                          logical_shape=tuple(w.shape))

    layers = tuple(dataclasses.replace(
        lp, wq=blocks(lp.wq, 1, "q4_1"), wk=blocks(lp.wk, 1, "q4_0"), wv=blocks(lp.wv, 1, "q8_0"),
        wo=blocks(lp.wo, 2, "q4_1"), w_gate=blocks(lp.w_gate, 1, "q4_0"),
        w_up=blocks(lp.w_up, 1, "q8_0"), w_down=blocks(lp.w_down, 1, "q4_1"))
        for lp in params.layers)
    qparams = dataclasses.replace(params, layers=layers)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 12).tolist()
    out = {}
    for impl in ("xla", "pallas_interpret", "pallas_gemv_interpret"):
        drv = PagedDriver(qparams, cfg, page_size=4, kernels=Kernels("xla", impl))
        out[impl] = [drv.step({"s": ids[:9]}, T=16, P=4)["s"]]
        out[impl] += [drv.step({"s": [t]}, T=1, P=4)["s"] for t in ids[9:]]
    for impl in ("pallas_interpret", "pallas_gemv_interpret"):
        for got, want in zip(out[impl], out["xla"]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# (out_features, in_features): SmolLM2's gate|up (fused), Llama-3-8B's q (4096 x 4096) and
# w_down (4096 x 14336)
MATMUL_SHAPES = {"smollm2-gate-up": (3072, 576), "llama3-8b-q": (4096, 4096),
                 "llama3-8b-down": (4096, 14336)}


@pytest.mark.parametrize("shape,fmt", case_grid(list(MATMUL_SHAPES),
                                                {f: f for f in ("q4_0", "q4_1", "q8_0")}))
def test_lowers_for_cuda_at_engine_shapes(shape, fmt, cuda_lowering):
    """bf16 x of 1 / 64 / 512 rows (decode with split-K, mixed steps), and 1 / 4 rows in the
    CUDA-core GEMV: one Triton custom call each, [rows, out] in bf16
    (tools/compile_triton.py compiles the Llama-3-8B w_down configurations to sm_90 cubin:
    no spill at M = 1, nor in the GEMV at 1 and 4)."""
    S = jax.ShapeDtypeStruct
    n, k = MATMUL_SHAPES[shape]
    q8 = fmt == "q8_0"
    qs = S((n, k // 32, 32 if q8 else 16), jnp.int8 if q8 else jnp.uint8)
    d = S((n, k // 32), jnp.float16)
    start = time.perf_counter()
    for rows, gemv in ((1, "dot"), (64, "dot"), (512, "dot"), (1, "reduce"), (4, "reduce")):
        fn = jax.jit(functools.partial(ggml_matmul, fmt=fmt, impl="pallas", gemv=gemv))
        traced = fn.trace(S((rows, k), jnp.bfloat16), qs, d, d if fmt == "q4_1" else None)
        assert traced.out_info.shape == (rows, n) and traced.out_info.dtype == jnp.bfloat16
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1, (shape, fmt, rows)
    assert time.perf_counter() - start < 60
