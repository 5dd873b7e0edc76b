"""Devices and processes: `sharding` (logical axis names -> mesh axes, one rules object;
the pipeline stages' layers) and `multiprocess` (jax.distributed across processes: the
coordinator, the leader's step mirrored to followers).

May import: config and jax; nothing else of jaxserve.
"""
