"""LoRA serving's group (LoRAConfig, vLLM's `--enable-lora` flags)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.validation import ConfigError

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_RANK = 512  # vLLM's largest; the CPU kernel keeps a [rows, rank] block on its stack


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (vLLM's LoRAConfig): requests name an adapter as their
    `model`; the step applies each row's adapter from pools of `max_loras` slots of rank
    `max_lora_rank` (jaxserve.lora), loaded and swapped at run time without recompiling."""

    enable_lora: bool = False
    """Serve LoRA adapters (vLLM's `--enable-lora`): the step carries the adapter slots'
    pools (max_loras + 1 slots: slot 0 is no adapter) and each token row's slot."""
    max_loras: int = 1
    """Most distinct adapters in one step (vLLM's `--max-loras`): requests for another
    adapter wait until a slot is free (no running request uses its adapter)."""
    max_lora_rank: int = 16
    """Highest adapter rank served (vLLM's `--max-lora-rank`, at most 512): every slot is
    padded to it (memory: jaxserve.worker.memory_plan counts the pools)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory, least recently used evicted and read again from
    disk when asked for (vLLM's `--max-cpu-loras`); None = max_loras. At least
    max_loras."""
    lora_modules: tuple[str, ...] = ()
    """Adapters served from the start, each NAME=PATH (a PEFT directory:
    adapter_config.json + adapter_model.safetensors), as vLLM's `--lora-modules`. More
    are added at run time by POST /v1/load_lora_adapter."""
    lora_dtype: str = dataclasses.field(default="auto", metadata={"choices": LORA_DTYPES})
    """Dtype of the adapter pools (vLLM's `--lora-dtype`): "auto" = the model's. The
    products are summed in f32 either way."""

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"LoRAConfig.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.max_lora_rank, int) and self.max_lora_rank > MAX_LORA_RANK:
            raise ConfigError(f"LoRAConfig.max_lora_rank must be at most {MAX_LORA_RANK} "
                              f"(vLLM's largest), got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ConfigError(f"LoRAConfig.max_cpu_loras must be an integer >= max_loras "
                              f"({self.max_loras}), got {self.max_cpu_loras!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"LoRAConfig.lora_dtype must be one of {LORA_DTYPES}, "
                              f"got {self.lora_dtype!r}")
        modules = self.lora_modules
        if isinstance(modules, str) or not isinstance(modules, tuple):
            raise ConfigError(f"LoRAConfig.lora_modules must be a tuple of NAME=PATH strings, "
                              f"got {modules!r}")
        self.modules()  # each one's form
        if modules and not self.enable_lora:
            raise ConfigError("LoRAConfig.lora_modules needs enable_lora (--enable-lora)")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept read on the host (max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def num_slots(self) -> int:
        """Slots of each pool: max_loras + slot 0 (no adapter)."""
        return self.max_loras + 1

    def modules(self) -> dict[str, str]:
        """{name: path} of lora_modules. Raises ConfigError naming an entry that is not
        NAME=PATH or a name given twice."""
        out: dict[str, str] = {}
        for entry in self.lora_modules:
            name, sep, path = str(entry).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"LoRAConfig.lora_modules entries are NAME=PATH, got {entry!r}")
            if name.strip() in out:
                raise ConfigError(f"LoRAConfig.lora_modules names {name.strip()!r} twice")
            out[name.strip()] = path.strip()
        return out
