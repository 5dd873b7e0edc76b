"""The device mesh's group (ParallelConfig), and check_deployment: what an EngineConfig
needs of the model and the mesh."""

from __future__ import annotations

import dataclasses

from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.config.validation import ConfigError, _positive


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device mesh (vLLM's ParallelConfig): `tensor_parallel_size` devices on the `model`
    axis (Megatron-style: attention heads, MLP columns and the vocabulary split; the
    output projections reduce), times `pipeline_parallel_size` on the `stage` axis (the
    decoder layers split into that many consecutive stages, jaxserve.model.pipeline).

    A step whose rows (sequences, for decode) the microbatch count does not divide takes
    the largest divisor below it.

    There is no data-parallel size: replicas of a model that fits on fewer devices are
    separate servers behind a load balancer (one scheduler each), not a mesh axis that
    would only hold copies of the weights."""

    tensor_parallel_size: int = 1
    """Devices the model is split over on the `model` axis, Megatron-style."""
    pipeline_parallel_size: int = 1
    """Pipeline stages the decoder layers are split into, each on its own tensor-parallel
    group (the `stage` axis)."""
    pipeline_microbatches: int | None = None
    """How many microbatches a prefill / mixed step's tokens are split into so that the
    stages work at once (stage utilisation M / (M + PP - 1), less what smaller
    microbatches cost); None = 2 x the stages."""
    pipeline_decode_microbatches: int = 1
    """The same for decode steps; default 1. A decode step reads every stage's weights
    once per tick whatever its rows, so splitting it adds ticks that cost as much as whole
    ones (measured with tools/measure_pipeline.py, PERFORMANCE.md "Pipeline parallel");
    raise it for decode batches large enough to be compute-bound."""

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
    weight copies need float32 weights, or bfloat16 ones used for every row count; GGUF
    block weights are not re-quantised, and split over devices in whole blocks."""
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
    if model.weight_formats and k.weight_quant is not None:
        raise ConfigError(f"KernelConfig.weight_quant={k.weight_quant!r} re-quantises float "
                          "weights; this model's are GGUF blocks (--quantization gguf): "
                          "leave weight_quant unset")
    if model.weight_formats and tp > 1:
        from jaxserve.config.model import BLOCK_SIZE
        for name, width in (("wo", H * model.head_dim), ("w_down", model.intermediate_size)):
            if H % tp == 0 and (width // tp) % BLOCK_SIZE:
                raise ConfigError(f"ParallelConfig.tensor_parallel_size={tp}: each device's "
                                  f"{width // tp} input columns of {name} are not whole "
                                  f"{BLOCK_SIZE}-wide GGUF blocks")
    pp = parallel.pipeline_parallel_size
    per_layer = [n for n, _ in model.weight_formats if n.startswith("layers.")]
    if pp > 1 and per_layer:
        raise ConfigError(f"ParallelConfig.pipeline_parallel_size={pp} stacks the layers of a "
                          f"stage, which needs every layer in the same format; this model's "
                          f"{per_layer[0]} is stored in another block format than its peers")
    if pp > model.num_layers:
        raise ConfigError(f"ParallelConfig.pipeline_parallel_size={pp} exceeds the model's "
                          f"{model.num_layers} layers (each stage needs at least one)")
    if pp > 1 and engine.lora.enable_lora:
        raise ConfigError("LoRA adapters (enable_lora) are not served with pipeline stages: "
                          "set pipeline_parallel_size=1 (tensor parallelism splits them)")
    if pp > 1 and engine.speculative is not None:
        raise ConfigError("speculative decoding (EngineConfig.speculative_config) does not run "
                          "with pipeline stages yet: set pipeline_parallel_size=1")
