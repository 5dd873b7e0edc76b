"""The KV page pool's group (CacheConfig), and NULL_PAGE, the page no sequence owns."""

from __future__ import annotations

import dataclasses

from jaxserve.config.validation import ConfigError, _positive

# Page 0 of every KV pool is never allocated: padding token rows write their K/V there and
# padding block-table entries point at it (the host's page pool and the device's step
# arrays both rely on it).
NULL_PAGE = 0
# CacheConfig.cache_dtype's values (vLLM's --kv-cache-dtype) -> the dtype K/V are stored in
# (None: the model's). fp8 is e4m3fn with a per-tensor scale of 1 (vLLM's default without
# calibrated scales in the checkpoint); int8 has a scale per token and KV head, computed as
# each token is written (jaxserve.kernels.common.INT8_KV).
KV_CACHE_DTYPES = {"auto": None, "float32": "float32", "bfloat16": "bfloat16",
                   "float16": "float16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "int8": "int8"}


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV page pool (vLLM's CacheConfig)."""

    page_size: int = 16
    """Tokens per KV page. vLLM calls it `block_size`; jaxserve says page, as
    PagedAttention's paper and the JAX engines' kernels (tpu-inference, sglang-jax) do,
    and keeps vLLM's "block table" for a sequence's list of page ids."""
    kv_cache_memory_bytes: int | None = 256 * 2**20
    """Bytes of device memory for the pool (K and V, all layers, all devices together), as
    vLLM's `--kv-cache-memory-bytes`; None: sized from the devices' memory by
    gpu_memory_utilization."""
    cache_dtype: str | None = dataclasses.field(default=None,
                                                metadata={"choices": tuple(KV_CACHE_DTYPES)})
    """Dtype K/V are stored in (vLLM's `--kv-cache-dtype`): None or "auto" (the model's),
    "float32", "bfloat16", "float16", "fp8" / "fp8_e4m3" (float8_e4m3fn, a quarter of
    f32's bytes: twice a bf16 pool's pages in the same memory; K/V clipped to +-448 and
    rounded, per-tensor scale 1 as vLLM's default), or "int8" (symmetric int8 with an f32
    scale per token and KV head, set when the token is written: head_dim + 4 bytes a row,
    1.88x a bf16 pool's pages at head_dim 64; jaxserve.model.kv_cache)."""
    enable_prefix_caching: bool = True
    """Keep the K/V pages of finished and preempted sequences, by chained page hash, for
    later prompts with the same prefix (jaxserve.engine.page_pool; evicted least recently
    used first when pages are needed)."""
    gpu_memory_utilization: float = 0.9
    """With kv_cache_memory_bytes None, the fraction of each GPU's memory the engine may
    use (vLLM's `--gpu-memory-utilization`): the pool gets what the weights and the largest
    step's activations (jaxserve.worker.memory_plan) leave of it."""
    cpu_kv_cache_space: float | None = None
    """With kv_cache_memory_bytes None, on CPU devices: GiB of host memory for the pool, all
    of the process's devices together (vLLM's VLLM_CPU_KVCACHE_SPACE). None: half of what
    the host has available after the weights and the largest step's activations
    (jaxserve.worker.memory_plan.CPU_AUTO_KV_FRACTION), the page count rounded down to 5
    significant bits (at most 1/16 fewer pages) so that a restart on about the same free
    memory gets the same pool and reads its programs back from the compilation cache."""

    def __post_init__(self):
        _positive("CacheConfig", self, ("page_size",))
        if self.kv_cache_memory_bytes is not None:
            _positive("CacheConfig", self, ("kv_cache_memory_bytes",))
        if self.cpu_kv_cache_space is not None and not self.cpu_kv_cache_space > 0:
            raise ConfigError(f"CacheConfig.cpu_kv_cache_space must be > 0 (GiB), got "
                              f"{self.cpu_kv_cache_space!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization!r}")
        if self.cache_dtype is not None and self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"CacheConfig.cache_dtype must be None or one of "
                              f"{list(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")

    def kv_dtype(self, model_dtype: str) -> str:
        """The dtype name K/V are stored in for a model of `model_dtype`."""
        return KV_CACHE_DTYPES.get(self.cache_dtype or "auto") or model_dtype
