"""jaxserve.kernels.cpu.lora_matmul: each row times its own LoRA slot's matrix, the C++
kernel against its plain-jnp reference (and float64 numpy): f32 and bf16 pools, a stacked
pool read at a layer, rows of slot 0 and of slots outside the pool (zeros), row counts and
widths off the kernel's 8-row / 16-column blocks, its portable build, input checks; and
the engine's CPU matmul backend giving the batched jnp form's deltas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu.lora_matmul import lora_matmul, lora_matmul_reference

SEED = 20261126


@pytest.fixture(scope="module", autouse=True)
def _library(cpu_kernels_library):
    return cpu_kernels_library


def _case(T, S, K, N, dtype, layers=None, seed=0):
    rng = np.random.default_rng(SEED + seed)
    v = rng.standard_normal((T, K)).astype(np.float32)
    shape = (S, K, N) if layers is None else (layers, S, K, N)
    m = np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))
    slot = rng.integers(-1, S + 1, T).astype(np.int32)  # includes 0, -1 and S: zeros
    return v, m, slot


def _want(v, m, slot):
    """float64 numpy: row t = v[t] @ m[slot[t]], zeros for slot 0 and slots outside."""
    S = m.shape[0]
    out = np.zeros((v.shape[0], m.shape[2]))
    for t, s in enumerate(slot):
        if 0 < s < S:
            out[t] = v[t].astype(np.float64) @ m[s].astype(np.float64)
    return out


@pytest.mark.parametrize("T,S,K,N", [(32, 5, 576, 16), (32, 5, 16, 576), (7, 3, 40, 37),
                                     (1, 2, 1536, 8), (100, 9, 24, 200), (0, 3, 8, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matches_reference(T, S, K, N, dtype):
    v, m, slot = _case(T, S, K, N, dtype, seed=T + K)
    got = np.asarray(lora_matmul(jnp.asarray(v), jnp.asarray(m, dtype), jnp.asarray(slot)))
    want = _want(v, m, slot)
    # f32 sums of K products in another order: rounding errors of random sign grow as
    # sqrt(K) u |v| |m|; 2 K eps |v|max |m|max is well above that (the worst case, K^2 u,
    # needs every error to have one sign)
    bound = 2 * K * np.finfo(np.float32).eps * np.abs(v).max(initial=0) * np.abs(m).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    ref = np.asarray(lora_matmul_reference(jnp.asarray(v), jnp.asarray(m, dtype), jnp.asarray(slot)))
    np.testing.assert_allclose(ref, want, rtol=0, atol=bound)
    zero = (slot <= 0) | (slot >= S)
    assert (got[zero] == 0).all()


def test_stacked_pool_is_read_at_the_layer():
    """A stack [L, S, K, N] at layer 2 (traced, under jit) gives layer 2's pool's product;
    a layer outside the stack fails the call."""
    v, m, slot = _case(12, 4, 48, 20, jnp.float32, layers=3, seed=5)
    call = jax.jit(lambda v, m, s, layer: lora_matmul(v, m, s, layer))
    got = np.asarray(call(jnp.asarray(v), jnp.asarray(m), jnp.asarray(slot), jnp.int32(2)))
    bound = 2 * 48 * np.finfo(np.float32).eps * np.abs(v).max() * np.abs(m).max()
    np.testing.assert_allclose(got, _want(v, m[2], slot), rtol=0, atol=bound)
    with pytest.raises(Exception, match="layer must be in"):
        np.asarray(call(jnp.asarray(v), jnp.asarray(m), jnp.asarray(slot), jnp.int32(3)))


def test_portable_path_matches_reference(portable_cpu_kernels):
    """The loop machines without AVX-512 run."""
    jax.ffi.register_ffi_target("jaxserve_lora_matmul_portable_test",
                                jax.ffi.pycapsule(portable_cpu_kernels.JaxserveLoraMatmul),
                                platform="cpu")
    for dtype in (jnp.float32, jnp.bfloat16):
        v, m, slot = _case(19, 4, 33, 45, dtype, seed=9)
        call = jax.ffi.ffi_call("jaxserve_lora_matmul_portable_test",
                                jax.ShapeDtypeStruct((19, 45), jnp.float32))
        got = np.asarray(call(jnp.asarray(v), jnp.asarray(m, dtype), jnp.asarray(slot),
                              jnp.zeros((), jnp.int32)))
        bound = 2 * 33 * np.finfo(np.float32).eps * np.abs(v).max() * np.abs(m).max()
        np.testing.assert_allclose(got, _want(v, m, slot), rtol=0, atol=bound)


@pytest.mark.parametrize("args,match", [
    ((jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((3, 8, 4)), jnp.zeros(2, jnp.int32)),
     r"v must be one of \(float32\)"),
    ((jnp.zeros((2, 8)), jnp.zeros((3, 9, 4)), jnp.zeros(2, jnp.int32)), r"m must have shape"),
    ((jnp.zeros((2, 8)), jnp.zeros((3, 8, 4), jnp.int8), jnp.zeros(2, jnp.int32)),
     r"m must be one of"),
    ((jnp.zeros((2, 8)), jnp.zeros((3, 8, 4)), jnp.zeros(3, jnp.int32)), r"slot must have shape"),
])
def test_bad_inputs_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        lora_matmul(*args)


def test_cpu_backend_gives_the_batched_deltas():
    """CpuMatmul.lora_delta (shrink then expand in the kernel, each row its own slot; a
    layer loop's stacked pools at a layer) equals jaxserve.lora.batched.lora_delta (every
    slot, the row's kept) within f32 summation order."""
    import dataclasses
    from jaxserve.lora.batched import empty_slots, lora_delta, put_adapter
    from jaxserve.model.linear import matmul_backend
    rng = np.random.default_rng(SEED)
    pools = empty_slots(4, 64, 96, 8)
    for s, r in ((1, 8), (2, 3), (3, 5)):
        pools = put_adapter(pools, s, jnp.asarray(rng.standard_normal((64, r)), jnp.float32),
                            jnp.asarray(rng.standard_normal((r, 96)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((21, 64)), jnp.float32)
    slot = jnp.asarray(rng.integers(0, 4, 21), jnp.int32)
    want = np.asarray(lora_delta(x, pools, slot))
    got = np.asarray(matmul_backend("cpu").lora_delta(x, pools, slot))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    stacked = dataclasses.replace(pools, a=jnp.stack([pools.a * 0, pools.a]),
                                  b=jnp.stack([pools.b * 0, pools.b]), layer=jnp.int32(1))
    got = np.asarray(jax.jit(matmul_backend("cpu").lora_delta)(x, stacked, slot))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lora_delta(x, stacked, slot)), want, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("T,S,K,R,N", [(32, 5, 576, 16, 192), (5, 3, 40, 4, 37),
                                       (17, 4, 64, 9, 300), (1, 2, 24, 512, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_delta_is_the_shrink_then_the_expand(T, S, K, R, N, dtype):
    """lora_delta (one call) equals lora_matmul's shrink then expand and float64 numpy's
    (x A) B within f32 summation order; stacked pools read at a layer."""
    from jaxserve.kernels.cpu.lora_matmul import lora_delta
    x, a, slot = _case(T, S, K, R, dtype, layers=2, seed=R)
    _, b, _ = _case(T, S, R, N, dtype, layers=2, seed=R + 1)
    args = (jnp.asarray(x), jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(slot))
    got = np.asarray(lora_delta(*args, jnp.int32(1)))
    xa = _want(x, a[1], slot)
    want = np.stack([xa[t] @ b[1][s].astype(np.float64) if 0 < s < S else np.zeros(N)
                     for t, s in enumerate(slot)])
    two = np.asarray(lora_matmul(lora_matmul(args[0], args[1], args[3], jnp.int32(1)), args[2],
                                 args[3], jnp.int32(1)))
    # two f32 sums in another order (K, then R terms): (K + R) eps |y|max, as above
    bound = (K + R) * np.finfo(np.float32).eps * np.abs(want).max(initial=1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    np.testing.assert_allclose(got, two, rtol=0, atol=bound)
    assert (got[(slot <= 0) | (slot >= S)] == 0).all()


def test_delta_portable_path_and_limits(portable_cpu_kernels):
    """The loop machines without AVX-512 run; a rank over MAX_RANK and pools of two dtypes
    are refused naming the argument."""
    from jaxserve.kernels.cpu.lora_matmul import MAX_RANK, lora_delta
    jax.ffi.register_ffi_target("jaxserve_lora_delta_portable_test",
                                jax.ffi.pycapsule(portable_cpu_kernels.JaxserveLoraDelta),
                                platform="cpu")
    x, a, slot = _case(11, 3, 20, 6, jnp.float32, seed=30)
    _, b, _ = _case(11, 3, 6, 50, jnp.float32, seed=31)
    call = jax.ffi.ffi_call("jaxserve_lora_delta_portable_test",
                            jax.ShapeDtypeStruct((11, 50), jnp.float32))
    got = np.asarray(call(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(slot),
                          jnp.zeros((), jnp.int32)))
    want = np.asarray(lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b),
                                 jnp.asarray(slot)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match=f"rank must be at most {MAX_RANK}"):
        lora_delta(jnp.zeros((2, 8)), jnp.zeros((2, 8, MAX_RANK + 1)),
                   jnp.zeros((2, MAX_RANK + 1, 4)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="b must be one of"):
        lora_delta(jnp.zeros((2, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((2, 4, 4), jnp.bfloat16),
                   jnp.zeros(2, jnp.int32))
