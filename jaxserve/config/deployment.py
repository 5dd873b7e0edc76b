"""A whole deployment (Config: the model, its weights, the engine, the mesh, the server),
what a config file binds to `CONFIG`; LOAD_FORMATS."""

from __future__ import annotations

import dataclasses

from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig, ModelSource
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.server import ServerConfig
from jaxserve.config.validation import ConfigError

LOAD_FORMATS = ("auto", "dummy")
# Config.quantization's values (vLLM's --quantization names where vLLM has them): None,
# "gguf" (a GGUF file's blocks), a weight-only quantised Hugging Face checkpoint's method,
# or a float source's weights quantised by jaxserve: "int8" / "int4" into GGML blocks when
# converted, "fp8" (e4m3, per output channel) when loaded
HF_QUANTIZATIONS = ("gptq", "awq", "compressed-tensors")
CONVERTED_QUANTIZATIONS = ("int8", "int4", "int4_g64", "int4_g128")
QUANTIZATIONS = ("gguf",) + HF_QUANTIZATIONS + CONVERTED_QUANTIZATIONS + ("fp8",)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole deployment: what `configs/NAME.py` binds to `CONFIG`."""

    name: str
    """The config's name; the served model's name unless served_model_name is given."""
    source: ModelSource | None = None
    """Where the weights come from; on the command line `--model PATH`: a local Hugging
    Face directory, .gguf file or jaxserve checkpoint
    (jaxserve.checkpoint.sources.source_from_path). None: a config that gives `model`,
    served with dummy weights (load_format)."""
    model: ModelConfig | None = None
    """Given for configs whose shape is known without weights (memory planning of 70B on a
    laptop); otherwise it is read from the checkpoint."""
    engine: EngineConfig = EngineConfig()
    """The serving engine's settings."""
    parallel: ParallelConfig = ParallelConfig()
    """The device mesh."""
    served_model_name: str | None = None
    """The model name the API serves (/v1/models, requests' `model`); None = name."""
    dtype: str | None = None
    """Overrides the dtype the weights are served in (None = the checkpoint's)."""
    host: str = "127.0.0.1"
    """Where `serve.py` listens: the address."""
    port: int = 8000
    """Where `serve.py` listens: the port."""
    server: ServerConfig = ServerConfig()
    """The server's per-request limits."""
    load_format: str = dataclasses.field(default="auto", metadata={"choices": LOAD_FORMATS})
    """The weights: "auto" (those of `source`) or "dummy" (vLLM's name: random weights made
    on the devices, already sharded, in the shape of `model` or of the source's
    checkpoint; for benchmarks and tests; outputs are meaningless)."""
    quantization: str | None = dataclasses.field(default=None, metadata={"choices": QUANTIZATIONS})
    """How the weights are served quantised (vLLM's --quantization, -q): None (as the
    source converts by default: a GGUF file dequantised to `dtype`; a quantised Hugging
    Face directory in its own method, as vLLM detects it; a checkpoint as it was
    converted); "gguf" (a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices served in their own
    blocks, jaxserve.model.ggml_weight: the source a .gguf file or a checkpoint converted
    with `jaxserve convert --quantization gguf`); "gptq", "awq", "compressed-tensors" (a
    Hugging Face directory quantised so, which it must be: its int4 / int8 codes served as
    GGML blocks, jaxserve.checkpoint.hf_quantized); "int8" / "int4" (a float source's
    matrices quantised when converted, llama.cpp's Q8_0 / Q4_1 blocks of 32:
    jaxserve.checkpoint.convert.QUANTIZE_FORMATS; "int4_g64" / "int4_g128": int4 with a
    scale and minimum per 64 / 128 inputs, GPTQ / AWQ's usual group, in the same blocks);
    or "fp8" (its projections quantised
    when loaded to float8_e4m3fn with one scale per output channel, vLLM's dynamic fp8:
    KernelConfig.weight_quant "fp8_e4m3", the Pallas kernels on a GPU, XLA's reference
    elsewhere)."""
    num_layers: int | None = None
    """Serve only the first N decoder layers (None = all): a deep config made cheap for
    tests (with real weights, the first N layers of the checkpoint)."""
    tokenizer: str | None = None
    """A directory with tokenizer.json (vLLM's `--tokenizer`); None = the checkpoint's, or
    with dummy weights and no source a placeholder tokenizer over the vocabulary
    (jaxserve.tokenization.tokenizer.placeholder_tokenizer)."""

    def __post_init__(self):
        if self.source is None and self.model is None:
            raise ConfigError(f"Config {self.name!r}: give a source (weights) or a model shape")
        if not (0 < self.port < 65536):
            raise ConfigError(f"Config.port must be in 1..65535, got {self.port}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"Config.load_format must be one of {LOAD_FORMATS}, "
                              f"got {self.load_format!r}")
        if self.quantization not in (None,) + QUANTIZATIONS:
            raise ConfigError(f"Config.quantization must be None or one of {QUANTIZATIONS}, "
                              f"got {self.quantization!r}")
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
