"""Pick the kernels an engine runs: resolve KernelConfig's "auto" for the device, load
(building on first use) the C++ CPU kernels when they are picked, and lay the weights out
for them (`prepare_params`: quantised or bf16-copied projections).

Source: vLLM's attention-backend selection (an explicit choice wins; "auto" takes the best
backend the platform supports and falls back with a warning when it cannot be loaded).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax.numpy as jnp

from jaxserve.config import (GPU_PLATFORMS, ConfigError, KernelConfig, resolve_attention_impl,
                             resolve_impl)
from jaxserve.model.layer_loop import slices_projections, stack_layers, why_not_loop
from jaxserve.model.params import Params
from jaxserve.model.weight_layouts import (dual_precision, dual_precision_params, fuse_projections,
                                           pack_ggml_params, quantize_params)
from jaxserve.model.tensor_parallel import shard_params, tp_axis
from jaxserve.model.transformer import Kernels
from jaxserve.distributed.sharding import ShardingRules

log = logging.getLogger(__name__)

# bf16 dot products are used (KernelConfig.bf16_matmul_round_x_min_rows) where they run at
# least this many times the f32 FMA rate in flops (what machines showed: PERFORMANCE.md).
BF16_DOT_MIN_SPEEDUP = 1.5
# the KV pool dtypes each attention kernel reads (XLA's reads any): the C++ kernel and the
# Pallas (Triton) kernels widen bf16 and fp8 e4m3fn in registers and dequantise int8 rows
# (the Mosaic GPU ones read bf16 / f16 pages: narrower pools take the Triton kernels)
CPU_ATTENTION_KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "int8")
PALLAS_ATTENTION_KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8")


def resolve_kernel_config(kcfg: KernelConfig, platform: str, model_dtype: str,
                          quantization: str | None = None) -> KernelConfig:
    """`kcfg` with what "auto" means for the model: a bfloat16 model on CPU with the
    matmul left to "auto" or "cpu" (no weight_quant, no bf16_matmul_min_rows) runs its
    projections and LM head in the C++ bf16 kernel, weights packed as they are
    (bf16_matmul_min_rows = 1; a float32 model's "cpu" packs f32 panels instead:
    layout_params): XLA:CPU widens a bf16 weight to f32 on every matmul, a whole f32
    temporary of the weight each time, where the C++ kernel widens it in registers (PERFORMANCE.md,
    "Tensor parallel"). quantization: Config.quantization; "fp8" quantises the
    projections at load (weight_quant "fp8_e4m3", per output channel, vLLM's dynamic fp8)
    in place of any bf16 copies (bf16_matmul_* cleared, a "cpu" matmul back to "auto").
    fuse_projections None resolves to True on a GPU (jaxserve.model.weight_layouts.
    fuse_projections says why); on CPU it stays None (the C++ kernel's packed copies
    fused, plain XLA weights not). Anything else unchanged."""
    if kcfg.fuse_projections is None and platform in GPU_PLATFORMS:
        kcfg = dataclasses.replace(kcfg, fuse_projections=True)
    if quantization == "fp8":
        kcfg = dataclasses.replace(
            kcfg, weight_quant="fp8_e4m3", weight_quant_group_size=None,
            bf16_matmul_min_rows=None, bf16_matmul_max_rows=None,
            bf16_matmul_round_x_min_rows=None,
            matmul_impl="auto" if kcfg.matmul_impl == "cpu" else kcfg.matmul_impl)
    if (platform == "cpu" and model_dtype == "bfloat16" and kcfg.matmul_impl in ("auto", "cpu")
            and kcfg.weight_quant is None and kcfg.bf16_matmul_min_rows is None):
        return dataclasses.replace(kcfg, bf16_matmul_min_rows=1)
    return kcfg


def select_kernels(kcfg: KernelConfig, platform: str, num_devices: int, kv_dtype: str,
                   build_dir: Path, compute_capability: str | None = None) -> Kernels:
    """The resolved Kernels for `kcfg` on `num_devices` devices of `platform`
    ("cpu", "gpu", ...) of `compute_capability` (a CUDA device's "9.0": "auto" picks the
    Mosaic GPU matmul and attention on Hopper; on any GPU, int8 / fp8 weights of
    weight_quant with per-channel scales go to XLA's dot, measured faster) with a KV pool
    of `kv_dtype`. Picking "cpu" for attention or the bf16 matmuls builds (once, cached
    in `build_dir`) and registers the C++ kernels
    (jaxserve.kernels.cpu.build.load_library, ~5 to 20 s the first time). Under tensor
    parallelism (num_devices > 1) every device runs the attention and matmul kernels on
    its own shard (jaxserve.model.tensor_parallel); the sampler's argmax / log-sum-exp
    ("auto") is the C++ kernel on one CPU device only (its logits are whole there; over
    a mesh they are split over the vocabulary and XLA reduces them).

    Raises ConfigError when "cpu" is asked for explicitly and the kernels cannot be built
    or loaded, when sampling_impl="cpu" meets a mesh, or (attention) the KV pool is of a
    dtype the kernel does not read (CPU_ATTENTION_KV_DTYPES, PALLAS_ATTENTION_KV_DTYPES);
    with "auto" a failed build logs a warning and falls back to "xla", and another pool
    dtype picks XLA attention (logged). bf16_matmul_round_x_min_rows is
    kept (as Kernels.round_x_min_rows) only with the C++ matmul on a CPU whose bf16
    dot-product instruction runs at >= BF16_DOT_MIN_SPEEDUP x the FMA rate (probed here,
    in a few ms). branches "auto" resolves to host_branches on a GPU.
    """
    attention = resolve_attention_impl(kcfg.attention_impl, platform, compute_capability)
    pools = CPU_ATTENTION_KV_DTYPES if attention == "cpu" else PALLAS_ATTENTION_KV_DTYPES
    if attention != "xla" and kv_dtype not in pools:
        if kcfg.attention_impl != "auto":
            raise ConfigError(f"KernelConfig.attention_impl={attention!r} reads a KV pool of "
                              f"{' or '.join(pools)}, kv_dtype is {kv_dtype} (attention_impl "
                              "'xla' reads any)")
        log.warning("attention_impl 'auto': %s attention does not read a %s KV pool; using XLA",
                    attention, kv_dtype)
        attention = "xla"
    matmul = resolve_impl(kcfg.matmul_impl, platform, compute_capability)
    if (kcfg.matmul_impl == "auto" and platform in GPU_PLATFORMS
            and kcfg.weight_quant is not None and kcfg.weight_quant_group_size is None):
        # int8 / fp8 weights quantised per channel at load: XLA's dot of the widened weight
        # (quantized_matmul_xla) decoded faster than both Pallas kernels on an H200
        # (PERFORMANCE.md, "The GPU run of session 27": 1.12x / 1.19x at one stream, 1.28x
        # at 64); GGML blocks and group scales keep the kernels
        matmul = "xla"
    if (kcfg.matmul_impl == "auto" and platform == "cpu"
            and kcfg.bf16_matmul_min_rows is not None):
        matmul = "cpu"
    sampling = kcfg.sampling_impl
    if sampling == "auto":
        sampling = "cpu" if platform == "cpu" and num_devices == 1 else "xla"
    if sampling == "cpu" and num_devices != 1:
        raise ConfigError(f"KernelConfig.sampling_impl='cpu' reads whole logits rows on one "
                          f"device; the mesh has {num_devices} (logits split over the "
                          "vocabulary): use 'xla' or 'auto'")
    chosen = {name: getattr(kcfg, f"{name}_impl")
              for name, impl in (("attention", attention), ("matmul", matmul),
                                 ("sampling", sampling)) if impl == "cpu"}
    if chosen:
        from jaxserve.kernels.cpu.build import KernelBuildError, load_library
        try:
            library = load_library(build_dir)
        except KernelBuildError as e:
            for name, asked in chosen.items():
                if asked != "auto":
                    raise ConfigError(f"KernelConfig.{name}_impl='cpu': {e}") from e
            log.warning("C++ CPU kernels unavailable, using XLA for %s (slower): %s",
                        " and ".join(chosen), e)
            attention = "xla" if attention == "cpu" else attention
            matmul = "xla" if matmul == "cpu" else matmul
            sampling = "xla"
    round_x = kcfg.bf16_matmul_round_x_min_rows
    if round_x is not None and matmul == "cpu":
        from jaxserve.kernels.cpu.bf16_matmul import bf16_dot_speedup
        speedup = bf16_dot_speedup(library)
        if speedup < BF16_DOT_MIN_SPEEDUP:
            log.info("bf16 dot products run at %.2fx the f32 FMA rate here: matmuls keep f32 "
                     "activations", speedup)
            round_x = None
    host_branches = (kcfg.branches == "host" or kcfg.branches == "auto"
                     and platform in GPU_PLATFORMS)
    return Kernels(attention=attention, matmul=matmul, sampling=sampling,
                   round_x_min_rows=round_x if matmul == "cpu" else None,
                   host_branches=host_branches)


def loop_layers(params: Params, setting: bool | None, kernels: Kernels,
                num_devices: int, donate: bool = False) -> tuple[Params, bool]:
    """(params, whether the layers run as a loop): with CompilationConfig.layer_loop None
    ("auto"), params' layers stacked (jaxserve.model.layer_loop) where the C++ attention
    kernel runs on one device, the layers stack and every projection is a packed C++
    kernel weight (read at the layer in place; another would be copied out of the stack
    every step); True: stacked wherever it can run, or ConfigError naming why not (a mesh,
    another attention, layers that do not stack); False: unchanged. The engine then
    allocates a stacked KV pool (init_kv_cache stacked). donate: stack_layers' (the
    engine's packed weights, deleted layer by layer as they are stacked)."""
    if setting is False:
        return params, False
    reason = why_not_loop(params.layers)
    if reason is None and setting is None and slices_projections(params.layers) is not None:
        return params, False  # auto: not where the loop would copy weights every step
    if num_devices > 1:
        reason = f"{num_devices} devices (the loop runs on one, without a mesh)"
    elif kernels.attention.name != "cpu":
        reason = (f"attention {kernels.attention.name!r} (the loop reads the stacked KV pool "
                  "in place only through the C++ kernel)")
    if reason is not None:
        if setting:
            raise ConfigError(f"CompilationConfig.layer_loop=True: {reason}")
        return params, False
    return dataclasses.replace(params, layers=stack_layers(params.layers, donate)), True


def prepare_params(params: Params, kcfg: KernelConfig, kernels: Kernels,
                   rules: ShardingRules | None = None, swiglu_epilogue: bool = True) -> Params:
    """`params` laid out for `kernels` as `kcfg` asks (`layout_params`) and, under a
    tensor-parallel mesh (`rules`), every leaf placed where the model's shard_map reads
    it."""
    params = layout_params(params, kcfg, kernels, rules, swiglu_epilogue)
    if tp_axis(rules) is not None:
        params = shard_params(params, rules)
    return params


def layout_head_matrix(w, kcfg: KernelConfig, kernels: Kernels, rules: ShardingRules | None):
    """A matrix outside the layers, [K, N] (an EAGLE head's fc and fuse: a few MB,
    replicated), in f32 or laid out as the layers' projections are on one device: with the
    C++ matmul's bf16 copies (bf16_matmul_min_rows 1, no max_rows) a packed
    DualPrecisionWeight, run by `Matmul.dense` in the C++ kernel (XLA's f32 dot of the
    f32 matrices of SmolLM2's head took 0.65 ms more of a verify round on an Intel Xeon:
    PERFORMANCE.md, "Verify rounds without drafts"); else the f32 matrix itself (XLA's
    f32 dot), and always under a mesh (`rules`), where the projections' layouts are per
    shard."""
    w = jnp.asarray(w, jnp.float32)
    if (rules is not None or not kernels.matmul.packs_bf16
            or kcfg.bf16_matmul_min_rows != 1 or kcfg.bf16_matmul_max_rows is not None):
        return w
    return dual_precision(w, 1, packed=True, round_x_min_rows=kernels.round_x_min_rows)


def layout_params(params: Params, kcfg: KernelConfig, kernels: Kernels,
                  rules: ShardingRules | None = None, swiglu_epilogue: bool = True) -> Params:
    """`params` laid out for `kernels` as `kcfg` asks: the layers' projections quantised
    (weight_quant: int8 / fp8_e4m3 leaves with their scales; with fuse_projections fused
    first), or given bf16 copies beside
    the f32 weights (bf16_matmul_min_rows: DualPrecisionWeight leaves, packed for the C++
    kernel when kernels.matmul.packs_bf16; fused unless kcfg.fuse_projections is False),
    or, with the C++ matmul and no bf16 copies, the f32 weights themselves packed in its
    f32 panels (projections and LM head, fused alike), or with kcfg.fuse_projections the
    projections that share an input fused (FusedWeight:
    jaxserve.model.weight_layouts.fuse_projections, the GPU default); otherwise
    unchanged. Float32 params for the bf16 copies and the f32 panels (checked by
    jaxserve.config.check_deployment). Under a tensor-parallel
    mesh (`rules`, read for its shapes only: an abstract mesh does) each device's shard
    is laid out on its own (packing and fusion per shard); nothing is placed.
    swiglu_epilogue: with the C++ matmul's fused projections, w_gate | w_up laid out so that
    the kernel computes silu(gate) * up as its epilogue (jaxserve.model.linear.Matmul.swiglu;
    PERFORMANCE.md, "Session 49" under "32 streams on the Zen 4 VM again"); False where the
    gate and up outputs are needed apart (LoRA adapters add to each before the SiLU)."""
    if kcfg.weight_quant is not None:
        if kcfg.fuse_projections:  # fused first: one quantised matrix each
            params = fuse_projections(params, rules)
        params = quantize_params(params, kcfg.weight_quant, kcfg.weight_quant_group_size, rules)
    elif kcfg.bf16_matmul_min_rows is not None:
        params = dual_precision_params(params, kcfg.bf16_matmul_min_rows,
                                       packed=kernels.matmul.packs_bf16,
                                       max_rows=kcfg.bf16_matmul_max_rows,
                                       fuse=kcfg.fuse_projections is not False,
                                       round_x_min_rows=kernels.round_x_min_rows, rules=rules,
                                       swiglu=swiglu_epilogue)
    elif kernels.matmul.packs_bf16:  # matmul_impl "cpu" over the f32 weights themselves
        params = dual_precision_params(params, 1, packed=True,
                                       fuse=kcfg.fuse_projections is not False, rules=rules,
                                       copy_dtype=jnp.float32, swiglu=swiglu_epilogue)
    elif kcfg.fuse_projections:
        params = fuse_projections(params, rules)
    if kernels.matmul.packs_bf16:  # GGUF blocks in the C++ kernel's panels
        params = pack_ggml_params(params, rules, swiglu=swiglu_epilogue)
    return params
