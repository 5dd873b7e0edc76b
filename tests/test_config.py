"""The engine's configuration groups: each checks its own fields, EngineConfig what spans
them, check_deployment what needs the model and the mesh; override() routes by name. The
command-line flags generated from the fields (jaxserve.config.args): one group per field
name, types, help from the field's docstring, and today's flags of serve and batch."""

import dataclasses
import re
import typing

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
    ({"cache_dtype": "int4"}, r"CacheConfig.cache_dtype must be None or one of \['auto', 'float32'"),
    ({"max_num_seqs": -1}, "SchedulerConfig.max_num_seqs must be > 0"),
    ({"seq_buckets": (0, 4)}, "CompilationConfig.seq_buckets must be positive"),
    ({"xla_compiler_options": (("xla_gpu_enable_command_buffer",),)},
     r"CompilationConfig.xla_compiler_options must be a tuple of \(name, value\) string pairs"),
    ({"xla_compiler_options": (("gpu_enable_command_buffer", ""),)},
     r"each name an XLA option \(xla_...\)"),
    ({"xla_compiler_options": (("xla_a", "1"), ("xla_a", "2"))},
     "CompilationConfig.xla_compiler_options names an option twice"),
    ({"fused_decode": "yes"},
     r"CompilationConfig.fused_decode must be true, false or None \(auto\), got 'yes'"),
    ({"matmul_impl": "cpu", "weight_quant": "int8"},
     "KernelConfig.matmul_impl='cpu' multiplies float weights"),
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
    from jaxserve.worker.compilation import StepShapes
    shapes = StepShapes(EngineConfig(max_model_len=64).override(
        page_size=4, max_num_seqs=8, max_num_batched_tokens=100, seq_buckets=(1, 4, 16),
        token_buckets=(16, 64, 512), page_buckets=(2, 8)))
    assert shapes.seq_buckets == (1, 4, 8)
    assert shapes.token_buckets == (16, 64, 100)
    assert shapes.page_buckets == (2, 8, 16)
    default = StepShapes(EngineConfig(max_model_len=64).override(
        page_size=4, max_num_seqs=6, max_num_batched_tokens=40))
    assert default.seq_buckets == (1, 2, 4, 6) and default.token_buckets == (16, 32, 40)


def test_warmup_compiles_exactly_the_mixed_shapes_a_step_can_take():
    """Every (sequence count, token count) a mixed step can have lands on a warmed-up
    shape, and every warmed-up mixed shape is reached by one: T 16 x S 32 is not compiled
    (17 sequences or more bring 17 tokens or more)."""
    from jaxserve.worker.compilation import StepShapes
    shapes = StepShapes(EngineConfig(max_model_len=64).override(
        page_size=16, max_num_seqs=32, max_num_batched_tokens=96, seq_buckets=(1, 4, 16, 32),
        token_buckets=(16, 32, 64)))
    warm = {(T, S, P) for kind, T, S, P, *_ in shapes.warmup() if kind == "mixed" and P == 4}
    reached = {shapes.shape_of([1] * (n - 1) + [total - n + 1], 4, decode=False)
               for n in range(1, 33) for total in range(n, 97)}
    assert reached == warm
    assert (16, 32, 4) not in warm and (32, 32, 4) in warm and (16, 16, 4) in warm


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
    panels = EngineConfig().override(matmul_impl="cpu")  # f32 panels, or bf16 as they are
    check_deployment(panels, f32, one)
    check_deployment(panels, bf16, one)
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

    from jaxserve.config.args import ENGINE_FLAGS, add_flags, given

    ap = argparse.ArgumentParser()
    add_flags(ap, ENGINE_FLAGS)
    cfg = EngineConfig().override(**given(ap.parse_args(["--max-logprobs", "5",
                                                         "--max-logit-bias", "7"])))
    assert (cfg.sampler.max_logprobs, cfg.sampler.max_logit_bias) == (5, 7)
    assert EngineConfig().override(**given(ap.parse_args([]))) == EngineConfig()
    with pytest.raises(ConfigError, match="max_logprobs"):
        EngineConfig().override(**given(ap.parse_args(["--max-logprobs", "-1"])))


# -- the command-line flags, generated from the fields (jaxserve.config.args) ------------------

# The compatibility contract: every flag string `jaxserve serve` / `jaxserve batch` had when
# the flags were written by hand (collected from those parsers). A flag added on purpose is
# added here.
MODEL_AND_ENGINE_FLAGS_TODAY = {  # both commands'
    "--model", "--tokenizer", "--load-format", "--num-layers", "--tensor-parallel-size", "-tp",
    "--pipeline-parallel-size", "-pp", "--pipeline-microbatches",
    "--pipeline-decode-microbatches", "--max-model-len", "--max-num-seqs",
    "--max-num-batched-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--async-scheduling", "--no-async-scheduling", "--enable-prefix-caching", "--no-enable-prefix-caching", "--kv-cache-memory-bytes",
    "--gpu-memory-utilization", "--speculative-config", "--max-logprobs", "--max-logit-bias",
    "--cpu-kv-cache-space",  # added with the memory check (vLLM's VLLM_CPU_KVCACHE_SPACE)
    "--jump-forward", "--no-jump-forward",  # structured output's forced tokens (session 27)
    "--quantization", "-q",  # added with GGUF blocks served as they are (vLLM's)
    "--kv-cache-dtype",  # added with the fp8 KV cache (vLLM's)
    # added with multi-LoRA serving (vLLM's)
    "--enable-lora", "--no-enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
    "--lora-modules", "--lora-dtype",
    "--pooling",  # added with /v1/embeddings (issue 32)
    "--dynamic-chunking-keys",  # SGLang's --enable-dynamic-chunking, with its cost's K
}
SERVE_FLAGS_TODAY = MODEL_AND_ENGINE_FLAGS_TODAY | {
    "-h", "--help", "--config", "--host", "--port", "--cache-dir", "--api-key",
    "--no-background-warmup", "--dist-init-addr", "--nnodes", "--node-rank",
    "--max-request-body-bytes", "--max-queued-requests", "--request-timeout",
    "--max-stream-buffer-bytes", "--max-stop-strings", "--max-stop-string-len",
    "--shutdown-timeout", "--allowed-origins",
    "--malloc-arena-max",  # added with the layer loop's memory measurements (session 15)
    # tool calling and reasoning (issue 32)
    "--enable-auto-tool-choice", "--no-enable-auto-tool-choice", "--tool-call-parser",
    "--reasoning-parser",
}
BATCH_FLAGS_TODAY = MODEL_AND_ENGINE_FLAGS_TODAY | {
    "-h", "--help", "-i", "--input-file", "-o", "--output-file", "--config", "--cache-dir",
    "--max-concurrency", "--read-threads", "--no-progress",
}


def _all_flags_parser():
    import argparse

    from jaxserve.config.args import FLAGS, add_flags
    ap = argparse.ArgumentParser()
    add_flags(ap, FLAGS)
    return ap


def _deployment():
    from jaxserve.config import Config
    return Config(name="t", model=tiny_config(num_layers=4))


def test_field_names_are_unique_across_groups():
    """A name given on the command line or to Config.override sets one field: each
    flag's field belongs to its own group and to no other group a name is routed into."""
    from jaxserve.config.args import FLAGS, OVERRIDE_GROUPS, field_owners, flags_of
    owners = field_owners(OVERRIDE_GROUPS)  # raises naming both groups of a shared name
    for cls in FLAGS:
        assert cls in OVERRIDE_GROUPS
        for flag in flags_of(cls):
            assert owners[flag.field] is cls, (cls.__name__, flag.field)
    # every group EngineConfig holds is one a name is routed into
    hints = typing.get_type_hints(EngineConfig)
    held = {hints[f.name] for f in dataclasses.fields(EngineConfig)
            if dataclasses.is_dataclass(hints[f.name])}
    assert len(held) == 6 and held <= set(OVERRIDE_GROUPS)


def test_a_field_name_in_two_groups_fails_naming_both():
    import argparse

    from jaxserve.config.args import add_flags, field_owners

    @dataclasses.dataclass(frozen=True)
    class Left:
        size: int = 1
        """A size."""

    @dataclasses.dataclass(frozen=True)
    class Right:
        size: int = 2
        """Another size."""

    with pytest.raises(ConfigError, match="'size' is in both Left and Right"):
        field_owners((Left, Right))
    with pytest.raises(ConfigError, match="'size' is in both Left and Right"):
        add_flags(argparse.ArgumentParser(), (Left, Right), {Left: ("size",), Right: ("size",)})


def test_a_bool_field_gives_x_and_no_x():
    import argparse

    from jaxserve.config.args import add_flags, given

    @dataclasses.dataclass(frozen=True)
    class Toy:
        use_the_thing: bool = True
        """Whether to use the thing."""

    flags = {Toy: ("use_the_thing",)}
    ap = argparse.ArgumentParser()
    add_flags(ap, (Toy,), flags)
    assert given(ap.parse_args([]), (Toy,), flags) == {}
    assert given(ap.parse_args(["--use-the-thing"]), (Toy,), flags) == {"use_the_thing": True}
    assert given(ap.parse_args(["--no-use-the-thing"]), (Toy,), flags) == {"use_the_thing": False}
    # the real ones
    from jaxserve.config.args import apply
    ap = _all_flags_parser()
    base = _deployment()
    cfg = apply(base, given(ap.parse_args(["--no-enable-prefix-caching",
                                           "--no-enable-chunked-prefill",
                                           "--max-num-batched-tokens", "4096"])))
    assert cfg.engine.cache.enable_prefix_caching is False
    assert cfg.engine.scheduler.enable_chunked_prefill is False
    assert apply(base, given(ap.parse_args(["--enable-prefix-caching"]))) == base
    keyed = apply(base, given(ap.parse_args(["--dynamic-chunking-keys", "1024"])))
    assert keyed.engine.scheduler.dynamic_chunking_keys == 1024
    off = apply(keyed, given(ap.parse_args(["--dynamic-chunking-keys", "0"])))
    assert off.engine.scheduler.dynamic_chunking_keys is None and off == base
    with pytest.raises(ConfigError, match="SchedulerConfig.dynamic_chunking_keys must be > 0"):
        apply(base, given(ap.parse_args(["--dynamic-chunking-keys", "-3"])))


def test_an_optional_int_field_parses_and_overrides_only_when_given():
    import argparse

    from jaxserve.config.args import add_flags, apply, given

    @dataclasses.dataclass(frozen=True)
    class Toy:
        limit: int | None = 7
        """Most of something; None = no limit."""

    ap = argparse.ArgumentParser()
    add_flags(ap, (Toy,), {Toy: ("limit",)})
    assert given(ap.parse_args(["--limit", "3"]), (Toy,), {Toy: ("limit",)}) == {"limit": 3}
    assert given(ap.parse_args([]), (Toy,), {Toy: ("limit",)}) == {}
    with pytest.raises(SystemExit):
        ap.parse_args(["--limit", "x"])
    # the real ones: CacheConfig.kv_cache_memory_bytes, ParallelConfig.pipeline_microbatches
    ap = _all_flags_parser()
    base = _deployment().override(kv_cache_memory_bytes=None, pipeline_microbatches=5)
    assert apply(base, given(ap.parse_args([]))) == base  # the config's values stay
    cfg = apply(base, given(ap.parse_args(["--kv-cache-memory-bytes", "1000"])))
    assert cfg.engine.cache.kv_cache_memory_bytes == 1000
    assert cfg.parallel.pipeline_microbatches == 5
    assert cfg == base.override(kv_cache_memory_bytes=1000)
    cfg = apply(base, given(ap.parse_args(["--pipeline-microbatches", "3"])))
    assert cfg.parallel.pipeline_microbatches == 3 and cfg.engine == base.engine


def test_flag_help_is_the_field_documentation():
    from jaxserve.config import ParallelConfig, SchedulerConfig
    from jaxserve.config.args import FLAGS, field_docs, flags_of
    ap = _all_flags_parser()
    actions = {a.dest: a for a in ap._actions}
    for cls in FLAGS:
        for flag in flags_of(cls):
            doc = " ".join(field_docs(cls)[flag.field].split())
            assert actions[flag.field].help.replace("%%", "%").startswith(doc), flag.field
    assert actions["max_num_seqs"].help.startswith(
        "Most sequences running (each decodes one token per step).")
    assert field_docs(SchedulerConfig)["max_num_seqs"] in actions["max_num_seqs"].help
    assert "ParallelConfig's default 1" in actions["tensor_parallel_size"].help
    assert field_docs(ParallelConfig)["pipeline_microbatches"].startswith("How many microbatches")


def test_a_field_without_documentation_cannot_be_a_flag():
    import argparse

    from jaxserve.config.args import add_flags

    @dataclasses.dataclass(frozen=True)
    class Toy:
        documented: int = 1
        """What it is."""
        bare: int = 2

    add_flags(argparse.ArgumentParser(), (Toy,), {Toy: ("documented",)})
    with pytest.raises(ConfigError, match="Toy.bare has no documentation"):
        add_flags(argparse.ArgumentParser(), (Toy,), {Toy: ("bare",)})
    with pytest.raises(ConfigError, match="FLAGS lists Toy.missing, which is not a field"):
        add_flags(argparse.ArgumentParser(), (Toy,), {Toy: ("missing",)})


def test_every_config_field_is_documented():
    """Each field of each config class has its docstring (the string right after it): the
    help of its flag, if it is or becomes one."""
    import importlib
    import pkgutil

    import jaxserve.config as package
    from jaxserve.config.args import field_docs

    classes = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"jaxserve.config.{info.name}")
        classes += [v for v in vars(module).values() if isinstance(v, type)
                    and dataclasses.is_dataclass(v) and v.__module__ == module.__name__]
    assert len(classes) >= 14, classes
    undocumented = [f"{cls.__name__}.{f.name}" for cls in classes
                    for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
    assert not undocumented, f"document these fields: {undocumented}"


def test_choices_and_spellings_of_todays_flags():
    """-tp / -pp, --load-format's choices, --model, --tokenizer, --num-layers and
    --speculative-config (vLLM's JSON) set the deployment's fields."""
    from jaxserve.config import LOAD_FORMATS, ModelSource, SpeculativeConfig
    from jaxserve.config.args import apply, given
    ap = _all_flags_parser()
    assert tuple(next(a for a in ap._actions if a.dest == "load_format").choices) == LOAD_FORMATS
    with pytest.raises(SystemExit):
        ap.parse_args(["--load-format", "pt"])
    args = ap.parse_args(["-tp", "2", "-pp", "2", "--load-format", "dummy", "--num-layers", "3",
                          "--tokenizer", "/tok", "--model", "/weights", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3}'])
    fields = given(args)
    assert fields["source"] == "/weights"  # a path: the command makes it a ModelSource
    fields["source"] = ModelSource(checkpoint="/weights")
    cfg = apply(_deployment(), fields)
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size) == (2, 2)
    assert (cfg.load_format, cfg.num_layers, cfg.tokenizer) == ("dummy", 3, "/tok")
    assert cfg.source == ModelSource(checkpoint="/weights")
    assert cfg.engine.speculative == SpeculativeConfig("ngram", 3)
    with pytest.raises(ConfigError, match="speculative_config is not valid JSON"):
        given(ap.parse_args(["--speculative-config", "{"]))
    with pytest.raises(ConfigError, match="Config.num_layers=5 exceeds the model's 4 layers"):
        apply(_deployment(), given(ap.parse_args(["--num-layers", "5"])))


def test_server_flags_set_the_server_config():
    from jaxserve.config import ServerConfig
    from jaxserve.config.args import apply, given
    ap = _all_flags_parser()
    base = _deployment()
    assert apply(base, given(ap.parse_args([]))).server == ServerConfig()
    cfg = apply(base, given(ap.parse_args([
        "--request-timeout", "0", "--shutdown-timeout", "2.5", "--allowed-origins", "https://a",
        "https://b", "--max-queued-requests", "3", "--max-stop-strings", "4"])))
    assert cfg.server == ServerConfig(request_timeout_s=None, shutdown_timeout_s=2.5,
                                      allowed_origins=("https://a", "https://b"),
                                      max_queued_requests=3, max_stop_strings=4)
    assert cfg.engine == base.engine and cfg.parallel == base.parallel
    assert apply(base, given(ap.parse_args(["--request-timeout", "5"]))).server == \
        ServerConfig(request_timeout_s=5.0)
    with pytest.raises(ConfigError, match="ServerConfig.max_stop_strings must be an integer > 0"):
        apply(base, given(ap.parse_args(["--max-stop-strings", "0"])))
    cfg = apply(base, given(ap.parse_args(["--enable-auto-tool-choice", "--tool-call-parser",
                                           "hermes", "--reasoning-parser", "qwen3"])))
    assert (cfg.server.enable_auto_tool_choice, cfg.server.tool_call_parser,
            cfg.server.reasoning_parser) == (True, "hermes", "qwen3")


def test_unknown_parsers_fail_at_start_up_with_the_list(capsys):
    """--tool-call-parser / --reasoning-parser outside the implemented parsers stop the
    command with the names it knows; so does a config file naming one, and auto tool
    choice without a parser."""
    from jaxserve.config import ServerConfig
    from jaxserve.config.server import REASONING_PARSERS, TOOL_CALL_PARSERS
    from jaxserve.entrypoints.openai import reasoning_parsers, tool_parsers
    ap = _all_flags_parser()
    with pytest.raises(SystemExit):
        ap.parse_args(["--tool-call-parser", "hermes2"])
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and all(n in err for n in TOOL_CALL_PARSERS)
    with pytest.raises(SystemExit):
        ap.parse_args(["--reasoning-parser", "r1"])
    assert "deepseek_r1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"unknown parser 'x'; one of \['hermes'"):
        ServerConfig(tool_call_parser="x")
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    # every listed name has its parser
    for name in TOOL_CALL_PARSERS:
        assert tool_parsers.tool_parser(name).name == name
    for name in REASONING_PARSERS:
        assert reasoning_parsers.reasoning_parser(name).name == name


@pytest.mark.parametrize("command, today", [("serve", SERVE_FLAGS_TODAY),
                                            ("batch", BATCH_FLAGS_TODAY)])
def test_serve_and_batch_keep_todays_flags(command, today, capsys):
    import importlib
    module = importlib.import_module(f"jaxserve.cli.{command}")
    flags = {o for a in module.parser()._actions for o in a.option_strings}
    assert flags == today, f"gone: {sorted(today - flags)}; new: {sorted(flags - today)}"
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    shown = set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", capsys.readouterr().out))
    assert today <= shown, sorted(today - shown)


def test_cli_model_flag_becomes_a_model_source(tmp_path):
    """`--model DIR` is looked at (jaxserve.checkpoint.sources.source_from_path): a Hugging
    Face directory here; a path that holds no model is the CheckpointError of today."""
    from jaxserve.checkpoint import CheckpointError
    from jaxserve.cli.args import apply_flags
    from jaxserve.cli.serve import parser
    from jaxserve.config import ModelSource
    (tmp_path / "config.json").write_text("{}")
    ap = parser()
    cfg = apply_flags(_deployment(), ap.parse_args(["--model", str(tmp_path), "-tp", "2"]))
    assert cfg.source == ModelSource(hf_dir=str(tmp_path))
    assert cfg.parallel.tensor_parallel_size == 2
    assert apply_flags(_deployment(), ap.parse_args([])) == _deployment()
    with pytest.raises(CheckpointError, match="no such model directory"):
        apply_flags(_deployment(), ap.parse_args(["--model", str(tmp_path / "none")]))


def test_every_shipped_config_loads_by_name_with_its_files():
    """The packaged configs load by name (as `--config NAME`), and a file a config names
    (an EAGLE head) is where it says."""
    from pathlib import Path

    from jaxserve.config import load_config, shipped_config_names
    names = shipped_config_names()
    assert {"smollm2_135m", "smollm2_135m_eagle", "smollm2_135m_ngram", "llama70b"} <= set(names)
    for name in names:
        cfg = load_config(name)
        spec = cfg.engine.speculative
        if spec is not None and spec.model is not None and spec.method == "eagle":
            assert (Path(spec.model) / "config.json").is_file(), (name, spec.model)


def test_decode_steps_auto_is_chosen_for_the_platform():
    """SchedulerConfig.decode_steps None ("auto"): 8 tokens a dispatch on a GPU (measured
    on an H100: PERFORMANCE.md), 1 elsewhere; a number is kept; the step shapes refuse an
    unresolved one (only the engine builder knows the platform)."""
    from jaxserve.config.scheduler import AUTO_DECODE_STEPS
    from jaxserve.worker.compilation import StepShapes

    auto = SchedulerConfig(decode_steps=None)
    assert AUTO_DECODE_STEPS == 8
    for platform, steps in (("gpu", 8), ("cuda", 8), ("rocm", 8), ("cpu", 1)):
        assert auto.resolve(platform).decode_steps == steps
    assert SchedulerConfig(decode_steps=4).resolve("gpu").decode_steps == 4
    assert SchedulerConfig().decode_steps == 1
    with pytest.raises(ConfigError, match="decode_steps must be > 0, got 0"):
        SchedulerConfig(decode_steps=0)
    with pytest.raises(ValueError, match="SchedulerConfig.resolve"):
        StepShapes(EngineConfig(scheduler=auto))


def test_fused_decode_auto_is_chosen_for_the_platform():
    """CompilationConfig.fused_decode None ("auto"): one program a plain one-token decode
    step on a GPU, two on CPU; a bool is kept."""
    from jaxserve.config import CompilationConfig
    auto = CompilationConfig()
    assert auto.fused_decode is None
    for platform, fused in (("gpu", True), ("cuda", True), ("rocm", True), ("cpu", False)):
        assert auto.resolve(platform).fused_decode is fused
    assert CompilationConfig(fused_decode=False).resolve("cuda").fused_decode is False
    assert CompilationConfig(fused_decode=True).resolve("cpu").fused_decode is True
