"""C++ kernels for XLA:CPU, called through JAX's FFI (`jax.ffi.ffi_call`).

Each kernel is one `.cc` file beside a Python module holding its jitted public function
(input checks, the `ffi_call`) and a plain-jnp `*_reference`. `build.load_library` compiles
the sources once with the system C++ compiler against the XLA FFI headers shipped in
jaxlib, caches the shared library by a hash of everything that goes into it, and registers
the handlers with JAX.

May import: jax, numpy, jaxserve.kernels.common and jaxserve.kernels.ggml_blocks only.
"""
