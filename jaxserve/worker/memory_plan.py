"""Per-device memory plan of a deployment: weights, KV page pool, activations.

Computed from the abstract param tree and its shardings on an abstract mesh, so a 70B
tensor-parallel-8 plan runs on a laptop without allocating anything.

Formulas (the usual serving back-of-envelope, as in vLLM's and the "LLM inference
memory" guides): weights = sum of each leaf's shard size x dtype bytes, for the leaves
the engine holds (quantised values and scales, bf16 copies: prepared_weight_bytes); KV
per token = 2 (K, V) x layers x kv_heads x head_dim x dtype bytes (an int8 pool's rows
also hold a 4-byte scale: head_dim + 4 bytes); pool =
kv_cache_memory_bytes split over the devices that share the kv_heads axis (or, without it:
on GPU gpu_memory_utilization of each device less the weights and activations, as vLLM;
on CPU cpu_kv_cache_space GiB, or CPU_AUTO_KV_FRACTION of the host memory the weights and
activations leave, its page count rounded down to CPU_AUTO_PAGE_BITS significant bits);
activations = the largest step's live buffers
(residual, q/k/v, with XLA attention one block's gathered K/V and f32 scores, MLP, f32 logits, the
logits controls' and the prompt-logprobs block's buffers). A drafter
of speculative decoding (a draft model, an EAGLE head) keeps its own pool over the same
pages: each page of the budget pays for both (as jaxserve.engine.builder.build_engine sizes them), so
fewer pages fit; its weights are not counted (a few MB for a head; a draft model's
checkpoint says). With pipeline stages a device holds its stage's ceil(layers / PP)
layer slots (weights and pool; the last stage's spare slots are zero layers) and the
embedding, final norm and LM head, which every stage keeps; the activations are counted
for the whole step (microbatching only lowers them).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.checkpoint import is_checkpoint, load_model_config
from jax.sharding import PartitionSpec

from jaxserve.config import Config, ConfigError, KernelConfig, ModelConfig, SpeculativeConfig
from jaxserve.model.attention import xla_attention_temp_bytes
from jaxserve.model.kv_cache import KV_AXES, page_bytes, token_bytes
from jaxserve.model.lora import pool_bytes
from jaxserve.model.params import abstract_params
from jaxserve.sample.sampler import PROMPT_LOGPROBS_BLOCK
from jaxserve.distributed.sharding import ShardingRules, layers_per_stage, make_abstract_mesh
from jaxserve.spec_decode.eagle import eagle_page_bytes

GiB = 2**30
# On CPU, without kv_cache_memory_bytes or cpu_kv_cache_space: the pool's share of the
# host memory left after the weights and activations. The rest stays for what the plan
# does not count: the tokenizer, the server, XLA's compiler and its per-step temporaries
# beyond the planned buffers, and the machine's other processes.
CPU_AUTO_KV_FRACTION = 0.5
# ... and its page count then rounded down to this many significant bits (at most 1/16
# fewer pages): the host's available memory moves by a fraction of a percent between two
# starts of the same server, and every step program's shapes carry the pool's page count,
# so an unrounded pool missed XLA's persistent compilation cache at every restart (the TP 8
# llama70b server of tests/test_distributed.py compiled 7-13 programs anew each start).
CPU_AUTO_PAGE_BITS = 5


def round_page_count(pages: int, bits: int = CPU_AUTO_PAGE_BITS) -> int:
    """`pages` (>= 0) rounded down to its `bits` most significant binary digits: 1000 ->
    992 at 5 bits (0b1111100000), 31 -> 31. Loses less than 2**-(bits - 1) of the pages."""
    drop = max(pages.bit_length() - bits, 0)
    return pages >> drop << drop


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """All sizes in bytes, per device unless named `_total`."""

    num_devices: int
    num_params: int
    weights_total: int
    weights: int
    kv_bytes_per_token_total: int
    kv_pages: int
    kv_tokens: int
    kv_pool: int
    activations: int
    replicated_leaves: tuple[str, ...]
    # the drafter's pools over the same pages (speculative decoding), split over the
    # devices like the target's pool (an EAGLE head's feature pool is not: a few % low)
    draft_pool: int = 0
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    layers_per_device: int = 0
    # how the pool was sized: the CacheConfig field that gave its bytes
    # ("kv_cache_memory_bytes", "cpu_kv_cache_space", "gpu_memory_utilization") or
    # "cpu_auto" (CPU_AUTO_KV_FRACTION of the host's memory left)
    kv_sized_by: str = "kv_cache_memory_bytes"
    # one page's bytes over all devices (the target's and the drafter's K/V), and over
    # how many devices' worth the pool's bytes split (see plan_memory)
    page_bytes_total: int = 0
    kv_split: float = 1.0
    # the LoRA adapter slots' pools (enable_lora), included in `weights`
    lora_pools: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.draft_pool + self.activations

    def max_kv_budget(self, device_bytes: int) -> int:
        """The largest pool (bytes over all devices, a whole number of pages, as
        CacheConfig.kv_cache_memory_bytes counts it) that fits beside the weights and
        activations in `device_bytes` per device; 0 if none does."""
        free = device_bytes - self.weights - self.activations
        if free <= 0 or not self.page_bytes_total:
            return 0
        return int(free * self.kv_split) // self.page_bytes_total * self.page_bytes_total

    def table(self, device_bytes: int | None = None) -> str:
        rows = [("devices", f"{self.num_devices} (tensor parallel {self.tensor_parallel} x "
                            f"pipeline stages {self.pipeline_stages})"),
                ("layers / device", f"{self.layers_per_device}"),
                ("parameters", f"{self.num_params / 1e9:.2f} B"),
                ("weights (all devices)", f"{self.weights_total / GiB:.2f} GiB"),
                ("weights / device", f"{self.weights / GiB:.2f} GiB"),
                *([("LoRA slots / device", f"{self.lora_pools / GiB:.2f} GiB (in the weights)")]
                  if self.lora_pools else []),
                ("KV / token (all devices)", f"{self.kv_bytes_per_token_total / 2**10:.1f} KiB"),
                ("KV pool / device", f"{self.kv_pool / GiB:.2f} GiB "
                                     f"({self.kv_pages} pages, {self.kv_tokens} tokens)"),
                *([("drafter pool / device", f"{self.draft_pool / GiB:.2f} GiB "
                                             "(speculative decoding, same pages)")]
                  if self.draft_pool else []),
                ("activations / device", f"{self.activations / GiB:.2f} GiB"),
                ("total / device", f"{self.total / GiB:.2f} GiB")]
        if device_bytes:
            rows.append(("headroom / device", f"{(device_bytes - self.total) / GiB:.2f} GiB "
                                              f"of {device_bytes / GiB:.1f} GiB"))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _spec_bytes(x, spec: PartitionSpec, mesh) -> int:
    """Bytes of one device's shard of `x` (shape, dtype) under `spec` on `mesh`."""
    shape = list(x.shape)
    for i, axis in enumerate(tuple(spec)):
        if axis is not None:
            shape[i] //= mesh.shape[axis]
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def prepared_weight_bytes(model: ModelConfig, kcfg: KernelConfig,
                          rules: ShardingRules) -> tuple[int, int]:
    """(bytes on one device, bytes in all) of the weights as the engine holds them: after
    jaxserve.worker.kernel_selection.layout_params (int8 / fp8 values and their scales, bf16 copies beside
    or instead of the weights), traced abstractly (jax.eval_shape: nothing allocated) and
    split by the shard_map specs of jaxserve.model.tensor_parallel; with pipeline stages
    (a `stage` mesh axis) one device holds ceil(layers / stages) of the layers."""
    from jaxserve.worker.kernel_selection import layout_params
    from jaxserve.model.tensor_parallel import params_specs
    from jaxserve.model.transformer import Kernels

    # the XLA layout: a packed copy holds the same bytes as a plain one; fused per shard
    # of `rules`' mesh, as the engine fuses them (else a fused matrix counts as replicated)
    prepared = jax.eval_shape(lambda p: layout_params(p, kcfg, Kernels(), rules),
                              abstract_params(model))
    specs = params_specs(prepared, rules)
    def device_bytes(tree, spec_tree) -> int:
        spec_leaves = jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return sum(_spec_bytes(x, s, rules.mesh)
                   for x, s in zip(jax.tree.leaves(tree), spec_leaves, strict=True))

    per_device = device_bytes(prepared, specs)
    stages = rules.size("stages")
    if stages > 1:  # every device holds its stage's layer slots, not all layers
        L = model.num_layers
        per_device += ((layers_per_stage(L, stages) - L)
                       * device_bytes(prepared.layers[0], specs.layers[0]))
    leaves = jax.tree.leaves(prepared)
    return per_device, sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)


def plan_memory(config: Config, model: ModelConfig | None = None, platform: str = "gpu",
                device_bytes: int | None = None) -> MemoryPlan:
    """Plan `config` on an abstract mesh of `config.parallel` (no devices, no allocation),
    for devices of `platform` ("gpu", "cpu": what "auto" kernels resolve to) with
    `device_bytes` of memory each.

    `model` defaults to `config.model`. With CacheConfig.kv_cache_memory_bytes None the
    pool gets, on every device: on GPU gpu_memory_utilization x device_bytes less the
    weights and activations of one device; on CPU cpu_kv_cache_space GiB (all devices),
    or CPU_AUTO_KV_FRACTION of what the weights and activations leave of device_bytes
    (there: each device's share of the host's available memory), its page count rounded
    down to CPU_AUTO_PAGE_BITS significant bits (round_page_count: the same pool, and so
    the same compiled programs, when a restart finds slightly more or less memory). The
    plan is not checked against device_bytes here: check_fits does that. Raises
    ValueError if neither gives a shape; ConfigError when the pool is to be sized from
    device memory and `device_bytes` is None, or not one page is left for it.
    """
    from jaxserve.config.kernel import resolve_attention_impl
    from jaxserve.worker.kernel_selection import resolve_kernel_config
    from jaxserve.model.tensor_parallel import served_kv_heads

    model = model or config.model
    if model is None:
        raise ValueError(f"Config {config.name!r} has no model shape to plan (config.model)")
    if config.dtype is not None:
        model = model.replace(dtype=config.dtype)
    # fewer KV heads than devices: each repeated over tp / K devices (weights and pool)
    model = model.replace(num_kv_heads=served_kv_heads(model, config.parallel.tensor_parallel_size))
    ecfg = config.engine
    rules = ShardingRules(make_abstract_mesh(config.parallel))
    params = abstract_params(model, rules)
    leaves = jax.tree.leaves_with_path(params)
    kcfg = resolve_kernel_config(ecfg.kernels, platform, model.dtype, config.quantization)
    weights, weights_total = prepared_weight_bytes(model, kcfg, rules)
    lora, lora_total = pool_bytes(model, ecfg.lora, rules)  # LoRA slots: fixed, as weights
    weights, weights_total = weights + lora, weights_total + lora_total
    replicated = ()
    if config.parallel.tensor_parallel_size > 1:  # matrices that could not be split over `model`
        replicated = tuple(sorted({jax.tree_util.keystr(p).split(".")[-1] for p, x in leaves
                                   if len(x.shape) > 1 and "model" not in x.sharding.spec}))

    kv_dtype = jnp.dtype(ecfg.cache.kv_dtype(model.dtype))
    per_token = token_bytes(model, kv_dtype)
    page_size = ecfg.cache.page_size
    draft_page = drafter_page_bytes(ecfg.speculative, model, page_size, kv_dtype)
    per_page = page_bytes(model, page_size, kv_dtype) + draft_page
    probe = (1, page_size, model.num_kv_heads, model.head_dim)
    kv_split = math.prod(probe) // math.prod(rules.sharding(KV_AXES, probe).shard_shape(probe))
    # with pipeline stages a device holds the pool of its stage's layer slots only
    stages = config.parallel.pipeline_parallel_size
    slots = layers_per_stage(model.num_layers, stages)
    kv_split = kv_split * model.num_layers / slots
    activations = activation_bytes(model, config, rules,
                                   resolve_attention_impl(kcfg.attention_impl, platform))
    cache = ecfg.cache
    budget, sized_by = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if budget is None and platform == "cpu" and cache.cpu_kv_cache_space is not None:
        budget, sized_by = int(cache.cpu_kv_cache_space * GiB), "cpu_kv_cache_space"
    if budget is None:
        if device_bytes is None:
            raise ConfigError("CacheConfig.kv_cache_memory_bytes is None and the device memory "
                              "is unknown: give kv_cache_memory_bytes")
        if platform == "cpu":  # a share of what the host has left, for its other users
            sized_by = "cpu_auto"
            free = int(CPU_AUTO_KV_FRACTION * (device_bytes - weights - activations))
            room = f"{device_bytes / GiB:.1f} GiB of available host memory per device"
        else:
            sized_by = "gpu_memory_utilization"
            free = int(cache.gpu_memory_utilization * device_bytes) - weights - activations
            room = (f"gpu_memory_utilization={cache.gpu_memory_utilization} of "
                    f"{device_bytes / GiB:.1f} GiB")
        if free < per_page / kv_split:
            raise ConfigError(
                f"{room} leaves no room for the KV pool: the weights take "
                f"{weights / GiB:.2f} GiB and the largest step's activations "
                f"{activations / GiB:.2f} GiB per device")
        budget = int(free * kv_split)
    pages = budget // per_page
    if sized_by == "cpu_auto":
        pages = round_page_count(pages)
    kv_pool = int(pages * page_size * per_token // kv_split)

    return MemoryPlan(
        num_devices=config.parallel.num_devices, num_params=sum(math.prod(x.shape) for _, x in leaves),
        weights_total=weights_total, weights=weights, kv_bytes_per_token_total=per_token,
        kv_pages=pages, kv_tokens=pages * page_size, kv_pool=kv_pool,
        activations=activations, replicated_leaves=replicated,
        draft_pool=int(pages * draft_page // kv_split),
        tensor_parallel=config.parallel.tensor_parallel_size, pipeline_stages=stages,
        layers_per_device=slots, kv_sized_by=sized_by, page_bytes_total=per_page,
        kv_split=kv_split, lora_pools=lora)


# The flag that set each way of sizing the pool, for messages.
_SIZED_BY_FLAG = {"kv_cache_memory_bytes": "--kv-cache-memory-bytes",
                  "cpu_kv_cache_space": "--cpu-kv-cache-space",
                  "gpu_memory_utilization": "--gpu-memory-utilization"}


def check_fits(plan: MemoryPlan, device_bytes: int, where: str = "the device") -> None:
    """Refuse a plan whose per-device total (weights + KV pool + drafter pool + the largest
    step's activations) exceeds `device_bytes`, what one device really has
    (jaxserve.worker.device_memory), before anything is allocated. `where` names the
    memory in the message ("each of 8 CPU devices' share of the host", ...).

    Raises ConfigError in one line: the flag that sized the pool, the bytes it asks, the
    bytes available and the largest value of that flag that fits (or, when the weights and
    activations alone do not fit, that no pool can)."""
    if plan.total <= device_bytes:
        return
    fixed = plan.weights + plan.activations
    base = (f"{where} has {device_bytes} bytes ({device_bytes / GiB:.2f} GiB) available, and "
            f"the weights ({plan.weights / GiB:.2f} GiB) and the largest step's activations "
            f"({plan.activations / GiB:.2f} GiB) need {fixed / GiB:.2f} GiB per device")
    largest = plan.max_kv_budget(device_bytes)
    if largest == 0:
        raise ConfigError(f"the model does not fit: {base}, leaving no room for one KV page; "
                          "use more devices (--tensor-parallel-size, --pipeline-parallel-size) "
                          "or a smaller --max-num-batched-tokens")
    asked = plan.kv_pages * plan.page_bytes_total
    if plan.kv_sized_by == "cpu_kv_cache_space":
        raise ConfigError(
            f"--cpu-kv-cache-space {asked / GiB:.2f} (GiB) does not fit: {base}; the largest "
            f"that fits is {math.floor(largest / GiB * 100) / 100:.2f}")
    flag = _SIZED_BY_FLAG.get(plan.kv_sized_by, "--kv-cache-memory-bytes")
    raise ConfigError(
        f"{flag} asks for a KV pool of {asked} bytes ({asked / GiB:.2f} GiB over all devices) "
        f"that does not fit: {base}; the largest --kv-cache-memory-bytes that fits is {largest}")


def drafter_page_bytes(spec: SpeculativeConfig | None, target: ModelConfig, page_size: int,
                       kv_dtype) -> int:
    """Bytes (all devices) the drafter of `spec` adds to each page of the target's pool: a
    draft model's K/V (its shape read from the checkpoint at spec.model), an EAGLE head's
    (jaxserve.spec_decode.eagle.eagle_page_bytes); 0 for n-gram lookup or no speculation.
    Raises ConfigError naming SpeculativeConfig.model when a draft model's is not a
    checkpoint."""
    if spec is None or spec.method == "ngram":
        return 0
    if spec.method == "eagle":
        return eagle_page_bytes(target, page_size, kv_dtype)
    if not is_checkpoint(Path(spec.model)):
        raise ConfigError(f"SpeculativeConfig.model: {spec.model} is not a jaxserve checkpoint")
    return page_bytes(load_model_config(Path(spec.model)), page_size, kv_dtype)


def activation_bytes(model: ModelConfig, config: Config, rules: ShardingRules,
                     attention_impl: str = "xla") -> int:
    """Peak live activation bytes per device of the largest step (prefill or decode).
    attention_impl: the resolved kernel ("xla" gathers a block of rows' context K/V out
    of the pool and keeps that block's f32 scores, xla_attention_temp_bytes; the kernels,
    "cpu" and "pallas", read the pages in place and keep one block's scores at a time in
    on-chip memory, counted as nothing here)."""
    ecfg = config.engine
    materialised = attention_impl == "xla"
    tp = rules.mesh.shape["model"]
    b = jnp.dtype(model.dtype).itemsize

    def split(n):  # a head/mlp/vocab axis splits only when divisible, as in ShardingRules
        return n // tp if n % tp == 0 else n

    def step(B, Q):
        T = B * Q
        return (2 * T * model.hidden_size * b                                          # residual + normed
                + T * (split(model.num_heads) + 2 * split(model.num_kv_heads)) * model.head_dim * b
                + materialised * xla_attention_temp_bytes(                              # one block
                    split(model.num_heads), split(model.num_kv_heads), model.head_dim,
                    ecfg.cache.page_size)
                + 3 * T * split(model.intermediate_size) * b                            # gate, up, product
                + B * split(model.vocab_size) * 4                                       # f32 logits
                + (B * model.vocab_size * 4 if tp > 1 else 0)   # gathered whole for the sampler
                + B * model.vocab_size * 9   # logits controls: int32 counts, seen, f32 result
                # prompt logprobs (mixed steps): a block's f32 logits, whole, and its top-k
                + (2 * min(T, PROMPT_LOGPROBS_BLOCK) * model.vocab_size * 4 if Q > 1 else 0))

    limits = ecfg.scheduler
    # a prompt chunk of the whole budget, or every sequence's decode token
    chunk = step(1, min(limits.max_num_batched_tokens, ecfg.max_model_len))
    decode = step(limits.max_num_seqs, 1)
    return max(chunk, decode)
