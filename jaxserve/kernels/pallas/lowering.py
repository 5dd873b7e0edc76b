"""Lowering the Pallas kernels for a CUDA GPU the machine does not have (CI's CPUs).

Since JAX 0.11 the Triton backend's lowering asks which GPU it targets
(`jax._src.pallas.triton.gpu_info`: its compute capability picks the Triton pipeline), and
without a GPU it raises "No supported GPU devices found, please specify an abstract GPU
device". `cuda_target()` names one: through an abstract mesh carrying an abstract device, as
that error asks, or, for functions sharded over a mesh of CPU devices, through the Triton
backend's device registry. The Mosaic GPU backend lowers for sm_90a either way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

# What the tests and tools lower for: the Hopper GPU the native tier ran on (session 22).
DEFAULT_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def cuda_target(mesh=None, device_kind: str = DEFAULT_DEVICE_KIND) -> Iterator[None]:
    """Within it, `jax.jit(f).trace(...)` and `.lower(lowering_platforms=("cuda",))` lower
    the Triton kernels for a GPU of `device_kind` (a JAX device_kind such as "NVIDIA H100
    80GB HBM3"; JAX reads the compute capability off the name). Both the trace and the
    lowering must run inside it: the abstract mesh is captured when the function is traced.

    mesh: None for a function without shardings: the target is an abstract device on an
    abstract mesh (`jax.sharding.use_abstract_mesh`, what JAX's error asks for). A
    `jax.sharding.Mesh` of CPU devices (tensor / pipeline parallel lowering checks): its
    shard_maps must run under that very mesh, so instead the CPU devices' kind is named
    the GPU's in the Triton backend's device registry
    (`jax._src.pallas.triton.gpu_info.registry`, private) for the context's duration.
    Raises ValueError for a device_kind JAX does not know."""
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh

    if mesh is None:
        device = AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
        with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
            yield
        return
    from jax._src.pallas.triton import gpu_info

    version = gpu_info.gpu_version_from_device_kind(device_kind)
    if version is None:
        raise ValueError(f"cuda_target: JAX knows no GPU of kind {device_kind!r}")
    kind = mesh.devices.flat[0].device_kind
    before = gpu_info.registry.get(kind)
    gpu_info.registry[kind] = lambda: gpu_info.get_gpu_info_from_version(version)
    try:
        yield
    finally:
        if before is None:
            del gpu_info.registry[kind]
        else:
            gpu_info.registry[kind] = before


__all__ = ["DEFAULT_DEVICE_KIND", "cuda_target"]
