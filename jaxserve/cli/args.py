"""Command-line flags shared by `jaxserve serve` and `jaxserve batch`: the model, the
parallel layout and the engine settings, with vLLM's spellings, and how they override a
config file's Config."""

from __future__ import annotations

import argparse

from jaxserve.config import LOAD_FORMATS, Config, EngineConfig
from jaxserve.checkpoint.sources import source_from_path


# Flags (vLLM's spellings) that set EngineConfig fields (EngineConfig.override).
ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "enable_chunked_prefill", "enable_prefix_caching", "kv_cache_memory_bytes",
                "gpu_memory_utilization", "speculative_config", "max_logprobs",
                "max_logit_bias")


def engine_config(base: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """The config's EngineConfig with the engine flags given on the command line."""
    return base.override(**{name: getattr(args, name) for name in ENGINE_FLAGS
                            if getattr(args, name) is not None})


def deployment_overrides(args: argparse.Namespace) -> dict:
    """Config.override fields from the model / load / parallel flags that were given."""
    given = {name: getattr(args, name) for name in
             ("load_format", "num_layers", "tokenizer", "tensor_parallel_size",
              "pipeline_parallel_size", "pipeline_microbatches",
              "pipeline_decode_microbatches")
             if getattr(args, name) is not None}
    if args.model is not None:
        given["source"] = source_from_path(args.model)
    return given


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    """--model, --tokenizer, --load-format, --num-layers and the parallel layout flags."""
    ap.add_argument("--model", help="weights to serve: a local Hugging Face directory, .gguf "
                                    "file or jaxserve checkpoint (default: the config's source)")
    ap.add_argument("--tokenizer", help="a directory with tokenizer.json (default: the model's)")
    ap.add_argument("--load-format", choices=LOAD_FORMATS,
                    help="'dummy': random weights made on the devices, for benchmarks and "
                         "tests (default 'auto': the model's weights)")
    ap.add_argument("--num-layers", type=int,
                    help="serve only the first N decoder layers (tests of deep configs)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int,
                    help="devices the model is split over, Megatron-style (default: the config's)")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int,
                    help="pipeline stages the decoder layers are split into, each on its own "
                         "tensor-parallel group (default: the config's)")
    ap.add_argument("--pipeline-microbatches", type=int,
                    help="microbatches a pipelined prefill / mixed step is split into "
                         "(default: 2 x the stages)")
    ap.add_argument("--pipeline-decode-microbatches", type=int,
                    help="microbatches a pipelined decode step is split into (default 1)")


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    """The EngineConfig flags of ENGINE_FLAGS."""
    ap.add_argument("--max-model-len", type=int,
                    help="most tokens (prompt + output) of one request (default: the config's)")
    ap.add_argument("--max-num-seqs", type=int,
                    help="most requests running at once (default: the config's)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="token rows one step computes: decode tokens first, then prompt "
                         "chunks (default: the config's)")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                    default=None, help="split long prompts across steps (default: the config's, on)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None, help="reuse the KV pages of earlier prompts with the same "
                                       "prefix (default: the config's, on)")
    ap.add_argument("--kv-cache-memory-bytes", type=int,
                    help="device memory for the KV page pool, bytes (default: the config's)")
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="with a config whose kv_cache_memory_bytes is None: the fraction of "
                         "each device's memory the engine may use (default 0.9)")
    ap.add_argument("--speculative-config",
                    help="speculative decoding, vLLM's JSON object, e.g. '{\"method\": "
                         "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": "
                         "4, \"prompt_lookup_min\": 2}' (default: the config's, off)")
    ap.add_argument("--max-logprobs", type=int,
                    help="most top logprobs a request may ask for per token (default: the "
                         "config's, 20)")
    ap.add_argument("--max-logit-bias", type=int,
                    help="most logit_bias entries one request may send (default: the "
                         "config's, 300)")


def apply_flags(config: Config, args: argparse.Namespace) -> Config:
    """`config` with the model and engine flags that were given (add_model_flags,
    add_engine_flags). Raises ConfigError (or CheckpointError for --model) naming a value
    the config refuses."""
    config = config.replace(engine=engine_config(config.engine, args))
    return config.override(**deployment_overrides(args))
