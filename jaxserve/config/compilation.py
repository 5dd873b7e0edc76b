"""The compilation group (CompilationConfig): the padded shapes the jitted step is compiled
for (the shapes themselves, each list ended at its limit, are
jaxserve.worker.compilation.StepShapes')."""

from __future__ import annotations

import dataclasses

from jaxserve.config.kernel import GPU_PLATFORMS
from jaxserve.config.validation import ConfigError


@dataclasses.dataclass(frozen=True)
class CompilationConfig:
    """The padded shapes the jitted step is compiled for (vLLM's CompilationConfig holds the
    CUDA-graph capture sizes, the same idea). None = powers of two up to the limit. The
    limit itself is always the largest bucket, and buckets past it are dropped
    (EngineConfig.seq_buckets / token_buckets / page_counts), so a flag that raises or
    lowers a limit needs no new bucket list.

    Each combination is one compilation at warm-up (jaxserve.worker.compilation.StepShapes):
    fewer buckets start faster and pad more.
    """

    seq_buckets: tuple[int, ...] | None = None
    """Sequences per step (up to max_num_seqs)."""
    token_buckets: tuple[int, ...] | None = None
    """Token rows per mixed step (prompt chunks and decode tokens, packed one sequence after
    another; up to max_num_batched_tokens; a decode step has one row per sequence)."""
    page_buckets: tuple[int, ...] | None = None
    """Block-table pages per sequence (up to max_model_len / page_size), for attention
    implementations whose cost grows with them (jaxserve.worker.compilation)."""
    layer_loop: bool | None = None
    """Run the decoder layers as one loop over their weights stacked [L, ...]
    (jaxserve.model.layer_loop): each compiled step holds one layer's code instead of
    num_layers' (XLA:CPU keeps ~17 MB of kernels per SmolLM2 step shape unrolled) and
    compiles several times faster. None ("auto"): on where the C++ CPU kernels run the
    attention on one device, the layers stack (the same weight types and shapes) and every
    projection is a packed C++ kernel weight (read in place; another would be copied out
    of the stack every step); True: on, or a ConfigError saying why it cannot be; False:
    unrolled."""

    fused_decode: bool | None = None
    """Run a one-token decode step whose rows sample under no structured-output grammar
    as one program (the forward and the sampler: jaxserve.worker.step.model_step)
    instead of two (forward_step, then sample_step): one dispatch a step instead of two.
    The split stays for steps with such a row (the sampler waits for the grammar's
    bitmask, which needs the previous step's tokens), for mixed steps, and, with host
    branches (KernelConfig.branches), for a batch whose sampler plan has logits controls
    or top logprobs. Costs one more compiled program per decode shape (with host
    branches, one per plain sampler plan: jaxserve.sample.plan.FUSED_PLANS). None
    ("auto"): on a GPU, where each dispatch is host time the device may wait for
    (PERFORMANCE.md, "The GPU run of session 27": at decode_steps 1 the sampler's
    dispatch took 0.48 ms of the host's ~5 ms a step, against a 4.8 ms device step);
    off on CPU, where XLA runs a program's first operations on the calling thread, so
    the second dispatch costs no time the device would have used (the same tok/s either
    way: PERFORMANCE.md, "One program for a one-token decode step")."""

    xla_compiler_options: tuple[tuple[str, str], ...] = ()
    """XLA options for every step program the engine compiles, as (name, value) pairs of
    XLA's DebugOptions (passed to `jax.stages.Lowered.compile(compiler_options=...)`, so
    part of the persistent compilation cache's key): e.g.
    (("xla_gpu_enable_command_buffer", ""),) runs XLA:GPU's kernels without CUDA graphs,
    as vLLM's cudagraph_mode NONE, and ("xla_gpu_enable_command_buffer",
    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE") also puts `lax.cond` in
    them, which XLA:GPU otherwise runs by copying the predicate to the host and waiting
    for it. Empty: XLA's defaults. A name or value XLA does not take fails the engine's
    start with a ConfigError naming it. Which options pay is measured
    with `jaxserve bench generate --xla-compiler-options` (PERFORMANCE.md, "The GPU run of
    session 22")."""

    def __post_init__(self):
        if self.fused_decode not in (None, True, False):
            raise ConfigError(f"CompilationConfig.fused_decode must be true, false or None "
                              f"(auto), got {self.fused_decode!r}")
        opts = self.xla_compiler_options
        if not (isinstance(opts, tuple) and all(
                isinstance(o, tuple) and len(o) == 2 and all(isinstance(v, str) for v in o)
                and o[0].startswith("xla_") for o in opts)):
            raise ConfigError("CompilationConfig.xla_compiler_options must be a tuple of "
                              "(name, value) string pairs, each name an XLA option (xla_...), "
                              f"got {opts!r}")
        if len({name for name, _ in opts}) != len(opts):
            raise ConfigError(f"CompilationConfig.xla_compiler_options names an option twice: "
                              f"{opts!r}")
        for name in ("seq_buckets", "token_buckets", "page_buckets"):
            b = getattr(self, name)
            if b is not None:
                b = tuple(sorted(int(x) for x in b))
                if not b or b[0] <= 0:
                    raise ConfigError(f"CompilationConfig.{name} must be positive, got {b}")
                object.__setattr__(self, name, b)

    def resolve(self, platform: str) -> "CompilationConfig":
        """This config with fused_decode None ("auto") chosen for `platform` (a
        jax.Device.platform): on a GPU, off elsewhere (see fused_decode)."""
        if self.fused_decode is not None:
            return self
        return dataclasses.replace(self, fused_decode=platform in GPU_PLATFORMS)
