"""Per-row argmax and log-sum-exp of logits for XLA:CPU: the C++ kernel of
argmax_logsumexp.cc behind an FFI call, and its plain-jnp reference.

Greedy sampling needs the argmax of each row of logits, and the chosen token's logprob needs
the row's log-sum-exp (logprob = logits[token] - logsumexp). XLA:CPU ran these as several
separate vocabulary-wide loops (max, compare-select, min, subtract, exp-sum) and wrote the
whole [B, V] log-softmax to memory (a visible share of a batched decode step over a large
vocabulary: PERFORMANCE.md, "Measurements behind the code"); the kernel reads each row
twice from cache instead.

Source: the two-pass softmax statistics of oneDNN's CPU softmax; Cephes expf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import check_array

TARGET = "jaxserve_argmax_logsumexp"


@jax.jit
def argmax_logsumexp(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] f32 -> (argmax [B] int32, the first maximum among ties, as jnp.argmax;
    logsumexp [B] f32, log(sum(exp(logits))) along V, relative error ~1e-6). A row holding a
    NaN gives index 0 and a NaN log-sum-exp; an all -inf row index 0 and -inf. Needs
    `jaxserve.kernels.cpu.build.load_library` called first. Raises ValueError for a logits array
    that is not [B, V] f32 with V >= 1."""
    check_array("cpu argmax_logsumexp", "logits", logits, (None, None), (jnp.float32,))
    if logits.shape[1] < 1:
        raise ValueError("cpu argmax_logsumexp: logits must have V >= 1 columns, got 0")
    B = logits.shape[0]
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((B,), jnp.int32),
                                     jax.ShapeDtypeStruct((B,), jnp.float32)))
    return call(logits)


def argmax_logsumexp_reference(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp `argmax_logsumexp` (same argument and results, except that jnp.argmax gives
    a NaN's index for a row holding one)."""
    check_array("argmax_logsumexp_reference", "logits", logits, (None, None), (jnp.float32,))
    return (jnp.argmax(logits, axis=-1).astype(jnp.int32),
            jax.nn.logsumexp(logits, axis=-1))


__all__ = ["argmax_logsumexp", "argmax_logsumexp_reference"]
