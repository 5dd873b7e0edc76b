"""jaxserve.kernels.cpu.bf16_matmul: the packing round trip, the C++ kernel against its plain-jnp
reference (every row-block remainder, 64- and 16-column panels, a tied LM head packed from
[vocab, embed]), input checks, and the packed weights inside the model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu.bf16_matmul import (bf16_dot_speedup, bf16_matmul, bf16_matmul_reference,
                                              can_pack, deinterleave_gate_up, interleave_gate_up,
                                              pack_weight, panel_width, unpack_weight)

SEED = 20261123


@pytest.fixture(scope="module", autouse=True)
def _library(cpu_kernels_library):
    return cpu_kernels_library


def _w(rng, k, n):
    return jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)


def test_pack_round_trip_and_layout():
    rng = np.random.default_rng(SEED)
    w = _w(rng, 6, 80)  # 80 columns: 16-wide panels
    p = pack_weight(w)
    assert p.shape == (5, 3, 16, 2) and p.dtype == jnp.bfloat16 and panel_width(80) == 16
    np.testing.assert_array_equal(np.asarray(unpack_weight(p)), np.asarray(w.astype(jnp.bfloat16)))
    # element [n // P, k // 2, n % P, k % 2] = W[k, n]
    assert p[2, 1, 5, 1] == w.astype(jnp.bfloat16)[3, 37]
    wide = pack_weight(_w(rng, 4, 128))
    assert wide.shape == (2, 2, 64, 2) and panel_width(128) == 64
    np.testing.assert_array_equal(np.asarray(pack_weight(w.T, transposed=True)), np.asarray(p))
    assert not can_pack(5, 64) and not can_pack(4, 40)
    with pytest.raises(ValueError, match=r"needs an even K and N a multiple of 16, got \[4, 40\]"):
        pack_weight(jnp.zeros((4, 40)))


@pytest.mark.parametrize("k,n", [(96, 192), (64, 80), (576, 64), (32, 64 * 37)])
def test_kernel_matches_reference(k, n):
    """Row counts 0 .. 9 and 37 cover every remainder of the 8-row register blocks (1 to 6
    rows: the one-pass path); 37 panels split into runs of 2 with one left over; 300
    rows over few panels are also split into row chunks (the last one with a remainder)."""
    rng = np.random.default_rng(SEED + k + n)
    wp = pack_weight(_w(rng, k, n))
    for m in list(range(10)) + [37, 300]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        out = np.asarray(bf16_matmul(x, wp))
        ref = np.asarray(bf16_matmul_reference(x, wp))
        assert out.shape == (m, n) and np.isfinite(out).all()
        # the same f32 products; only the summation order (and FMA rounding) differs
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(ref).max(initial=0)))


@pytest.mark.parametrize("round_x", [False, True])
@pytest.mark.parametrize("k,n", [(576, 192), (96, 64 * 37)])
def test_a_row_gets_the_same_bits_in_any_batch(k, n, round_x):
    """Every path (one-pass 1-6 rows, register blocks of 8 (f32 x) or 14 (x rounded to
    bf16), remainders; AMX's blocks of 16 and 32 rows) sums each output in the same
    order, so a row's result does not depend on the rows beside it: a verify step of 1 + k
    rows gives the logits of k + 1 single-row decode steps, bit for bit (what keeps
    speculative greedy decoding token-for-token the plain greedy)."""
    rng = np.random.default_rng(SEED + k)
    wp = pack_weight(_w(rng, k, n))
    x = jnp.asarray(rng.standard_normal((40, k)), jnp.float32)
    alone = np.stack([np.asarray(bf16_matmul(x[i:i + 1], wp, round_x))[0] for i in range(40)])
    # AMX's register blocks (round_x on a CPU with AMX) are 16 and 32 rows
    for m in list(range(2, 16)) + [16, 17, 27, 28, 29, 31, 32, 33, 40]:
        np.testing.assert_array_equal(np.asarray(bf16_matmul(x[:m], wp, round_x)), alone[:m])


def test_kernel_keeps_x_in_f32():
    """Only the weights are bf16: an x that bf16 would round changes the result exactly as
    f32 arithmetic says (XLA's bf16 dot would round it away)."""
    k, n = 2, 16
    wp = pack_weight(jnp.zeros((k, n), jnp.float32).at[0, :].set(1.0).at[1, :].set(0.5))
    xs = jnp.asarray([[1.0 + 2.0 ** -12, 3.0], [-2.0 ** -20, 1.0]], jnp.float32)
    got = np.asarray(bf16_matmul(xs, wp))[:, 0]
    np.testing.assert_array_equal(got, np.asarray([1.0 + 2.0 ** -12 + 1.5, 0.5 - 2.0 ** -20], np.float32))


def test_portable_path_matches_reference(portable_cpu_kernels):
    """The loop machines without AVX-512 run, with f32 x and with x given in bf16."""
    from jaxserve.kernels.cpu.bf16_matmul import _check_operands

    jax.ffi.register_ffi_target("jaxserve_bf16_matmul_portable_test",
                                jax.ffi.pycapsule(portable_cpu_kernels.JaxserveBf16Matmul),
                                platform="cpu")
    jax.ffi.register_ffi_target("jaxserve_bf16_matmul_bf16x_portable_test",
                                jax.ffi.pycapsule(portable_cpu_kernels.JaxserveBf16MatmulBf16x),
                                platform="cpu")
    rng = np.random.default_rng(SEED)
    wp = pack_weight(_w(rng, 96, 80))
    for m in (1, 5):
        x = jnp.asarray(rng.standard_normal((m, 96)), jnp.float32)
        _check_operands("test", x, wp)
        call = jax.ffi.ffi_call("jaxserve_bf16_matmul_portable_test",
                                jax.ShapeDtypeStruct((m, 80), jnp.float32))
        for round_x in (False, True):
            ref = np.asarray(bf16_matmul_reference(x, wp, round_x=round_x))
            got = call(x, wp, jnp.zeros((), jnp.int32), round_x=round_x, swiglu=False)
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5,
                                       atol=1e-5 * np.abs(ref).max())
        # x given in bf16 (round_x's x, rounded by the caller): read without an f32 x
        got = jax.ffi.ffi_call("jaxserve_bf16_matmul_bf16x_portable_test",
                               jax.ShapeDtypeStruct((m, 80), jnp.float32))(
            x.astype(jnp.bfloat16), wp, jnp.zeros((), jnp.int32), swiglu=False)
        np.testing.assert_array_equal(np.asarray(got),
                                      np.asarray(call(x, wp, jnp.zeros((), jnp.int32),
                                                      round_x=True, swiglu=False)))
    assert bf16_dot_speedup(portable_cpu_kernels) == 0.0, "no AVX512-BF16 in the portable build"


def test_avx2_path_matches_reference_and_a_row_keeps_its_bits(avx2_cpu_kernels):
    """The build for x86-64-v3 (AVX2 and FMA, no AVX-512: Zen 1-3, Intel's client CPUs):
    4-row x 16-column register blocks, one row streamed over 64 columns and two over 16
    (fetching the next panel ahead, up to 16 rows) or 32 (beyond), every remainder of the
    4-row blocks (1 to 9 rows, 37, 300 split into row chunks),
    64- and 16-column panels (n = 80: no 64- or 32-column block fits), the reference; and a
    row's bits do not depend on the rows beside it (each column summed in one order)."""
    jax.ffi.register_ffi_target("jaxserve_bf16_matmul_avx2_test",
                                jax.ffi.pycapsule(avx2_cpu_kernels.JaxserveBf16Matmul),
                                platform="cpu")

    def call(x, wp):
        fn = jax.ffi.ffi_call("jaxserve_bf16_matmul_avx2_test",
                              jax.ShapeDtypeStruct((x.shape[0], wp.shape[0] * wp.shape[2]),
                                                   jnp.float32))
        return np.asarray(fn(x, wp, jnp.zeros((), jnp.int32), round_x=False, swiglu=False))

    rng = np.random.default_rng(SEED + 7)
    for k, n in ((96, 192), (64, 80), (576, 64)):
        wp = pack_weight(_w(rng, k, n))
        x = jnp.asarray(rng.standard_normal((300, k)), jnp.float32)
        for m in list(range(1, 10)) + [37, 300]:
            ref = np.asarray(bf16_matmul_reference(x[:m], wp))
            np.testing.assert_allclose(call(x[:m], wp), ref, rtol=1e-5,
                                       atol=1e-5 * max(1.0, np.abs(ref).max()))
        alone = np.stack([call(x[i:i + 1], wp)[0] for i in range(37)])
        for m in list(range(2, 10)) + [37]:
            np.testing.assert_array_equal(call(x[:m], wp), alone[:m], err_msg=f"{m} rows")


@pytest.mark.parametrize("k,n", [(96, 192), (576, 64), (32, 64 * 37), (40, 80)])
def test_round_x_matches_reference_with_bf16_activations(k, n):
    """round_x: x rounded to bf16 (nearest even, NaN stays NaN) and bf16 dot products:
    the reference on bf16-rounded x, at every row-block remainder (vdpbf16ps's 14-row
    blocks; AMX's 16- and 32-row blocks, 16-column panels (n = 80) and a K / 2 that is
    not a multiple of the tiles' 16 k pairs (k = 40, and 2 below); 300 rows split into row
    chunks); differs from the f32-x kernel on an x that bf16 rounds."""
    rng = np.random.default_rng(SEED + 3 * k + n)
    wp = pack_weight(_w(rng, k, n))
    for m in list(range(1, 16)) + [16, 17, 28, 32, 37, 300]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        out = np.asarray(bf16_matmul(x, wp, round_x=True))
        ref = np.asarray(bf16_matmul_reference(x, wp, round_x=True))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(ref).max()))
    for k, at in ((2, 0), (32, 0), (34, 32)):  # x rounded alone, 32 at once, in the tail after
        n = 16
        wp = pack_weight(jnp.zeros((k, n), jnp.float32).at[at, :].set(1.0).at[at + 1, :].set(0.5))
        xs = np.zeros((3, k), np.float32)
        xs[:, at:at + 2] = [[1.0 + 2.0 ** -12, 3.0], [np.nan, 1.0], [1.0 + 3 * 2.0 ** -8, 0.0]]
        got = np.asarray(bf16_matmul(jnp.asarray(xs), wp, round_x=True))[:, 0]
        # 1 + 3 * 2**-8 lies halfway between bf16 neighbours 1 + 2 and 1 + 4 (x 2**-8): ties to even
        assert got[0] == 2.5 and np.isnan(got[1]) and got[2] == 1.0 + 4 * 2.0 ** -8, (k, got)


@pytest.mark.parametrize("k,n", [(576, 576), (96, 64 * 37), (40, 80)])
def test_bf16_x_is_round_x_on_x_rounded_by_the_caller(k, n):
    """A bf16 x (the model rounds x in the op that makes it) gives round_x's bits on the
    f32 x it was rounded from, at every row count of each path: the one-pass rows, the
    8-row blocks with the next panel fetched ahead (up to 64 rows; 9 panels and 37 in
    runs of 2 leave a run over, split by rows from 32 rows on), the row-chunked prefill
    split, AMX's padded copy where the CPU has AMX; and its checks name the argument."""
    rng = np.random.default_rng(SEED + 5 * k + n)
    wp = pack_weight(_w(rng, k, n))
    for m in (0, 1, 5, 8, 9, 16, 31, 32, 33, 40, 64, 65, 300):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        np.testing.assert_array_equal(np.asarray(bf16_matmul(x.astype(jnp.bfloat16), wp)),
                                      np.asarray(bf16_matmul(x, wp, round_x=True)),
                                      err_msg=f"{m} rows")
    with pytest.raises(ValueError, match="not with f32 panels"):
        bf16_matmul(jnp.zeros((2, k), jnp.bfloat16), pack_weight(_w(rng, k, n), dtype=jnp.float32))


def test_bf16_dot_speedup_is_measured(cpu_kernels_library):
    """The probe select_kernels uses: a positive ratio with AVX512-BF16, 0 without; on a
    CPU with AMX-BF16 the ratio of the AMX tiles round_x then runs (6.9-11x the f32 FMA
    rate measured; vdpbf16ps alone never reached 2.5x on the CPUs seen: PERFORMANCE.md)."""
    import re
    speedup = bf16_dot_speedup(cpu_kernels_library)
    flags = open("/proc/cpuinfo").read()
    has_bf16 = re.search(r"\bavx512_bf16\b", flags) is not None
    assert (speedup > 0.1) if has_bf16 else speedup == 0.0
    if has_bf16 and re.search(r"\bamx_bf16\b", flags) and re.search(r"\bamx_tile\b", flags):
        assert speedup > 3.0, f"AMX-BF16 CPU but round_x measured {speedup:.2f}x: tiles unused?"


@pytest.mark.parametrize("x,w,match", [
    (jnp.zeros((2, 64), jnp.float16), jnp.zeros((1, 32, 16, 2), jnp.bfloat16), r"x must be one of \(float32, bfloat16\)"),
    (jnp.zeros((2, 64), jnp.float32), jnp.zeros((1, 16, 16, 2), jnp.bfloat16), r"w_packed must have shape \[\*, 32, \*, 2\]"),
    (jnp.zeros((2, 64), jnp.float32), jnp.zeros((1, 32, 16, 2), jnp.float16), r"w_packed must be one of \(bfloat16, float32\)"),
    (jnp.zeros((2, 64), jnp.float32), jnp.zeros((1, 32, 8, 2), jnp.bfloat16), "panel width must be a multiple of 16, got 8"),
])
def test_bad_inputs_name_the_argument(x, w, match):
    with pytest.raises(ValueError, match=match):
        bf16_matmul(x, w)


def test_a_stacked_weight_is_read_at_its_layer():
    """A stack of packed weights [L, ...] (a layer loop's) at `layer`, given as an int and
    traced inside lax.scan, with and without round_x: each layer's product is the
    unstacked call's exactly; a layer outside the stack fails the call, naming it; a
    layer of an unstacked weight is refused, naming the argument."""
    rng = np.random.default_rng(SEED + 5)
    ws = [pack_weight(_w(rng, 96, 80)) for _ in range(3)]
    stacked = jnp.stack(ws)
    x = jnp.asarray(rng.standard_normal((9, 96)), jnp.float32)
    for round_x in (False, True):
        want = np.stack([np.asarray(bf16_matmul(x, w, round_x)) for w in ws])
        assert np.abs(want[0] - want[1]).max() > 0.1  # the layers differ
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(bf16_matmul(x, stacked, round_x, i)), want[i])
        _, got = jax.lax.scan(lambda c, i: (c, bf16_matmul(x, stacked, round_x, i)), 0,
                              jnp.arange(3, dtype=jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(Exception, match="bf16_matmul: layer must be in"):
        np.asarray(bf16_matmul(x, stacked, False, -1))
    with pytest.raises(ValueError, match=r"w_packed must have shape \[\*, \*, 48, \*, 2\]"):
        bf16_matmul(x, ws[0], False, 0)


def test_packed_weights_in_the_model_match_bf16_rounded_f32_weights():
    """dual_precision_params(packed=True) through the model: the logits of the f32 model
    whose weights are rounded to bf16 (x, products and sums f32), up to summation order, on
    prefill and decode, with the LM head tied (packed from [vocab, embed])."""
    from jaxserve.model.params import init_params
    from jaxserve.model.params import PROJECTIONS
    from jaxserve.model.weight_layouts import (DualPrecisionWeight, FusedWeight,
                                               dual_precision, dual_precision_params)
    from jaxserve.model.transformer import Kernels
    from model_utils import PagedDriver, tiny_config

    cfg = tiny_config(hidden_size=64, intermediate_size=96, num_heads=6, num_kv_heads=2,
                      head_dim=32, vocab_size=256, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(3), scale=0.3)
    assert params.lm_head is None, "the test wants a tied head"
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
                           if a.ndim >= 2 else a, params)
    # the embedding lookup stays f32; the tied head is the bf16-rounded embedding, [D, vocab]
    rounded = dataclasses.replace(rounded, embed=params.embed, lm_head=rounded.embed.T)
    packed = dual_precision_params(params, 1, packed=True)
    head = packed.lm_head
    assert isinstance(head, DualPrecisionWeight) and head.packed and head.vocab_major
    assert head.shape == (cfg.vocab_size, cfg.hidden_size) and head.w_copy.ndim == 4
    assert packed.layers[0].wo.shape == params.layers[0].wo.shape  # [heads, head_dim, embed]
    lp = packed.layers[0]  # projections sharing an input are fused
    assert isinstance(lp.wq, FusedWeight) and isinstance(lp.w_gate, FusedWeight)
    assert lp.wk is lp.wv is lp.w_up is None and lp.wq.w.packed and lp.w_gate.w.packed
    assert lp.wq.shape == (cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    assert lp.w_gate.shape == (cfg.hidden_size, 2 * cfg.intermediate_size)
    # the same packed weights, one kernel call per projection
    unfused = dataclasses.replace(packed, layers=tuple(
        dataclasses.replace(p, **{name: dual_precision(getattr(p, name), 1, packed=True, n_in=n_in)
                                  for name, n_in in PROJECTIONS.items()})
        for p in params.layers))
    ids = np.random.default_rng(SEED).integers(0, cfg.vocab_size, 12).tolist()
    out = {}
    for name, p in (("plain", rounded), ("packed", packed), ("unfused", unfused)):
        drv = PagedDriver(p, cfg, page_size=4, kernels=Kernels("xla", "xla"), layout="head_major")
        out[name] = [drv.step({"s": ids[:9]}, T=16, P=4)["s"], drv.step({"s": ids[9:10]}, T=1, P=4)["s"]]
    for got, want in zip(out["packed"], out["plain"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for got, want in zip(out["packed"], out["unfused"]):  # fusing changes no output column
        np.testing.assert_array_equal(got, want)


# --- f32 panels: a float32 model's own weights (KernelConfig.matmul_impl "cpu") ----------

def test_f32_panels_round_trip_and_layout():
    """pack_weight's float32 layout: element [n // P, k // 2, k % 2, n % P] = W[k, n],
    exactly (no rounding), from [K, N] or a transposed [N, K]."""
    rng = np.random.default_rng(SEED + 11)
    w = _w(rng, 6, 80)
    p = pack_weight(w, dtype=jnp.float32)
    assert p.shape == (5, 3, 2, 16) and p.dtype == jnp.float32
    assert p[2, 1, 1, 5] == w[3, 37]
    np.testing.assert_array_equal(np.asarray(unpack_weight(p)), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(pack_weight(w.T, True, dtype=jnp.float32)),
                                  np.asarray(p))
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32, got float16"):
        pack_weight(w, dtype=jnp.float16)


def _f32_panels_call(library, target):
    """The library's f32-panel handler registered as `target`, called like bf16_matmul."""
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.JaxserveF32Matmul),
                                platform="cpu")

    def call(x, wp):
        fn = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], wp.shape[0] * wp.shape[3]),
                                                           jnp.float32))
        return np.asarray(fn(x, wp, jnp.zeros((), jnp.int32), swiglu=False))
    return call


@pytest.mark.parametrize("build", ["native", "avx2", "portable"])
def test_f32_panels_match_reference_and_a_row_keeps_its_bits(build, request):
    """f32 panels in the native build (1 row streamed over 64 columns by the AVX2 blocks
    wherever the CPU has AVX2, 2 over 16 or 32; more in 6-row blocks, 6 x 64 of zmm on an
    AVX-512 CPU, else 6 x 16 of ymm, with every remainder, up to 16 rows fetching the next
    panel ahead; 300 rows over few panels split into row chunks), the x86-64-v3 build (an
    AVX2-only machine's) and the portable loop: the f32 dot at
    HIGHEST precision up to summation order, on 64- and 16-column panels; and a row's bits
    do not depend on the rows beside it (the tests' engine relies on it: the same greedy
    tokens in any batch)."""
    if build == "native":
        call = lambda x, wp: np.asarray(bf16_matmul(x, wp))  # noqa: E731
    else:
        call = _f32_panels_call(request.getfixturevalue(f"{build}_cpu_kernels"),
                                f"jaxserve_f32_matmul_{build}_test")
    rng = np.random.default_rng(SEED + 13)
    for k, n in ((96, 192), (64, 80), (576, 64), (32, 64 * 37)):
        wp = pack_weight(_w(rng, k, n), dtype=jnp.float32)
        x = jnp.asarray(rng.standard_normal((300, k)), jnp.float32)
        for m in list(range(0, 14)) + [37, 300]:
            got = call(x[:m], wp)
            ref = np.asarray(bf16_matmul_reference(x[:m], wp))
            assert got.shape == (m, n)
            np.testing.assert_allclose(got, ref, rtol=1e-5,
                                       atol=1e-5 * max(1.0, np.abs(ref).max(initial=0)))
        alone = np.stack([call(x[i:i + 1], wp)[0] for i in range(37)])
        for m in list(range(2, 14)) + [37]:
            np.testing.assert_array_equal(call(x[:m], wp), alone[:m], err_msg=f"{m} rows")


def test_f32_panels_stacked_and_bad_inputs():
    """A stack of f32 panels is read at its layer (in lax.scan too); round_x, an f32 weight
    in the bf16 layout and a panel width not a multiple of 16 are refused, naming why."""
    rng = np.random.default_rng(SEED + 17)
    ws = [pack_weight(_w(rng, 96, 80), dtype=jnp.float32) for _ in range(3)]
    stacked = jnp.stack(ws)
    x = jnp.asarray(rng.standard_normal((9, 96)), jnp.float32)
    want = np.stack([np.asarray(bf16_matmul(x, w)) for w in ws])
    assert np.abs(want[0] - want[1]).max() > 0.1
    _, got = jax.lax.scan(lambda c, i: (c, bf16_matmul(x, stacked, False, i)), 0,
                          jnp.arange(3, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(Exception, match="f32_matmul: layer must be in"):
        np.asarray(bf16_matmul(x, stacked, False, 3))
    with pytest.raises(ValueError, match="round_x rounds x for the bf16 dot: not with f32 panels"):
        bf16_matmul(x, ws[0], round_x=True)
    with pytest.raises(ValueError, match=r"w_packed must have shape \[\*, 48, 2, \*\]"):
        bf16_matmul(x, jnp.zeros((5, 48, 16, 2), jnp.float32))
    with pytest.raises(ValueError, match="panel width must be a multiple of 16, got 8"):
        bf16_matmul(x, jnp.zeros((10, 48, 2, 8), jnp.float32))


def test_f32_panels_in_the_model_give_the_f32_logits():
    """dual_precision_params(copy_dtype=float32) through the model: the plain f32 model's
    logits up to summation order (prefill and decode, a tied head packed from [vocab,
    embed], projections fused); unfused panels give the fused ones' bits."""
    from jaxserve.model.params import init_params
    from jaxserve.model.params import PROJECTIONS
    from jaxserve.model.weight_layouts import (DualPrecisionWeight, FusedWeight,
                                               dual_precision, dual_precision_params)
    from jaxserve.model.transformer import Kernels
    from model_utils import PagedDriver, tiny_config

    cfg = tiny_config(hidden_size=64, intermediate_size=96, num_heads=6, num_kv_heads=2,
                      head_dim=32, vocab_size=256, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(4), scale=0.3)
    packed = dual_precision_params(params, 1, packed=True, copy_dtype=jnp.float32)
    head, lp = packed.lm_head, packed.layers[0]
    assert isinstance(head, DualPrecisionWeight) and head.packed and head.w is None
    assert head.w_copy.dtype == jnp.float32 and head.w_copy.shape == (4, 32, 2, 64)
    assert isinstance(lp.wq, FusedWeight) and lp.wq.w.w_copy.dtype == jnp.float32
    unfused = dataclasses.replace(packed, layers=tuple(
        dataclasses.replace(p, **{name: dual_precision(getattr(p, name), 1, packed=True, n_in=n_in,
                                                       copy_dtype=jnp.float32)
                                  for name, n_in in PROJECTIONS.items()})
        for p in params.layers))
    ids = np.random.default_rng(SEED).integers(0, cfg.vocab_size, 12).tolist()
    out = {}
    for name, p in (("plain", params), ("packed", packed), ("unfused", unfused)):
        drv = PagedDriver(p, cfg, page_size=4, kernels=Kernels("xla", "xla"), layout="head_major")
        out[name] = [drv.step({"s": ids[:9]}, T=16, P=4)["s"], drv.step({"s": ids[9:10]}, T=1, P=4)["s"]]
    for got, want in zip(out["packed"], out["plain"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for got, want in zip(out["packed"], out["unfused"]):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="f32 panels .* needs packed, min_rows 1"):
        dual_precision(params.layers[0].wo, 2, packed=True, n_in=2, copy_dtype=jnp.float32)


# --- the SwiGLU epilogue: silu(gate) * up of an interleaved w_gate | w_up -------------------

def _gate_up(rng, k, f, gate_scale=3.0):
    """An interleaved gate | up [k, 2 f] (gate's columns scaled so that the SiLU's both
    tails are reached) and the plain one."""
    gate = _w(rng, k, f) * gate_scale
    plain = jnp.concatenate([gate, _w(rng, k, f)], axis=1)
    return interleave_gate_up(plain), plain


def test_interleave_gate_up_layout_and_round_trip():
    """Column 32 j + i is gate's 16 j + i, 32 j + 16 + i up's, per shard; de-interleaving
    the product's columns gives gate's and up's products; F not a multiple of 16 (per
    shard) is refused, naming the shapes."""
    w = jnp.arange(2 * 64, dtype=jnp.float32)[None, :] * jnp.ones((2, 1))  # gate 0..63, up 64..127
    inter = np.asarray(interleave_gate_up(w))
    assert inter[0, :16].tolist() == list(range(16))
    assert inter[0, 16:32].tolist() == list(range(64, 80))
    assert inter[0, 32:48].tolist() == list(range(16, 32))
    gate, up = deinterleave_gate_up(jnp.asarray(inter))
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(w[:, :64]))
    np.testing.assert_array_equal(np.asarray(up), np.asarray(w[:, 64:]))
    two = np.asarray(interleave_gate_up(w, shards=2))  # shard s: gate | up of 32 columns each
    np.testing.assert_array_equal(two[:, :64], np.asarray(interleave_gate_up(w[:, :64])))
    np.testing.assert_array_equal(two[:, 64:], np.asarray(interleave_gate_up(w[:, 64:])))
    with pytest.raises(ValueError, match=r"F a multiple of 16, got \[2, 80\]"):
        interleave_gate_up(jnp.zeros((2, 80)))
    with pytest.raises(ValueError, match=r"\[K, 2 x 2 F\] with F a multiple of 16"):
        interleave_gate_up(jnp.zeros((2, 96)), shards=2)


@pytest.mark.parametrize("k,f", [(96, 96), (576, 256), (32, 32 * 37)])
def test_swiglu_epilogue_matches_silu_of_the_product(k, f):
    """bf16_matmul(..., swiglu=True) over an interleaved gate | up, every path (bf16
    panels with f32 x, round_x and bf16 x; f32 panels), every row-block remainder and the
    scratch's 224-row chunks (225, 300; 37 panels in runs): silu(gate) * up of the
    reference product (HIGHEST), up to summation order, and of the kernel's own unfused
    product up to the SiLU's rounding; a gate of +-100s (exp's clamp) stays finite and
    right; an f32-panel row gets the same bits in any batch."""
    rng = np.random.default_rng(SEED + k + f)
    inter, _ = _gate_up(rng, k, f)
    rows = list(range(16)) + [37, 64, 65, 224, 225, 300]
    for dtype, modes in ((jnp.bfloat16, ("f32", "round_x", "bf16")), (jnp.float32, ("f32",))):
        wp = pack_weight(inter, dtype=dtype)
        x_all = jnp.asarray(rng.standard_normal((300, k)), jnp.float32)
        for mode in modes:
            for m in rows:
                x = x_all[:m].astype(jnp.bfloat16) if mode == "bf16" else x_all[:m]
                round_x = mode == "round_x"
                got = np.asarray(bf16_matmul(x, wp, round_x, swiglu=True))
                assert got.shape == (m, f) and np.isfinite(got).all()
                scale = max(1.0, np.abs(got).max(initial=0))
                ref = np.asarray(bf16_matmul_reference(x, wp, round_x, swiglu=True))
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{dtype.__name__} {mode} {m} rows")
                gate, up = deinterleave_gate_up(bf16_matmul(x, wp, round_x))
                np.testing.assert_allclose(got, np.asarray(jax.nn.silu(gate) * up), rtol=2e-6,
                                           atol=2e-6 * scale)
                if dtype == jnp.bfloat16:  # rounded in the epilogue: the f32 result's bf16
                    np.testing.assert_array_equal(
                        np.asarray(bf16_matmul(x, wp, round_x, swiglu=True,
                                               out_dtype=jnp.bfloat16)).astype(np.float32),
                        np.asarray(jnp.asarray(got).astype(jnp.bfloat16)).astype(np.float32))
        if dtype == jnp.float32:
            alone = np.stack([np.asarray(bf16_matmul(x_all[i:i + 1], wp, swiglu=True))[0]
                              for i in range(20)])
            for m in (2, 7, 14, 20):
                np.testing.assert_array_equal(np.asarray(bf16_matmul(x_all[:m], wp, swiglu=True)),
                                              alone[:m], err_msg=f"{m} rows")
    big = pack_weight(_gate_up(rng, k, f, gate_scale=300.0)[0])
    x = jnp.asarray(rng.standard_normal((20, k)), jnp.float32)
    got = np.asarray(bf16_matmul(x, big, swiglu=True))
    ref = np.asarray(bf16_matmul_reference(x, big, swiglu=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_swiglu_epilogue_in_the_other_builds(build, request):
    """The x86-64-v3 (AVX2) and portable builds' epilogue (a scalar loop over the same
    exp): bf16 panels (f32 x and round_x) and f32 panels, against the reference."""
    lib = request.getfixturevalue(f"{build}_cpu_kernels")
    targets = {}
    for name, handler in (("bf16", "JaxserveBf16Matmul"), ("f32", "JaxserveF32Matmul")):
        targets[name] = f"jaxserve_{name}_matmul_swiglu_{build}_test"
        jax.ffi.register_ffi_target(targets[name], jax.ffi.pycapsule(getattr(lib, handler)),
                                    platform="cpu")
    rng = np.random.default_rng(SEED + 23)
    inter, _ = _gate_up(rng, 96, 96)
    for m in (1, 2, 5, 9, 37):
        x = jnp.asarray(rng.standard_normal((m, 96)), jnp.float32)
        out = jax.ShapeDtypeStruct((m, 96), jnp.float32)
        layer = jnp.zeros((), jnp.int32)
        wp = pack_weight(inter)
        for round_x in (False, True):
            got = jax.ffi.ffi_call(targets["bf16"], out)(x, wp, layer, round_x=round_x, swiglu=True)
            ref = np.asarray(bf16_matmul_reference(x, wp, round_x, swiglu=True))
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            rounded = jax.ffi.ffi_call(targets["bf16"], out.update(dtype=jnp.bfloat16))(
                x, wp, layer, round_x=round_x, swiglu=True)
            np.testing.assert_array_equal(np.asarray(rounded).astype(np.float32),
                                          np.asarray(got.astype(jnp.bfloat16)).astype(np.float32))
        wf = pack_weight(inter, dtype=jnp.float32)
        got = jax.ffi.ffi_call(targets["f32"], out)(x, wf, layer, swiglu=True)
        ref = np.asarray(bf16_matmul_reference(x, wf, swiglu=True))
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_swiglu_epilogue_refuses_narrow_panels_and_a_wrong_output():
    """16-column panels cannot hold a gate and up group side by side: refused by the
    wrapper and by the kernel itself, as is an output of the wrong width."""
    rng = np.random.default_rng(SEED + 29)
    inter, _ = _gate_up(rng, 32, 48)  # N = 96: 32-column groups, but packed in 16-column panels
    wp = pack_weight(inter, panel=16)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    with pytest.raises(ValueError, match="swiglu needs panels of a multiple of 32 columns, got 16"):
        bf16_matmul(x, wp, swiglu=True)
    call = jax.ffi.ffi_call("jaxserve_bf16_matmul", jax.ShapeDtypeStruct((4, 48), jnp.float32))
    with pytest.raises(Exception, match="swiglu needs panels of a multiple of 32"):
        np.asarray(call(x, wp, jnp.zeros((), jnp.int32), round_x=False, swiglu=True))
    wide = pack_weight(inter, panel=32)
    call = jax.ffi.ffi_call("jaxserve_bf16_matmul", jax.ShapeDtypeStruct((4, 96), jnp.float32))
    with pytest.raises(Exception, match=r"out must be \[M, N / 2\]"):
        np.asarray(call(x, wide, jnp.zeros((), jnp.int32), round_x=False, swiglu=True))
    with pytest.raises(ValueError, match="out_dtype must be float32 .or bfloat16 with swiglu."):
        bf16_matmul(x, wide, out_dtype=jnp.bfloat16)
    call = jax.ffi.ffi_call("jaxserve_bf16_matmul", jax.ShapeDtypeStruct((4, 96), jnp.bfloat16))
    with pytest.raises(Exception, match=r"out must be f32 \(or bf16 with swiglu\)"):
        np.asarray(call(x, wide, jnp.zeros((), jnp.int32), round_x=False, swiglu=False))


def test_swiglu_epilogue_in_the_model():
    """dual_precision_params(swiglu=True): w_gate | w_up interleaved (FusedWeight.interleaved)
    and run as the kernel's epilogue (Matmul.swiglu) give the plain layout's logits up to the
    SiLU's rounding, with bf16 copies (the activation rounded to bf16 in the epilogue when
    the down matmul rounds its x: round_x) and f32 panels, prefill and decode; `project` splits
    an interleaved weight back into gate and up (bf16 copies used from 4 rows, XLA's f32 dot
    below), as LoRA's path needs."""
    from jaxserve.model.linear import matmul_backend
    from jaxserve.model.params import init_params
    from jaxserve.model.transformer import Kernels
    from jaxserve.model.weight_layouts import FusedWeight, dual_precision_params
    from model_utils import PagedDriver, tiny_config

    cfg = tiny_config(hidden_size=64, intermediate_size=96, num_heads=6, num_kv_heads=2,
                      head_dim=32, vocab_size=256)
    params = init_params(cfg, jax.random.key(5), scale=0.3)
    ids = np.random.default_rng(SEED).integers(0, cfg.vocab_size, 12).tolist()
    for kw in ({}, {"copy_dtype": jnp.float32}, {"round_x_min_rows": 1}):
        out = {}
        for swiglu in (False, True):
            p = dual_precision_params(params, 1, packed=True, swiglu=swiglu, **kw)
            assert p.layers[0].w_gate.interleaved == (16 if swiglu else 0)
            drv = PagedDriver(p, cfg, page_size=4, kernels=Kernels("xla", "xla"),
                              layout="head_major")
            out[swiglu] = [drv.step({"s": ids[:9]}, T=16, P=4)["s"],
                           drv.step({"s": ids[9:10]}, T=1, P=4)["s"]]
        # round_x: the activation rounded to bf16 in the epilogue (the down matmul's x), where
        # the plain layout rounds XLA's SiLU of the same sums: a rare last-bit difference
        # of the SiLU can move a bf16 rounding by one bf16 ulp (2^-8 relative)
        tol = 2e-3 if "round_x_min_rows" in kw else 1e-5
        for got, want in zip(out[True], out[False]):
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    x = jnp.asarray(np.random.default_rng(SEED + 1).standard_normal((3, 7, 64)), jnp.float32)
    mm = matmul_backend("cpu")
    plain = dual_precision_params(params, 4, packed=True).layers[0].w_gate
    inter = dual_precision_params(params, 4, packed=True, swiglu=True).layers[0].w_gate
    assert isinstance(inter, FusedWeight) and inter.interleaved == 16
    for rows in (x[:1, :3], x):  # 3 rows: the f32 weight in XLA's dot; 21: the packed copy
        for a, b in zip(mm.project(rows, (inter, None)), mm.project(rows, (plain, None))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        gate, up = mm.project(rows, (plain, None))
        np.testing.assert_allclose(np.asarray(mm.swiglu(rows, inter, None)),
                                   np.asarray(jax.nn.silu(gate) * up), rtol=2e-6, atol=1e-6)
