"""Static configuration: the model's shape, the engine's groups (cache, scheduler,
compilation buckets, kernels), the mesh (parallel), the server.

Everything here is a frozen (hashable) dataclass, so a ModelConfig can be a static
argument of a jitted function. Nothing reads the environment: configuration is explicit.
`configs/NAME.py` files build a `Config` and bind it to the name `CONFIG`; `load_config`
runs one.

One module per group, each field documented by the string right after it (the help of
its command-line flag): validation.py (ConfigError), model.py (ModelConfig, RopeScaling,
ModelSource), cache.py, scheduler.py, sampler.py, compilation.py, kernel.py,
speculative.py, lora.py, engine.py (EngineConfig, which holds the groups), parallel.py
(ParallelConfig, check_deployment), server.py (ServerConfig), deployment.py (Config); and
args.py, the command-line flags generated from the fields. Every name is imported from
here (`from jaxserve.config import CacheConfig`).

May import: the standard library only (everything else in jaxserve builds on it).
"""

from __future__ import annotations

import runpy
from pathlib import Path

from jaxserve.config.cache import NULL_PAGE, CacheConfig
from jaxserve.config.compilation import CompilationConfig
from jaxserve.config.deployment import (CONVERTED_QUANTIZATIONS, HF_QUANTIZATIONS, LOAD_FORMATS,
                                       QUANTIZATIONS, Config)
from jaxserve.config.engine import EngineConfig
from jaxserve.config.kernel import (ATTENTION_IMPLS, ATTENTION_KERNEL_IMPLS, BRANCHES,
                                    GEMV_KERNEL_IMPLS, GPU_PLATFORMS, KERNEL_IMPLS,
                                    MATMUL_IMPLS, MATMUL_KERNEL_IMPLS, MOSAIC_KERNEL_IMPLS,
                                    SAMPLING_IMPLS, WEIGHT_QUANT_FORMATS, KernelConfig,
                                    is_hopper, resolve_attention_impl, resolve_impl)
from jaxserve.config.lora import LORA_DTYPES, LoRAConfig
from jaxserve.config.model import ModelConfig, ModelSource, RopeScaling
from jaxserve.config.parallel import ParallelConfig, check_deployment
from jaxserve.config.sampler import SamplerConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.config.server import ServerConfig
from jaxserve.config.speculative import (MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS,
                                         SpeculativeConfig)
from jaxserve.config.validation import ConfigError

__all__ = [
    "ATTENTION_IMPLS", "ATTENTION_KERNEL_IMPLS", "BRANCHES", "CONVERTED_QUANTIZATIONS",
    "GEMV_KERNEL_IMPLS", "GPU_PLATFORMS", "HF_QUANTIZATIONS",
    "KERNEL_IMPLS", "LOAD_FORMATS", "MATMUL_IMPLS", "MATMUL_KERNEL_IMPLS",
    "MAX_SPECULATIVE_TOKENS", "MOSAIC_KERNEL_IMPLS", "NULL_PAGE", "QUANTIZATIONS",
    "SAMPLING_IMPLS", "SHIPPED_CONFIGS", "SPECULATIVE_METHODS", "WEIGHT_QUANT_FORMATS",
    "CacheConfig", "CompilationConfig", "Config", "ConfigError", "EngineConfig",
    "KernelConfig", "LORA_DTYPES", "LoRAConfig", "ModelConfig", "ModelSource", "ParallelConfig", "RopeScaling",
    "SamplerConfig", "SchedulerConfig", "ServerConfig", "SpeculativeConfig",
    "check_deployment", "config_path", "is_hopper", "load_config", "resolve_attention_impl",
    "resolve_impl", "shipped_config_names",
]

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def shipped_config_names() -> list[str]:
    """Names of the configs shipped in the package (jaxserve/configs/NAME.py)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.py") if p.stem != "__init__")


def config_path(name_or_path: str | Path) -> Path:
    """The file a `--config` value names: an existing path as it is, else a shipped config
    by name ("smollm2_135m", or "configs/smollm2_135m.py" from a source checkout's
    root). Raises ConfigError naming the value and the shipped names if neither exists."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = SHIPPED_CONFIGS / (path.stem + ".py")
    if path.suffix in ("", ".py") and shipped.is_file() and (
            len(path.parts) == 1 or path.parent.name == "configs"):
        return shipped
    raise ConfigError(f"config {str(name_or_path)!r} is neither a file nor a shipped config "
                      f"({', '.join(shipped_config_names())})")


def load_config(path: str | Path) -> Config:
    """Run a config file (a path, or a shipped config's name: `config_path`) and return
    its `CONFIG`.

    Raises ConfigError if the file does not exist or defines no CONFIG of type Config.
    """
    path = config_path(path)
    cfg = runpy.run_path(str(path)).get("CONFIG")
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: defines no CONFIG of type jaxserve.config.Config")
    return cfg
