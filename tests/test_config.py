"""The engine's configuration groups: each checks its own fields, EngineConfig what spans
them, check_deployment what needs the model and the mesh; override() routes by name."""

import pytest

from jaxserve.config import (CacheConfig, CompilationConfig, ConfigError, EngineConfig,
                             KernelConfig, ParallelConfig, SchedulerConfig, check_deployment)
from model_utils import tiny_config


def test_override_routes_each_field_to_its_group():
    base = EngineConfig(max_model_len=64)
    cfg = base.override(page_size=8, max_num_seqs=4, attention_impl="xla",
                        page_buckets=(2, 16), max_model_len=128, seed=7)
    assert cfg.cache == CacheConfig(page_size=8)
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=4)
    assert cfg.kernels == KernelConfig(attention_impl="xla")
    assert cfg.compilation == CompilationConfig(page_buckets=(2, 16))
    assert (cfg.max_model_len, cfg.seed) == (128, 7)
    assert base == EngineConfig(max_model_len=64)  # frozen: the original is unchanged
    # a whole group, then a field of it on top
    assert base.override(kernels=KernelConfig(sampling_impl="xla"),
                         attention_impl="xla").kernels == KernelConfig("xla", "auto", "xla")


@pytest.mark.parametrize("fields, match", [
    ({"page_sise": 8}, "EngineConfig has no field 'page_sise'"),
    ({"page_size": 0}, "CacheConfig.page_size must be > 0, got 0"),
    ({"cache_dtype": "int4"}, "CacheConfig.cache_dtype must be None, 'float32'"),
    ({"max_num_seqs": -1}, "SchedulerConfig.max_num_seqs must be > 0"),
    ({"seq_buckets": (0, 4)}, "CompilationConfig.seq_buckets must be positive"),
    ({"matmul_impl": "cpu"}, "KernelConfig.matmul_impl='cpu' runs the bf16 weight copies"),
    ({"max_model_len": 0}, "EngineConfig.max_model_len must be > 0"),
    ({"max_num_seqs": 32, "max_num_batched_tokens": 16},
     r"SchedulerConfig.max_num_batched_tokens \(16\) must be at least max_num_seqs \(32\)"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 32},
     r"max_num_batched_tokens \(32\) must hold max_model_len \(64\)"),
])
def test_each_group_names_the_field_it_refuses(fields, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(max_model_len=64).override(**fields)


def test_buckets_end_at_their_limit():
    """The limit is always the largest bucket; buckets past it are dropped (a flag can
    move a limit without a new bucket list)."""
    cfg = EngineConfig(max_model_len=64).override(
        page_size=4, max_num_seqs=8, max_num_batched_tokens=100, seq_buckets=(1, 4, 16),
        token_buckets=(16, 64, 512), page_buckets=(2, 8))
    assert cfg.seq_buckets == (1, 4, 8)
    assert cfg.token_buckets == (16, 64, 100)
    assert cfg.page_counts == (2, 8, 16)
    default = EngineConfig(max_model_len=64).override(page_size=4, max_num_seqs=6,
                                                      max_num_batched_tokens=40)
    assert default.seq_buckets == (1, 2, 4, 6) and default.token_buckets == (16, 32, 40)


def test_a_group_must_be_of_its_type():
    with pytest.raises(ConfigError, match="EngineConfig.cache must be a CacheConfig"):
        EngineConfig(cache=SchedulerConfig())


def test_check_deployment_needs_of_the_model_and_mesh():
    f32, bf16 = tiny_config(dtype="float32"), tiny_config(dtype="bfloat16")
    one, tp2 = ParallelConfig(), ParallelConfig(tensor_parallel_size=2)
    check_deployment(EngineConfig(), bf16, tp2)  # nothing asked that TP or bf16 refuses
    copies = EngineConfig().override(bf16_matmul_min_rows=1)
    check_deployment(copies, f32, one)
    check_deployment(copies, bf16, one)  # bf16 weights used for every row: packed as they are
    with pytest.raises(ConfigError, match="bf16_matmul_min_rows needs float32 weights"):
        check_deployment(EngineConfig().override(bf16_matmul_min_rows=8), bf16, one)
    with pytest.raises(ConfigError, match="bf16_matmul_min_rows needs float32 weights"):
        check_deployment(copies.override(bf16_matmul_max_rows=64), bf16, one)
    check_deployment(copies, f32, tp2)  # kernels run per device under TP
    check_deployment(EngineConfig().override(weight_quant="int8"), f32, tp2)
    # 4 query / 2 KV heads on 4 devices: each KV head repeated over 2 of them
    check_deployment(EngineConfig(), f32, ParallelConfig(tensor_parallel_size=4))
    # 6 query / 2 KV heads on 3 devices: the query heads split, the KV heads cannot follow
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 divides only one of "
                                          "num_heads=6 and num_kv_heads=2"):
        check_deployment(EngineConfig(), tiny_config(num_heads=6, num_kv_heads=2),
                         ParallelConfig(tensor_parallel_size=3))
    assert tp2.num_devices == 2
    with pytest.raises(ConfigError, match="ParallelConfig.tensor_parallel_size must be > 0"):
        ParallelConfig(tensor_parallel_size=0)


def test_config_override_routes_deployment_parallel_and_engine_fields():
    from jaxserve.config import Config
    base = Config(name="t", model=tiny_config(num_layers=4))
    cfg = base.override(tensor_parallel_size=4, load_format="dummy", num_layers=2,
                        tokenizer="/tok", max_num_seqs=3)
    assert cfg.parallel == ParallelConfig(tensor_parallel_size=4)
    assert (cfg.load_format, cfg.num_layers, cfg.tokenizer) == ("dummy", 2, "/tok")
    assert cfg.engine.scheduler.max_num_seqs == 3 and base.parallel.num_devices == 1
    with pytest.raises(ConfigError, match="Config.load_format must be one of"):
        base.override(load_format="pt")
    with pytest.raises(ConfigError, match="Config.num_layers=5 exceeds the model's 4 layers"):
        base.override(num_layers=5)
    with pytest.raises(ConfigError, match="Config.num_layers must be None or an integer >= 1"):
        base.override(num_layers=0)
    with pytest.raises(ConfigError, match="EngineConfig has no field 'tensor_parallel'"):
        base.override(tensor_parallel=2)


def test_override_speculative_config_takes_an_object_a_dict_or_none():
    from jaxserve.config import SpeculativeConfig
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert EngineConfig().override(speculative_config=spec).speculative == spec
    assert EngineConfig().override(speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": 3}).speculative == spec
    assert EngineConfig(speculative=spec).override(speculative_config=None).speculative is None


def test_command_line_sampler_limits_reach_the_engine_config():
    """serve.py / jaxserve batch: --max-logprobs and --max-logit-bias set
    SamplerConfig; a refused value is a ConfigError naming the field."""
    import argparse

    from jaxserve.cli.args import add_engine_flags, engine_config

    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    cfg = engine_config(EngineConfig(), ap.parse_args(["--max-logprobs", "5",
                                                       "--max-logit-bias", "7"]))
    assert (cfg.sampler.max_logprobs, cfg.sampler.max_logit_bias) == (5, 7)
    assert engine_config(EngineConfig(), ap.parse_args([])) == EngineConfig()
    with pytest.raises(ConfigError, match="max_logprobs"):
        engine_config(EngineConfig(), ap.parse_args(["--max-logprobs", "-1"]))
