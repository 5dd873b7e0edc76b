"""The sampler's vocabulary-wide reductions as backend objects (KernelConfig.sampling_impl):
`SamplerOps` per implementation ("xla", "cpu": the C++ kernel), `argmax_last` and
`argmax_logsumexp`. Kernels-level, so that the model's `Kernels` record can hold one
without importing the sampler (jaxserve.sample builds on these)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.kernels.impl_table import lookup


def _first_index_of(x: jax.Array, top: jax.Array) -> jax.Array:
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    idx = jnp.min(jnp.where(x == top, iota, x.shape[-1]), axis=-1)
    return jnp.where(idx < x.shape[-1], idx, 0).astype(jnp.int32)


def argmax_last(x: jax.Array) -> jax.Array:
    """Index of the largest entry along the last axis, the first one among ties, as
    jnp.argmax (except that a row holding a NaN gives 0, not the NaN's index).
    x: [..., V] float -> [...] int32.

    A max-reduce, then a min-reduce of the indices equal to it: two plain reductions that
    XLA:CPU vectorises, where jnp.argmax's (value, index) pair reduction is not (about
    twice as fast: PERFORMANCE.md, "Measurements behind the code")."""
    return _first_index_of(x, jnp.max(x, axis=-1, keepdims=True))


class SamplerOps:
    """The vocabulary-wide reductions every sampled row needs, as one implementation chosen
    when the engine is built (KernelConfig.sampling_impl). Subclasses are frozen
    dataclasses: hashable, equal by value. name: the sampling_impl it stands for."""

    name: str

    def argmax_logsumexp(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What greedy sampling and logprobs need from each row of logits [B, V] f32:
        (argmax [B] int32 as argmax_last, logsumexp [B] f32)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class XlaSamplerOps(SamplerOps):
    """XLA ops sharing the row maximum."""

    name = "xla"

    def argmax_logsumexp(self, logits):
        top = jnp.max(logits, axis=-1, keepdims=True)
        lse = top[:, 0] + jnp.log(jnp.sum(jnp.exp(logits - top), axis=-1))
        return _first_index_of(logits, top), lse


@dataclasses.dataclass(frozen=True)
class CpuSamplerOps(SamplerOps):
    """The C++ kernel of jaxserve/kernels/cpu/argmax_logsumexp: one pass per statistic over
    each row (its library must be loaded: jaxserve.worker.kernel_selection.select_kernels)."""

    name = "cpu"

    def argmax_logsumexp(self, logits):
        from jaxserve.kernels.cpu.argmax_logsumexp import argmax_logsumexp as kernel
        return kernel(logits)


_SAMPLER_OPS = {"xla": XlaSamplerOps(), "cpu": CpuSamplerOps()}


def sampler_ops(impl: "str | SamplerOps") -> SamplerOps:
    """The SamplerOps a sampling_impl name stands for ("xla", "cpu"); a SamplerOps is
    returned as it is. Raises ValueError for an unknown name."""
    return lookup(_SAMPLER_OPS, impl, SamplerOps, "sampling impl")


def argmax_logsumexp(logits: jax.Array, impl: "str | SamplerOps" = "xla"
                     ) -> tuple[jax.Array, jax.Array]:
    """`sampler_ops(impl).argmax_logsumexp(logits)`: (argmax [B] int32, logsumexp [B] f32)
    of logits [B, V] f32. Raises ValueError for an unknown impl."""
    return sampler_ops(impl).argmax_logsumexp(logits)
