"""jaxserve.kernels.cpu.ggml_matmul: the panel packing (the GGUF bytes reordered), the C++
kernel against the plain-jnp reference of its arithmetic (x quantised per block, integer
block sums) for every format and row-block remainder, the portable loop against the VNNI
one, the error x's quantisation adds against the dequantised weights' exact product, and
input checks."""

from __future__ import annotations

import ctypes
import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu.ggml_matmul import (COLS, FMT_IDS, RECORD_BYTES, ggml_matmul,
                                              ggml_matmul_q8_reference, pack, quantize_x)
from jaxserve.model.ggml_weight import GGUF_TYPES, dequantize, from_gguf_bytes

SEED = 20261127
QTYPES = {fmt: gguf.GGMLQuantizationType[name] for name, fmt in GGUF_TYPES.items()}
FORMATS = sorted(QTYPES)


@pytest.fixture(scope="module", autouse=True)
def _library(cpu_kernels_library):
    return cpu_kernels_library


def _weight(rng, n, k, fmt):
    """A [n, k] matrix quantised by gguf-py (llama.cpp's quantiser) as a GGMLWeight."""
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    w[1, :32] = 0.0  # a zero block (d = 0)
    return jax.tree.map(jnp.asarray, from_gguf_bytes(gguf.quants.quantize(w, QTYPES[fmt]), fmt))


def _fields(w):
    return w.qs, w.d, w.m, w.fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_keeps_the_bytes_and_places_each_quant(fmt):
    """Record (panel p, block b): 16 f16 scales (and Q4_1's minimums) of its columns, then
    the quants: weight (16p + c, 32b + j) at the byte and nibble the kernel reads."""
    rng = np.random.default_rng(SEED)
    w = _weight(rng, 48, 96, fmt)
    packed = np.asarray(pack(*_fields(w)))
    assert packed.shape == (3, 3, RECORD_BYTES[fmt]) and packed.dtype == np.uint8
    assert packed.size == w.nbytes  # the GGUF tensor's bytes, reordered
    qs, d = np.asarray(w.qs), np.asarray(w.d)
    for n, k in [(0, 0), (17, 45), (47, 95), (33, 70), (20, 8), (5, 20)]:
        p, c, b, j = n // COLS, n % COLS, k // 32, k % 32
        rec = packed[p, b]
        assert rec[:32].view(np.float16)[c] == d[n, b]
        if fmt == "q4_1":
            assert rec[32:64].view(np.float16)[c] == np.asarray(w.m)[n, b]
        body = rec[64 if fmt == "q4_1" else 32:]
        if fmt == "q8_0":
            assert int(body[(j // 4) * 64 + c * 4 + j % 4]) == int(qs[n, b, j]) + 128
        else:
            nib = qs[n, b, j] & 15 if j < 16 else qs[n, b, j - 16] >> 4
            byte = body[(j // 8) * 64 + c * 4 + (j % 8) % 4]
            assert (byte & 15 if j % 8 < 4 else byte >> 4) == nib, (n, k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(64, 96), (16 * 37, 64)])
def test_kernel_matches_the_reference_of_its_arithmetic(fmt, n, k):
    """Row counts 0 .. 9, 37 and 200 cover every remainder of the 8-row register blocks,
    runs of panels with one left over (37 panels) and the split by row chunks (200 rows
    over 4 panels). x's quantisation and the integer sums are exact in both; only f32
    rounding of the scaled terms may differ (contraction, order)."""
    rng = np.random.default_rng(SEED + n + k)
    w = _weight(rng, n, k, fmt)
    packed = pack(*_fields(w))
    for m in list(range(10)) + [37, 200]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        x = x.at[:, 32:64].set(0.0) if m else x  # a zero block of x (d_x = 0)
        out = np.asarray(ggml_matmul(x, packed, fmt))
        ref = np.asarray(ggml_matmul_q8_reference(x, *_fields(w)))
        assert out.shape == (m, n) and np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(ref).max(initial=0)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_x_quantisation_error_against_the_dequantised_product(fmt):
    """Against the dequantised weights times x unquantised (f32): the only difference is
    x rounded to 8 bits per block, |x - d_x q_x| <= d_x / 2 = max|x_block| / 254 per
    element, so each output's error is bounded by sum_k |w_k| max|x_block(k)| / 254;
    checked per output (the bound is the worst case, errors mostly cancel)."""
    rng = np.random.default_rng(SEED + 1)
    w = _weight(rng, 64, 256, fmt)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    wf = np.asarray(dequantize(w))  # [N, K]
    exact = np.asarray(x) @ wf.T
    got = np.asarray(ggml_matmul(x, pack(*_fields(w)), fmt))
    xmax = np.abs(np.asarray(x)).reshape(5, -1, 32).max(-1).repeat(32, axis=1)  # [M, K]
    bound = (xmax / 254) @ np.abs(wf).T + 1e-5 * np.abs(exact).max()
    assert (np.abs(got - exact) <= bound).all()
    assert np.abs(got - exact).max() > 0  # x really was quantised


def test_quantize_x_rounds_half_away_from_zero_and_sums():
    x = jnp.zeros((1, 32), jnp.float32).at[0, 0].set(127.0).at[0, 1].set(2.5).at[0, 2].set(-2.5)
    q, d, s = quantize_x(x)
    assert float(d[0, 0]) == 1.0
    assert q[0, 0, :3].tolist() == [127, 3, -3] and int(s[0, 0]) == 127
    q0, d0, s0 = quantize_x(jnp.zeros((2, 64), jnp.float32))
    assert not np.asarray(q0).any() and not np.asarray(d0).any() and not np.asarray(s0).any()


def _built_call(library, name: str, x, packed, fmt: str, swiglu: bool = False):
    """ggml_matmul of x by `packed` through `library`'s handler (a build for another
    target), registered as target `name`."""
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(library.JaxserveGgmlMatmul),
                                platform="cpu")
    cols = COLS * packed.shape[0] // (2 if swiglu else 1)
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((x.shape[0], cols), jnp.float32))
    return np.asarray(call(x, packed, jnp.zeros((), jnp.int32), fmt=np.int64(FMT_IDS[fmt]),
                           swiglu=swiglu))


def test_portable_path_matches_the_vnni_one(portable_cpu_kernels):
    """The loop machines without AVX2 run (built for x86-64-v2; non-x86 CPUs too): the
    same integer sums and f32 steps, so the same bits, for 11 rows (a block of 8 and a
    remainder of 3 sharing each unpacked record)."""
    rng = np.random.default_rng(SEED + 2)
    for fmt in FORMATS:
        packed = pack(*_fields(_weight(rng, 48, 128, fmt)))
        x = jnp.asarray(rng.standard_normal((11, 128)), jnp.float32)
        got = _built_call(portable_cpu_kernels, "jaxserve_ggml_matmul_portable_test", x, packed, fmt)
        np.testing.assert_array_equal(got, np.asarray(ggml_matmul(x, packed, fmt)))
    assert isinstance(portable_cpu_kernels, ctypes.CDLL)


def _saturating_q4_weight(n: int, k: int, fmt: str):
    """A Q4 weight whose every quant is 15 (the nibble's maximum), d = 1 (and m = 0): with
    x's quants all +127 (or all -127), each of the AVX2 path's int16 sums of a block's 8
    vpmaddubsw pair sums reaches +-8 * 2 * 15 * 127 = +-30,480, next to int16's limit."""
    from jaxserve.model.ggml_weight import GGMLWeight
    qs = jnp.full((n, k // 32, 16), 0xFF, jnp.uint8)
    d = jnp.ones((n, k // 32), jnp.float16)
    m = jnp.zeros((n, k // 32), jnp.float16) if fmt == "q4_1" else None
    return GGMLWeight(qs=qs, d=d, m=m, fmt=fmt)


def test_avx2_path_is_the_portable_one_bit_for_bit(avx2_cpu_kernels, portable_cpu_kernels):
    """The AVX2 path (built for x86-64-v3: vpmaddubsw in place of vpdpbusd, a Q4 block's
    pair sums added in int16 before one vpmaddwd, 8-column halves) gives the portable
    loop's outputs (and so the VNNI path's: test_portable_path_matches_the_vnni_one)
    exactly: every format (Q8_0's full-range weights: -127 and +127 quants, no 16-bit pair
    saturating), every remainder of its 8-row blocks, both of its pass orders (both halves
    per pass up to 2 rows, one half per pass from 3), extreme x (a +-127 quant in every
    block), and Q4 weights at their maximum times x at +-127 everywhere (the int16 sums'
    worst case)."""
    rng = np.random.default_rng(SEED + 4)

    def both(x, packed, fmt):
        got = _built_call(avx2_cpu_kernels, "jaxserve_ggml_matmul_avx2_test", x, packed, fmt)
        want = _built_call(portable_cpu_kernels, "jaxserve_ggml_matmul_portable_test", x,
                           packed, fmt)
        return got, want

    for fmt in FORMATS:
        w = _weight(rng, 48, 128, fmt)
        packed = pack(*_fields(w))
        if fmt == "q8_0":  # each block's absmax weight quantises to +-127
            assert np.abs(np.asarray(w.qs)).max() == 127
        for m in (1, 2, 3, 4, 7, 8, 9, 13, 17):
            x = rng.standard_normal((m, 128)).astype(np.float32)
            x[:, ::32] = 50.0 * np.sign(x[:, ::32])  # the block maximum: a quant of +-127
            got, want = both(jnp.asarray(x), packed, fmt)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got, np.asarray(ggml_matmul(jnp.asarray(x), packed, fmt)))
    for fmt in ("q4_0", "q4_1"):
        w = _saturating_q4_weight(32, 128, fmt)
        x = np.ones((10, 128), np.float32)
        x[1::2] = -1.0  # quants of +127 and -127 in every block
        got, want = both(jnp.asarray(x), pack(*_fields(w)), fmt)
        np.testing.assert_array_equal(got, want)
        exact = x @ np.asarray(dequantize(w), np.float32).T  # x's quants are exact here
        np.testing.assert_allclose(got, exact, rtol=1e-6)


def test_a_stacked_weight_is_read_at_its_layer():
    """A stack of packed weights [L, ...] (a layer loop's) at `layer`, given as an int and
    traced inside lax.scan: each layer's product is the unstacked call's exactly; a layer
    outside the stack fails the call, naming it."""
    rng = np.random.default_rng(SEED + 3)
    ws = [pack(*_fields(_weight(rng, 48, 64, "q4_1"))) for _ in range(3)]
    stacked = jnp.stack(ws)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    want = np.stack([np.asarray(ggml_matmul(x, w, "q4_1")) for w in ws])
    assert np.abs(want[0] - want[1]).max() > 0.1  # the layers differ
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(ggml_matmul(x, stacked, "q4_1", i)), want[i])
    _, got = jax.lax.scan(lambda c, i: (c, ggml_matmul(x, stacked, "q4_1", i)), 0,
                          jnp.arange(3, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(Exception, match="ggml_matmul: layer must be in"):
        np.asarray(ggml_matmul(x, stacked, "q4_1", 3))


def test_bad_inputs_name_the_argument():
    rng = np.random.default_rng(SEED)
    w = _weight(rng, 32, 64, "q4_1")
    packed = pack(*_fields(w))
    with pytest.raises(ValueError, match="fmt must be one of"):
        ggml_matmul(jnp.zeros((1, 64)), packed, "q5_0")
    with pytest.raises(ValueError, match="w_packed"):
        ggml_matmul(jnp.zeros((1, 64)), packed, "q8_0")  # a Q4_1 record is 320 bytes, not 544
    with pytest.raises(ValueError, match="x"):
        ggml_matmul(jnp.zeros((1, 96)), packed, "q4_1")
    with pytest.raises(ValueError, match=r"w_packed must have shape \[\*, \*, 2, 320\]"):
        ggml_matmul(jnp.zeros((1, 64)), packed, "q4_1", 0)  # a layer of an unstacked weight
    with pytest.raises(ValueError, match="layer must be one of \\(int32\\)"):
        ggml_matmul(jnp.zeros((1, 64)), packed[None], "q4_1", 0.0)
    w48 = _weight(rng, 40, 64, "q8_0")
    with pytest.raises(ValueError, match="output rows a multiple of 16, got 40"):
        pack(*_fields(w48))


# --- the SwiGLU epilogue over w_gate | w_up's alternating panels ----------------------------

def _gate_up(rng, f, k, fmt):
    """Packed gate and up GGMLWeights [f, k] and their fusion with alternating panels."""
    from jaxserve.model.ggml_weight import pack_for_cpu
    from jaxserve.model.weight_layouts import fused_ggml_weight
    # each standing for [k, f] (in, out), as the model's projections do
    gate, up = (pack_for_cpu(dataclasses.replace(_weight(rng, f, k, fmt), logical_shape=(k, f)))
                for _ in range(2))
    fused = fused_ggml_weight([gate, up], swiglu=True)
    assert fused.interleaved == 16 and fused.out_shapes == ((f,), (f,))
    return gate, up, fused


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("f,k", [(32, 64), (16 * 37, 64)])
def test_swiglu_epilogue_is_silu_of_the_two_products(fmt, f, k):
    """ggml_matmul(..., swiglu=True) over w_gate | w_up fused with alternating panels:
    silu(gate) * up of the kernel's own gate and up products (the same integer sums; the
    SiLU's f32 rounding apart: jax.nn.silu's against the epilogue's polynomial exp), for
    every remainder of the 8-row blocks, 37 pairs of panels in runs, the split by row
    chunks (300 rows over 2 pairs) and the scratch's 224-row chunks; the fused weight's
    plain product is the two products' columns interleaved by 16, exactly."""
    from jaxserve.kernels.cpu.bf16_matmul import deinterleave_gate_up
    rng = np.random.default_rng(SEED + f + k)
    gate, up, fused = _gate_up(rng, f, k, fmt)
    for m in list(range(10)) + [37, 300]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32) * 3
        g, u = ggml_matmul(x, gate.qs, fmt), ggml_matmul(x, up.qs, fmt)
        got = np.asarray(ggml_matmul(x, fused.w.qs, fmt, swiglu=True))
        want = np.asarray(jax.nn.silu(g) * u)
        assert got.shape == (m, f) and np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-6,
                                   atol=2e-6 * max(1.0, np.abs(want).max(initial=0)))
        gi, ui = deinterleave_gate_up(ggml_matmul(x, fused.w.qs, fmt))
        np.testing.assert_array_equal(np.asarray(gi), np.asarray(g))
        np.testing.assert_array_equal(np.asarray(ui), np.asarray(u))


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_swiglu_epilogue_in_the_other_builds(build, request):
    """The x86-64-v3 (AVX2) and portable builds' epilogue (the scalar loop) over their own
    products: the native build's result up to the SiLU's rounding."""
    lib = request.getfixturevalue(f"{build}_cpu_kernels")
    rng = np.random.default_rng(SEED + 41)
    for fmt in FORMATS:
        _, _, fused = _gate_up(rng, 48, 64, fmt)
        x = jnp.asarray(rng.standard_normal((11, 64)), jnp.float32) * 3
        got = _built_call(lib, f"jaxserve_ggml_matmul_swiglu_{build}_test", x, fused.w.qs, fmt,
                          swiglu=True)
        want = np.asarray(ggml_matmul(x, fused.w.qs, fmt, swiglu=True))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_swiglu_epilogue_in_the_model_and_its_checks():
    """Matmul.swiglu runs the fused, interleaved GGML weight as one swiglu call: silu of
    `project`'s gate times its up (project splits the interleaved product back, the
    unfused weights' bits); an odd number of panels is refused by the wrapper and by the
    kernel, naming why."""
    from jaxserve.model.linear import matmul_backend
    from jaxserve.model.weight_layouts import FusedWeight, fused_ggml_weight
    rng = np.random.default_rng(SEED + 43)
    gate, up, fused = _gate_up(rng, 48, 64, "q4_1")
    mm = matmul_backend("cpu")
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
    g, u = mm.project(x, (fused, None))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(mm.dense(x, gate, 1)))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(mm.dense(x, up, 1)))
    np.testing.assert_allclose(np.asarray(mm.swiglu(x, fused, None)),
                               np.asarray(jax.nn.silu(g) * u), rtol=2e-6,
                               atol=2e-6 * np.abs(np.asarray(g)).max())
    plain = fused_ggml_weight([gate, up])
    assert isinstance(plain, FusedWeight) and plain.interleaved == 0
    with pytest.raises(ValueError, match="swiglu needs an even number of panels, got 3"):
        ggml_matmul(x[0], gate.qs, "q4_1", swiglu=True)
    call = jax.ffi.ffi_call("jaxserve_ggml_matmul", jax.ShapeDtypeStruct((5, 24), jnp.float32))
    with pytest.raises(Exception, match="swiglu needs an even number of panels"):
        np.asarray(call(x[0], gate.qs, jnp.zeros((), jnp.int32), fmt=np.int64(FMT_IDS["q4_1"]),
                        swiglu=True))
