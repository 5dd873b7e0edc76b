"""jaxserve: a JAX/XLA-compiled, functional LLM inference engine for Llama-family models.

Public API: `generate`, `LLM`, `SamplingParams`, `Config` and friends, `load_config`.
Imported lazily, so that host-only modules (scheduler, page pool) load without JAX.
"""

import importlib

_EXPORTS = {
    "LLM": "jaxserve.api", "Completion": "jaxserve.api", "build_engine": "jaxserve.engine.builder",
    "generate": "jaxserve.api", "load_config": "jaxserve.config",
    "Config": "jaxserve.config", "EngineConfig": "jaxserve.config",
    "ParallelConfig": "jaxserve.config", "ModelConfig": "jaxserve.config",
    "CacheConfig": "jaxserve.config", "SchedulerConfig": "jaxserve.config",
    "CompilationConfig": "jaxserve.config", "KernelConfig": "jaxserve.config",
    "ModelSource": "jaxserve.config", "RopeScaling": "jaxserve.config",
    "LoRARequest": "jaxserve.lora.request",
    "InvalidRequest": "jaxserve.sampling_params", "SamplingParams": "jaxserve.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
