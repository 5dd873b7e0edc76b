"""Building an engine from a `Config`: fetch or convert the weights, place them on the
mesh, pick the kernels, size the KV page pool, attach the drafter of speculative decoding,
and compile (warm up) the step shapes.

Used by `jaxserve.api.LLM`, `jaxserve serve` and `jaxserve batch`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.checkpoint import is_checkpoint, load_model_config, load_params
from jaxserve.checkpoint.convert import QUANTIZE_FORMATS
from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint
from jaxserve.config import Config, ConfigError, ModelConfig, check_deployment
from jaxserve.distributed.sharding import ShardingRules, make_mesh
from jaxserve.engine.engine import Engine
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.lora import attach_pools
from jaxserve.model.params import PROJECTIONS, dummy_params
from jaxserve.model.pipeline import num_stages, stage_params
from jaxserve.model.tensor_parallel import expand_kv_heads
from jaxserve.spec_decode.draft_model import DraftModel
from jaxserve.spec_decode.eagle import EagleHead, load_head
from jaxserve.tokenization.tokenizer import Tokenizer, placeholder_tokenizer
from jaxserve.worker import compile_events
from jaxserve.worker.kernel_selection import (layout_head_matrix, loop_layers, prepare_params,
                                              resolve_kernel_config, select_kernels)
from jaxserve.worker.device_memory import device_available_bytes, memory_name
from jaxserve.worker.executable_cache import ExecutableCache
from jaxserve.worker.huge_pages import advise_huge_pages
from jaxserve.worker.memory_plan import check_fits, plan_memory
from jaxserve.worker.runner import Runner

log = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: Path) -> None:
    """Persist compiled executables under `cache_dir/xla` so a warm restart skips XLA
    compilation (JAX's persistent compilation cache)."""
    path = Path(cache_dir) / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def build_engine(config: Config, cache_dir: str | Path | None = None,
                 warmup: bool | str = True, compilation_cache: bool = True) -> Engine:
    """Load weights, allocate the KV page pool, compile, and return a ready Engine.

    warmup: True (compile every bucketed step shape before returning), "background"
    (compile the first shapes, the rest on a background thread while the engine serves;
    see Runner.warmup_in_background) or False (compile each shape on first use).

    Fetches/converts the weights on first use (cached under `cache_dir`, default
    ~/.cache/jaxserve). Sizes the KV pool by the memory plan (jaxserve.worker.memory_plan)
    and checks the plan against what the devices have (jaxserve.worker.device_memory)
    before loading anything. Raises ConfigError when the config has no weights, the plan
    does not fit (naming the flag, the bytes asked and available, the largest that
    fits), or the pool cannot hold one max_model_len sequence.
    """
    compile_events.install()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if compilation_cache:
        enable_compilation_cache(cache_dir)
    model_cfg, ckpt = resolve_model_config(config, cache_dir)
    rules = None
    if config.parallel.num_devices > 1:
        rules = ShardingRules(make_mesh(config.parallel))
        log.info("tensor parallel %d x pipeline parallel %d over %s devices",
                 config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size,
                 rules.mesh.devices.flat[0].platform)
    platform = (rules.mesh.devices.flat[0] if rules else jax.devices()[0]).platform
    ecfg = dataclasses.replace(config.engine, kernels=resolve_kernel_config(
        config.engine.kernels, platform, model_cfg.dtype, config.quantization),
        scheduler=config.engine.scheduler.resolve(platform),
        compilation=config.engine.compilation.resolve(platform))
    check_deployment(ecfg, model_cfg, config.parallel)
    kv_dtype = ecfg.cache.kv_dtype(model_cfg.dtype)
    # the memory plan against what the devices really have, before anything is allocated
    devices = list(rules.mesh.local_devices) if rules else [jax.devices()[0]]
    device_bytes = device_available_bytes(devices)
    plan = plan_memory(config.replace(engine=ecfg), model_cfg, platform, device_bytes)
    check_fits(plan, device_bytes, memory_name(platform, len(devices)))
    num_pages = plan.kv_pages
    kernels = select_kernels(ecfg.kernels, platform, config.parallel.num_devices,
                             str(jnp.dtype(kv_dtype)), cache_dir / "kernels",
                             getattr(devices[0], "compute_capability", None))
    if config.load_format == "dummy":
        raw = dummy_params(model_cfg, rules)
    else:
        raw = load_params(ckpt, model_cfg, rules)
    if config.tokenizer is not None:
        tokenizer = Tokenizer.from_dir(config.tokenizer)
    elif ckpt is not None:
        tokenizer = Tokenizer.from_dir(ckpt)
    else:
        log.warning("no tokenizer: a placeholder over the %d ids serves the dummy weights "
                    "(text in bytes; give --tokenizer DIR for the model's own)", model_cfg.vocab_size)
        tokenizer = placeholder_tokenizer(model_cfg.vocab_size, model_cfg.bos_token_id,
                                          model_cfg.eos_token_ids)
    page_size = ecfg.cache.page_size
    spec = ecfg.speculative
    layout = kernels.attention.kv_layout
    # a drafter (speculative decoding with a draft model or head): a function making
    # (drafter, its params, its cache) for a pool of n pages
    make_draft = None
    if spec is not None and spec.method == "draft_model":
        make_draft = _draft_model(spec, model_cfg, tokenizer, config.dtype, rules, ecfg,
                                  kernels, kv_dtype, layout)
    elif spec is not None and spec.method == "eagle":
        make_draft = _eagle_head(spec, model_cfg, raw, rules, ecfg, kernels, kv_dtype, layout)
    # fewer KV heads than devices: each repeated over the devices that read it (the
    # drafters above expand their own from the loaded shapes)
    adapter_cfg = model_cfg  # the shape LoRA adapters are trained for
    raw, model_cfg = expand_kv_heads(raw, model_cfg, config.parallel.tensor_parallel_size)
    # (LoRA adds to the gate and up outputs apart: no SwiGLU epilogue under it)
    params = prepare_params(raw, ecfg.kernels, kernels, rules,
                            swiglu_epilogue=not ecfg.lora.enable_lora)
    del raw
    if ecfg.lora.enable_lora:  # zeroed adapter slots in every layer (jaxserve.model.lora)
        params = attach_pools(params, model_cfg, ecfg.lora, rules)
    if config.parallel.pipeline_parallel_size > 1:  # loaded on their stages: stack them
        params = stage_params(params, rules, config.parallel.microbatches,
                              config.parallel.pipeline_decode_microbatches, donate=True)
    # the layers as one loop over their stacked weights, where it runs (one device, C++ kernels)
    params, looped = loop_layers(params, ecfg.compilation.layer_loop, kernels,
                                 config.parallel.num_devices, donate=True)
    # the drafter's pool has the same pages: one page costs both (the plan counts it so)
    cache = init_kv_cache(model_cfg, num_pages, page_size, kv_dtype, rules, layout,
                          stacked=looped)
    draft = make_draft(num_pages) if make_draft else None
    if ecfg.kernels.cpu_huge_pages and platform == "cpu":
        t0 = time.perf_counter()
        # the pools hold zeros until the first step: dropped, not copied
        huge = advise_huge_pages((params, draft[1] if draft else None),
                                 zeros=(cache, draft[2] if draft else None))
        log.info("huge pages: %.0f MiB of weights and KV pool in %.2f s", huge / 2**20,
                 time.perf_counter() - t0)
    # a CPU follower process compiles through a cache of its own: JAX's serves process 0
    # only, its key hashing the topology each process sees (on GPUs JAX strips the device
    # assignment from its key for multi-process programs: not measured there yet)
    executable_cache = None
    if compilation_cache and jax.process_index() > 0 and platform == "cpu":
        executable_cache = ExecutableCache(
            cache_dir / "xla" / "followers" / f"process-{jax.process_index()}",
            rules.mesh.devices.flat if rules else [jax.devices()[0]])
        log.info("step programs kept in %s", executable_cache.directory)
    runner = Runner(model_cfg, ecfg, params, cache, kernels, rules, draft=draft,
                    executable_cache=executable_cache)
    engine = Engine(model_cfg, ecfg, runner, tokenizer, adapter_cfg)
    log.info("KV page pool: %d pages of %d tokens (%.0f MiB%s, sized by %s); %.2f GiB per "
             "device planned of %.2f GiB available", num_pages, page_size,
             num_pages * plan.page_bytes_total / 2**20,
             ", the drafter's pages included" if draft else "", plan.kv_sized_by,
             plan.total / 2**30, device_bytes / 2**30)
    if warmup == "background":
        runner.warmup_in_background()
    elif warmup:
        runner.warmup()
    return engine


# Dummy weights of a config's shape under --quantization: int8 / int4 the formats `jaxserve
# convert` quantises a float source to (int4's mix is SmolLM2's file's too: Q4_1
# projections, Q8_0 embedding and head, so it stands for gguf); gptq / awq /
# compressed-tensors 4-bit projections as each method's default checkpoints hold them (GPTQ
# and compressed-tensors symmetric: Q4_0; AWQ with zero points: Q4_1), embedding and head
# floats.
DUMMY_FORMATS = {q: (("embed", f["embed"]), ("lm_head", f["lm_head"]))
                 + tuple((n, f["layers"]) for n in PROJECTIONS)
                 for q, f in QUANTIZE_FORMATS.items()}
DUMMY_FORMATS |= {"gguf": DUMMY_FORMATS["int4"],
                  "gptq": tuple((n, "q4_0") for n in PROJECTIONS),
                  "compressed-tensors": tuple((n, "q4_0") for n in PROJECTIONS),
                  "awq": tuple((n, "q4_1") for n in PROJECTIONS)}


def resolve_model_config(config: Config, cache_dir: Path) -> tuple[ModelConfig, Path | None]:
    """The served model's shape and its checkpoint (None for dummy weights of a config
    that gives the shape): the source's checkpoint config, with Config.dtype and
    Config.num_layers applied. Raises ConfigError when there are no weights to load, or
    num_layers exceeds the model's."""
    ckpt = None
    if config.source is not None and (config.load_format == "auto" or config.model is None):
        ckpt = resolve_checkpoint(config.source, cache_dir, config.quantization)
    elif config.load_format == "auto":
        raise ConfigError(
            f"Config {config.name!r} has no weights: give --model PATH (a Hugging Face "
            "directory with safetensors, a .gguf file or a jaxserve checkpoint from "
            "`jaxserve convert`; or name it in the config's `source`), or "
            "--load-format dummy for random weights (benchmarks, tests)")
    model_cfg = load_model_config(ckpt) if ckpt is not None else config.model
    if config.quantization in DUMMY_FORMATS and not model_cfg.weight_formats:  # dummy weights
        model_cfg = model_cfg.replace(weight_formats=tuple(
            (n, f) for n, f in DUMMY_FORMATS[config.quantization]
            if not (n == "lm_head" and model_cfg.tie_word_embeddings)))
    if config.dtype is not None:
        model_cfg = model_cfg.replace(dtype=config.dtype)
    if config.num_layers is not None:
        if config.num_layers > model_cfg.num_layers:
            raise ConfigError(f"Config.num_layers={config.num_layers} exceeds the model's "
                              f"{model_cfg.num_layers} layers")
        model_cfg = model_cfg.replace(num_layers=config.num_layers)
    return model_cfg, ckpt


def _draft_model(spec, target: ModelConfig, tokenizer: Tokenizer, dtype: str | None,
                 rules: ShardingRules | None, ecfg, kernels, kv_dtype, layout):
    """make(num_pages) -> (drafter, params, cache) of a draft model."""
    cfg, params = _load_draft(Path(spec.model), target, tokenizer, dtype, rules, ecfg, kernels)
    page_size = ecfg.cache.page_size

    def make(n):
        return (DraftModel(cfg), params,
                init_kv_cache(cfg, n, page_size, kv_dtype, rules, layout))
    return make


def _eagle_head(spec, target: ModelConfig, target_params, rules: ShardingRules | None,
                ecfg, kernels, kv_dtype, layout):
    """make(num_pages) -> (drafter, params, cache) of an EAGLE head: its layer's K/V and
    the target's f32 feature of each token slot."""
    cfg, head, feature_layers = load_head(spec.model, target, target_params)
    if feature_layers and rules is not None and num_stages(rules) > 1:
        raise ConfigError(f"SpeculativeConfig.model: {spec.model} fuses the features of "
                          f"layers {list(feature_layers)}, which pipeline parallelism keeps "
                          "on their own stages: use a head reading the final hidden state")
    tp = rules.mesh.size if rules is not None else 1
    body, cfg = expand_kv_heads(head.body, cfg, tp)
    head = dataclasses.replace(head, body=body)
    # on a mesh: the head's layer split like the model's, its fc, fuse, draft vocabulary
    # and feature pool replicated (a few MB); fc and fuse in f32 (not converted again at
    # every call), or on one device in the layers' packed bf16 layout (layout_head_matrix)
    rep = NamedSharding(rules.mesh, PartitionSpec()) if rules is not None else None

    def matrix(a):
        return None if a is None else jax.device_put(
            layout_head_matrix(a, ecfg.kernels, kernels, rules), rep)

    head = dataclasses.replace(head, body=prepare_params(head.body, ecfg.kernels, kernels, rules),
                               fc=matrix(head.fc), vocab=jax.device_put(head.vocab, rep),
                               fuse=matrix(head.fuse))
    page_size, D = ecfg.cache.page_size, target.hidden_size

    def make(n):
        feats = jnp.zeros((n * page_size, D), jnp.float32, device=rep)
        return (EagleHead(cfg, feature_layers), head,
                (init_kv_cache(cfg, n, page_size, kv_dtype, rules, layout), feats))
    return make


def _load_draft(path: Path, target: ModelConfig, tokenizer: Tokenizer, dtype: str | None,
                rules: ShardingRules | None, ecfg, kernels):
    """The draft model of speculative decoding ("draft_model"): a jaxserve checkpoint at
    `path` with the target's vocabulary (its token ids must mean the same tokens), served
    in the target's dtype override and with the same kernels. Returns (ModelConfig,
    prepared Params). Raises ConfigError naming SpeculativeConfig.model when it is not a
    checkpoint or its tokenizer differs."""
    if not is_checkpoint(path):
        raise ConfigError(f"SpeculativeConfig.model: {path} is not a jaxserve checkpoint "
                          "(convert one with `jaxserve convert`)")
    cfg = load_model_config(path)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    if cfg.vocab_size != target.vocab_size or (
            Tokenizer.from_dir(path).backend.get_vocab() != tokenizer.backend.get_vocab()):
        raise ConfigError(f"SpeculativeConfig.model: {path} has another tokenizer than the "
                          f"target (vocabulary {cfg.vocab_size} vs {target.vocab_size}); a draft "
                          "model must share the target's")
    params, cfg = expand_kv_heads(load_params(path, cfg, rules), cfg,
                                  rules.mesh.size if rules is not None else 1)
    return cfg, prepare_params(params, ecfg.kernels, kernels, rules)
