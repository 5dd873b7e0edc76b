"""jaxserve.kernels.cpu.argmax_logsumexp: the C++ kernel against its plain-jnp reference (ties, a
vocabulary that is not a multiple of the vector width, extreme values, NaN and -inf rows),
its portable build, input checks, and the sampler on both implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.cpu.argmax_logsumexp import argmax_logsumexp, argmax_logsumexp_reference
from jaxserve.sample import sampler as sampling
from jaxserve.sample.sampler import SamplingBatch

SEED = 20261124


@pytest.fixture(scope="module", autouse=True)
def _library(cpu_kernels_library):
    return cpu_kernels_library


def _check(got, logits):
    idx, lse = got
    want_idx, want_lse = argmax_logsumexp_reference(logits)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("B,V", [(1, 49152), (5, 1000), (3, 17), (2, 1), (4, 33)])
def test_matches_reference(B, V):
    rng = np.random.default_rng(SEED + V)
    logits = jnp.asarray(rng.standard_normal((B, V)) * 8, jnp.float32)
    _check(argmax_logsumexp(logits), logits)
    _check(jax.jit(sampling.argmax_logsumexp)(logits), logits)


def test_ties_extremes_nan_and_all_neg_inf_rows():
    V = 40  # two full vectors and a masked tail
    x = np.zeros((6, V), np.float32)
    x[0, [3, 20, 39]] = 5.0                  # ties across lanes and the tail: the first wins
    x[1, [17, 33]] = 7.0                     # the same lane in two vectors
    x[2] = -1e30                             # huge negative logits
    x[2, 38] = 80.0                          # exp would overflow without the max shift
    x[3, :] = -np.inf
    x[3, 7] = 0.0                            # masked-out tokens contribute exactly 0
    x[4, 5] = np.nan
    x[5, :] = -np.inf
    logits = jnp.asarray(x)
    idx, lse = (np.asarray(a) for a in argmax_logsumexp(logits))
    assert idx.tolist()[:4] == [3, 17, 38, 7]
    np.testing.assert_allclose(lse[:4], np.asarray(jax.nn.logsumexp(logits[:4], axis=-1)), rtol=1e-6)
    assert lse[3] == 0.0
    assert idx[4] == 0 and np.isnan(lse[4])
    assert idx[5] == 0 and lse[5] == -np.inf
    # the XLA path gives the same indices for every row (argmax_last's NaN rule)
    xla_idx, _ = jax.jit(sampling.argmax_logsumexp)(logits)
    assert np.asarray(xla_idx).tolist() == idx.tolist()


def test_portable_path_matches_reference(portable_cpu_kernels):
    """The loop machines without AVX-512 run."""
    jax.ffi.register_ffi_target("jaxserve_argmax_logsumexp_portable_test",
                                jax.ffi.pycapsule(portable_cpu_kernels.JaxserveArgmaxLogsumexp),
                                platform="cpu")
    rng = np.random.default_rng(SEED)
    logits = jnp.asarray(rng.standard_normal((3, 1001)) * 8, jnp.float32)
    call = jax.ffi.ffi_call("jaxserve_argmax_logsumexp_portable_test",
                            (jax.ShapeDtypeStruct((3,), jnp.int32),
                             jax.ShapeDtypeStruct((3,), jnp.float32)))
    _check(call(logits), logits)


@pytest.mark.parametrize("logits,match", [
    (jnp.zeros((2, 8), jnp.bfloat16), r"logits must be one of \(float32\)"),
    (jnp.zeros((8,), jnp.float32), r"logits must have shape \[\*, \*\]"),
    (jnp.zeros((2, 0), jnp.float32), "V >= 1"),
])
def test_bad_inputs_name_the_argument(logits, match):
    with pytest.raises(ValueError, match=match):
        argmax_logsumexp(logits)


def test_sampler_gives_the_same_tokens_and_logprobs_with_either_implementation():
    """Greedy, plain temperature and filtered rows in one batch: "cpu" and "xla" pick the
    same tokens, and the logprobs are log_softmax of the raw logits at those tokens."""
    from jaxserve.sampling_params import SamplingParams

    rng = np.random.default_rng(SEED)
    B, V = 6, 3000
    logits = jnp.asarray(rng.standard_normal((B, V)) * 3, jnp.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_p=0.9), None]
    sb = SamplingBatch.from_params(params, seeds=list(range(B)), steps=[3] * B, batch_size=B)
    out = {impl: jax.jit(sampling.sample, static_argnums=2)(logits, sb, impl)
           for impl in ("cpu", "xla")}
    np.testing.assert_array_equal(np.asarray(out["cpu"][0]), np.asarray(out["xla"][0]))
    tokens = np.asarray(out["cpu"][0])
    want = np.asarray(jax.nn.log_softmax(logits, axis=-1))[np.arange(B), tokens]
    for impl in ("cpu", "xla"):
        np.testing.assert_allclose(np.asarray(out[impl][1]), want, rtol=1e-5, atol=1e-5)
    greedy = np.asarray(jnp.argmax(logits, axis=-1))
    assert tokens[0] == greedy[0] and tokens[3] == greedy[3] and tokens[5] == greedy[5]
