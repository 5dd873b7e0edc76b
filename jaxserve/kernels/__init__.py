"""Kernels: what runs on the device below the model.

Owns: `common` (input checks, the ragged batch's row owners, the KV pool's storage dtype,
shared by every kernel and the model's XLA code), `ggml_blocks` (GGUF's block formats),
`pallas/` (GPU kernels, each beside a
plain-jnp reference), `cpu/` (C++ XLA FFI kernels for CPUs, their sources shipped as
package data and built at first use), `impl_table` (an implementation name -> its backend
object).

May import: jax, numpy, and within `jaxserve.kernels` only (nothing of the model, the
engine or the config: kernels take arrays and plain arguments).
"""
