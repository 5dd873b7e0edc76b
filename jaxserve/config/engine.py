"""The serving engine's config (EngineConfig): the groups of cache.py, scheduler.py,
compilation.py, kernel.py, sampler.py, speculative.py and lora.py, what spans them, and
`override`, which sets a field by name wherever it lives."""

from __future__ import annotations

import dataclasses

from jaxserve.config.cache import CacheConfig
from jaxserve.config.compilation import CompilationConfig
from jaxserve.config.kernel import KernelConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.sampler import SamplerConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.config.validation import ConfigError, _positive

POOLING = ("last", "mean")  # EngineConfig.pooling's choices (vLLM's pooling types LAST, MEAN)

# EngineConfig's groups by field name: EngineConfig.override routes a field name to the
# group that has it (field names are unique across groups: tests/test_config.py).
ENGINE_GROUPS = {"cache": CacheConfig, "scheduler": SchedulerConfig,
                 "compilation": CompilationConfig, "kernels": KernelConfig,
                 "sampler": SamplerConfig, "lora": LoRAConfig}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the serving engine is built with, in the groups a vLLM user knows: the
    KV `cache`, the `scheduler`'s limits, the `compilation` buckets, the `kernels` and the
    `sampler`'s output sizes;
    plus max_model_len (vLLM's ModelConfig.max_model_len: jaxserve's ModelConfig is the
    checkpoint's shape) and the engine's random `seed`.

    Each group checks its own fields when it is made; this class checks what spans groups
    (the buckets reach the limits), and `check_deployment` what needs the model and the
    mesh. `override(**fields)` sets fields by name wherever they live (flags, `LLM(...)`).
    """

    max_model_len: int = 2048
    """Most tokens (prompt + output) one sequence may hold."""
    seed: int = 0
    """Seeds requests that give none (numpy generator)."""
    cache: CacheConfig = CacheConfig()
    """The KV page pool."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """What one step may hold."""
    compilation: CompilationConfig = CompilationConfig()
    """The padded shapes the step is compiled for."""
    kernels: KernelConfig = KernelConfig()
    """Which kernels compute the step."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (None = off). `--speculative-config` and
    `override(speculative_config=...)` take it as vLLM's JSON object, e.g. {"method":
    "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}."""
    sampler: SamplerConfig = SamplerConfig()
    """What a request may ask of the sampler."""
    lora: LoRAConfig = LoRAConfig()
    """Serving LoRA adapters (off unless enable_lora)."""
    pooling: str | None = dataclasses.field(default=None, metadata={"choices": POOLING})
    """Serve embeddings (/v1/embeddings, LLM.embed) pooled this way from the final hidden
    states: "last" (the last prompt token's: decoder embedding models such as
    e5-mistral, gte-Qwen) or "mean" (the prompt tokens' mean), L2-normalised; None = no
    embeddings (the compiled steps are unchanged)."""

    def __post_init__(self):
        _positive("EngineConfig", self, ("max_model_len",))
        spec = self.speculative
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ConfigError(f"EngineConfig.speculative must be a SpeculativeConfig or None, "
                              f"got {spec!r}")
        for name, group in ENGINE_GROUPS.items():
            if not isinstance(getattr(self, name), group):
                raise ConfigError(f"EngineConfig.{name} must be a {group.__name__}, "
                                  f"got {getattr(self, name)!r}")
        limits = self.scheduler
        if (not limits.enable_chunked_prefill
                and limits.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(f"SchedulerConfig.max_num_batched_tokens ({limits.max_num_batched_tokens}) "
                              f"must hold max_model_len ({self.max_model_len}) tokens when "
                              "enable_chunked_prefill is off (a prompt is prefilled whole)")
        if self.pooling is not None and self.pooling not in POOLING:
            raise ConfigError(f"EngineConfig.pooling must be one of {list(POOLING)} or None, "
                              f"got {self.pooling!r}")
        if self.pooling is not None and spec is not None:
            raise ConfigError("EngineConfig.pooling (embeddings) and speculative decoding "
                              "cannot be combined: a verify step pools no hidden states")
        if spec is not None:
            if spec.disable_by_batch_size > limits.max_num_seqs:
                raise ConfigError(f"SpeculativeConfig.disable_by_batch_size "
                                  f"({spec.disable_by_batch_size}) must be at most "
                                  f"max_num_seqs ({limits.max_num_seqs})")
            rows = spec.disable_by_batch_size * (spec.num_speculative_tokens + 1)
            if rows > limits.max_num_batched_tokens:
                raise ConfigError(f"SchedulerConfig.max_num_batched_tokens "
                                  f"({limits.max_num_batched_tokens}) must hold a verify step of "
                                  f"{rows} rows (disable_by_batch_size x (num_speculative_tokens "
                                  "+ 1))")

    def override(self, **fields) -> "EngineConfig":
        """A copy with `fields` set, each named as in its group (`page_size=8`,
        `max_num_seqs=4`, `attention_impl="xla"`), or a top-level field or whole group.
        Raises ConfigError for an unknown name or a value its group refuses."""
        own = {f.name for f in dataclasses.fields(self)}
        top, groups = {}, {}
        for key, value in fields.items():
            if key == "speculative_config":  # vLLM's name: a JSON object, its text, or None
                top["speculative"] = (value if value is None or isinstance(value, SpeculativeConfig)
                                      else SpeculativeConfig.from_dict(value))
                continue
            if key in own:
                top[key] = value
                continue
            owner = next((g for g, cls in ENGINE_GROUPS.items()
                          if key in {f.name for f in dataclasses.fields(cls)}), None)
            if owner is None:
                raise ConfigError(f"EngineConfig has no field {key!r}")
            groups.setdefault(owner, {})[key] = value
        for owner, kw in groups.items():
            top[owner] = dataclasses.replace(top.get(owner, getattr(self, owner)), **kw)
        return dataclasses.replace(self, **top)

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.cache.page_size)

