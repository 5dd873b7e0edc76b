"""Pallas kernels (paged decode attention, ragged flash prefill, quantized matmuls).

Each kernel file holds the kernel body, its pallas_call wrapper, a jitted public function
and a plain-jnp reference; the engine selects them with KernelConfig.attention_impl.

May import: jax, numpy and jaxserve.kernels.common only.
"""
