"""The kernels' group (KernelConfig): which implementation computes attention, the matmuls
and the sampler's reductions, and the weight layouts they read; the implementation names
and what "auto" resolves to on a platform (resolve_impl, resolve_attention_impl)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.validation import ConfigError

# Kernel implementations: "xla" (plain jnp), "pallas" (the Triton-backend Pallas kernels of
# `jaxserve/kernels/pallas/`, the GPU default), "pallas_interpret" (the same kernels in Pallas
# interpret mode on CPU: tests), and "cpu": the C++ kernels of `jaxserve/kernels/cpu/` (XLA FFI,
# compiled on first use; the default on a single CPU device) for attention and for the
# bf16 weight copies of bf16_matmul_min_rows.
# The quantised matmul and attention (decode and prefill) also have Mosaic GPU kernels for
# Hopper (sm_90: TMA + wgmma): "pallas_mosaic" (falling back to the Triton kernels for shapes
# and dtypes they do not take) and "pallas_mosaic_interpret" (Mosaic GPU interpret mode on
# CPU: tests).
# The Triton quantised and GGML-block matmuls also have GEMVs on the CUDA cores for matmuls
# of a few rows (their `gemv` "reduce_magic" / "reduce", single-stream decode): "pallas_gemv"
# / "pallas_gemv_interpret" run them there and the tiled dots elsewhere; not measured on a
# GPU yet, so no "auto" picks them (jaxserve/kernels/pallas/README.md).
KERNEL_IMPLS = ("xla", "pallas", "pallas_interpret")
MOSAIC_KERNEL_IMPLS = ("pallas_mosaic", "pallas_mosaic_interpret")
GEMV_KERNEL_IMPLS = ("pallas_gemv", "pallas_gemv_interpret")
ATTENTION_KERNEL_IMPLS = KERNEL_IMPLS + ("cpu",) + MOSAIC_KERNEL_IMPLS
ATTENTION_IMPLS = ("auto",) + ATTENTION_KERNEL_IMPLS
MATMUL_KERNEL_IMPLS = KERNEL_IMPLS + ("cpu",) + MOSAIC_KERNEL_IMPLS + GEMV_KERNEL_IMPLS
MATMUL_IMPLS = ("auto",) + MATMUL_KERNEL_IMPLS
SAMPLING_IMPLS = ("auto", "xla", "cpu")
BRANCHES = ("auto", "device", "host")
WEIGHT_QUANT_FORMATS = ("int8", "fp8_e4m3")
# what jax.Device.platform says for a GPU
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def is_hopper(compute_capability: str | None) -> bool:
    """Whether a CUDA device's compute capability ("9.0", a JAX device's
    `compute_capability`; None elsewhere) is Hopper's, the one the Mosaic GPU kernels'
    wgmma runs on (Blackwell, "10.x", has no wgmma)."""
    return compute_capability is not None and compute_capability.split(".")[0] == "9"


def resolve_impl(impl: str, platform: str, compute_capability: str | None = None) -> str:
    """The matmul implementation `impl` ("auto" or one of MATMUL_KERNEL_IMPLS) stands for on
    a device `platform` ("cpu", "gpu"/"cuda", "tpu") of `compute_capability` (CUDA's
    "9.0"; None if unknown): "auto" -> "pallas_mosaic" on a Hopper GPU, "pallas" (Triton)
    on other GPUs, else "xla" (jaxserve.worker.kernel_selection.select_kernels then picks
    "cpu" for bf16 weight copies)."""
    if impl != "auto":
        return impl
    if platform in ("gpu", "cuda", "rocm"):
        return "pallas_mosaic" if is_hopper(compute_capability) else "pallas"
    return "xla"


def resolve_attention_impl(impl: str, platform: str, compute_capability: str | None = None
                           ) -> str:
    """The attention implementation `impl` ("auto" or one of ATTENTION_KERNEL_IMPLS) stands
    for on a device `platform` of `compute_capability` (as resolve_impl): "auto" ->
    "pallas_mosaic" on a Hopper GPU, "pallas" (Triton) on other GPUs, "cpu" on CPU (under
    tensor parallelism each device runs it on its own heads), else "xla". Whether "cpu"
    can be built is checked where it is loaded
    (jaxserve.worker.kernel_selection.select_kernels)."""
    if impl != "auto":
        return impl
    if platform == "cpu":
        return "cpu"
    return resolve_impl(impl, platform, compute_capability)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which kernels compute the step, and the weight layouts they read
    (jaxserve.worker.kernel_selection.select_kernels turns it into a Kernels backend)."""

    attention_impl: str = dataclasses.field(default="auto",
                                            metadata={"choices": ATTENTION_IMPLS})
    """The attention kernel: "auto" (on a GPU: pallas_mosaic on Hopper, pallas elsewhere; cpu
    on CPU), "xla", "cpu" (the C++ kernel of jaxserve/kernels/cpu/, per device under TP),
    "pallas", "pallas_interpret" (Triton), "pallas_mosaic", "pallas_mosaic_interpret"
    (the Mosaic GPU decode and prefill kernels for Hopper where they take the dtypes and
    shapes, the Triton kernels otherwise) (see ATTENTION_KERNEL_IMPLS)."""
    matmul_impl: str = dataclasses.field(default="auto", metadata={"choices": MATMUL_IMPLS})
    """The matmul kernel: "auto" (on a GPU: pallas_mosaic on Hopper, pallas elsewhere, except
    that weight_quant's int8 / fp8 weights with per-channel scales run XLA's dot of the
    widened weight, measured faster on an H200 (PERFORMANCE.md, "The GPU run of session
    27"); on CPU
    "cpu" when bf16_matmul_min_rows is set or the model is bfloat16 (then
    bf16_matmul_min_rows resolves to 1: its weights packed for the C++ kernel as they are,
    jaxserve.worker.kernel_selection.resolve_kernel_config); xla otherwise), "xla",
    "pallas", "pallas_interpret" (the quantised projections of weight_quant, Triton),
    "pallas_mosaic", "pallas_mosaic_interpret" (the same in the Mosaic GPU kernel for
    Hopper, the Triton one for shapes it does not take), "pallas_gemv",
    "pallas_gemv_interpret" (the Triton kernels with their CUDA-core GEMVs for matmuls of
    at most 4 rows: single-stream decode), "cpu" (the bf16 weight copies of
    bf16_matmul_min_rows in the C++ kernel of jaxserve/kernels/cpu/, AVX512-BF16 where the
    CPU has it; without bf16_matmul_min_rows, a float32 model's own weights packed in the
    kernel's f32 panels, every row count in one path of f32 FMAs, so a row's result never
    depends on the rows beside it; a bfloat16 model's packed as they are)."""
    sampling_impl: str = dataclasses.field(default="auto", metadata={"choices": SAMPLING_IMPLS})
    """What computes each row's argmax and log-sum-exp over the vocabulary for the sampler
    (greedy tokens, logprobs): "auto" ("cpu" on one CPU device, xla otherwise), "xla",
    "cpu" (the C++ kernel of jaxserve/kernels/cpu/)."""
    branches: str = dataclasses.field(default="auto", metadata={"choices": BRANCHES})
    """Who decides which branches of the sampler a step runs (greedy or not, filters,
    logits controls, top logprobs; jaxserve.sample.plan): "device" (a `lax.cond` in the
    program: one program per shape), "host" (the engine, from the batch's parameters:
    one program per shape and plan, all compiled at warm-up; no conditional in a decode
    step), "auto": "host" on a GPU, where XLA waits on the host at every conditional,
    "device" elsewhere (XLA:CPU runs one in place)."""
    fuse_projections: bool | None = None
    """Store the projections that share an input as one matrix (wq | wk | wv, w_gate |
    w_up: jaxserve.model.weight_layouts.FusedWeight), so each runs as one matmul, as
    vLLM's QKVParallelLinear does. None ("auto"): fused on a GPU (XLA:GPU runs a one-row
    product by a small matrix, such as Llama-3-8B's K and V projections, as a multiply
    and a reduction at a fifth of the bandwidth of a GEMM: PERFORMANCE.md, "The GPU
    run of session 24") and for the C++ CPU kernel's packed bf16 copies; plain XLA
    weights on CPU unfused. True: fused wherever the weights are plain float arrays or
    packed bf16 copies, and before weight_quant quantises them (one quantised matrix
    each); False: never. GGUF-block weights are not fused."""
    weight_quant: str | None = dataclasses.field(default=None,
                                                 metadata={"choices": WEIGHT_QUANT_FORMATS})
    """None (weights in the model dtype), "int8" or "fp8_e4m3": the layers' projection
    matrices are quantised at load with per-output-channel scales (or, for int8, per-group
    scales of weight_quant_group_size input rows); embeddings, norms and the LM head stay
    in the model dtype."""
    weight_quant_group_size: int | None = None
    """None (per-output-channel scales), or with weight_quant "int8": input rows that share
    one scale (a power of two >= 16)."""
    bf16_matmul_min_rows: int | None = None
    """None (every matmul in the model dtype), or for float32 models: matmuls over at least
    this many activation rows (B x Q for the projections, B for the LM head) use a bf16
    copy of the weights with f32 accumulation, smaller ones the f32 weights
    (jaxserve.model.weight_layouts.DualPrecisionWeight; 1.5x weight memory). Pick it by
    measurement: jaxserve bench step. Not with weight_quant. For bfloat16 models only 1
    (no bf16_matmul_max_rows): the weights themselves, repacked."""
    bf16_matmul_max_rows: int | None = None
    """None, or with bf16_matmul_min_rows: matmuls over more rows than this use the f32
    weights again (jaxserve bench step --compare matmul suggests both)."""
    cpu_huge_pages: bool = True
    """On CPU (Linux), back the weights and the KV page pool with transparent huge pages
    once they are loaded (jaxserve.worker.huge_pages: madvise MADV_HUGEPAGE and
    MADV_COLLAPSE; a hint Linux may refuse). The kernels stream both from DRAM every step,
    through a TLB miss every 4 KiB otherwise. False: leave them as the allocator gave
    them."""
    bf16_matmul_round_x_min_rows: int | None = None
    """None, or with the C++ bf16 matmul (matmul_impl "cpu"): matmuls over at least this
    many rows round the activations to bf16 and sum with the CPU's bf16 dot-product
    instructions (AMX tiles where the CPU has AMX-BF16, else AVX512-BF16 vdpbf16ps; f32
    accumulation), where the start-up probe finds
    it faster than f32 FMAs (jaxserve.worker.kernel_selection.BF16_DOT_MIN_SPEEDUP; else
    ignored). The products are those of HF transformers' and llama.cpp's bf16 paths."""

    def __post_init__(self):
        for name, allowed in (("attention_impl", ATTENTION_IMPLS), ("matmul_impl", MATMUL_IMPLS),
                              ("sampling_impl", SAMPLING_IMPLS), ("branches", BRANCHES)):
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
        elif self.matmul_impl == "cpu" and self.weight_quant is not None:
            raise ConfigError("KernelConfig.matmul_impl='cpu' multiplies float weights (f32 "
                              "panels or bf16 copies); weight_quant's int8 / fp8 weights have "
                              "no C++ kernel: use matmul_impl 'auto' or 'xla'")
        g = self.weight_quant_group_size
        if g is not None:
            if self.weight_quant != "int8":
                raise ConfigError("KernelConfig.weight_quant_group_size needs weight_quant='int8' "
                                  f"(fp8 is per-channel only), got weight_quant={self.weight_quant!r}")
            if g < 16 or g & (g - 1):
                raise ConfigError(f"KernelConfig.weight_quant_group_size must be a power of two "
                                  f">= 16, got {g}")
