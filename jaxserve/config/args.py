"""Command-line flags generated from the config fields, as vLLM's EngineArgs does: which
fields of which group are flags is declared once (FLAGS, a list per group), and each
becomes `--field-name` (or the spelling its Flag gives), typed by the field's annotation
(int, float, str; `bool` -> `--x / --no-x`; `X | None` -> X; `tuple[X, ...]` -> one or
more X), restricted to the field's `choices` (its dataclasses metadata, where the config
declares them), with the field's docstring (the string right after it in the class,
`field_docs`) as its help.

Every flag defaults to None, which keeps the config file's value: `given(args)` returns
the fields set on the command line, `apply(config, fields)` sets them (Config.override;
ServerConfig's fields on Config.server). Field names are unique across the groups they
are routed into (OVERRIDE_GROUPS, `field_owners`), so a name means one field and one flag.
Flags that are not config fields (--config, --host, --port, ...) are written by the
command that owns them (jaxserve.cli). Imports only the standard library and
jaxserve.config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Callable, Iterable, Mapping

from jaxserve.config import (CacheConfig, Config, ConfigError, EngineConfig, LoRAConfig,
                             ParallelConfig, SamplerConfig, SchedulerConfig, ServerConfig, SpeculativeConfig)
from jaxserve.config.engine import ENGINE_GROUPS


@dataclasses.dataclass(frozen=True)
class Flag:
    """A field's flag where it is not plain `--field-name` parsed by the annotation."""

    field: str
    """The field's name in its group (also the flag's argparse dest)."""
    name: str | None = None
    """The long flag without its dashes (vLLM's spelling); None = the field's name with
    "_" -> "-"."""
    aliases: tuple[str, ...] = ()
    """More option strings for the same flag ("-tp")."""
    type: Callable[[str], Any] | None = None
    """What parses the flag's text; None = the type of the field's annotation."""
    convert: Callable[[Any], Any] | None = None
    """Makes the field's value of the parsed one when the flag is given (raising
    ConfigError for a bad one, as the config does), e.g. SpeculativeConfig.from_dict."""
    none_if: Any = None
    """A command-line value that stands for the field's None (--request-timeout 0)."""
    metavar: str | None = None
    """The value's name in --help; None = the flag's name in capitals."""

    @property
    def option(self) -> str:
        return "--" + (self.name or self.field.replace("_", "-"))


# Which fields are flags, a list per group: a field's name, or a Flag for another
# spelling, an alias or a value parsed later. The order is --help's.
FLAGS: dict[type, tuple[str | Flag, ...]] = {
    Config: (
        # --model PATH: the command turns the path into a ModelSource
        # (jaxserve.cli.args.apply_flags: what a path holds is the checkpoint layer's).
        Flag("source", name="model", type=str),
        "tokenizer", "load_format", Flag("quantization", aliases=("-q",)), "num_layers"),
    ParallelConfig: (
        Flag("tensor_parallel_size", aliases=("-tp",)),
        Flag("pipeline_parallel_size", aliases=("-pp",)),
        "pipeline_microbatches", "pipeline_decode_microbatches"),
    EngineConfig: (
        "max_model_len",
        Flag("speculative", name="speculative-config", type=str, metavar="JSON",
             convert=SpeculativeConfig.from_dict), "pooling"),
    SchedulerConfig: ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill",
                      Flag("dynamic_chunking_keys", none_if=0), "async_scheduling",
                      "jump_forward"),
    CacheConfig: ("enable_prefix_caching", "kv_cache_memory_bytes", "gpu_memory_utilization",
                  "cpu_kv_cache_space", Flag("cache_dtype", name="kv-cache-dtype", none_if="auto")),
    SamplerConfig: ("max_logprobs", "max_logit_bias"),
    LoRAConfig: ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
                 Flag("lora_modules", metavar="NAME=PATH"), "lora_dtype"),
    ServerConfig: (
        "max_request_body_bytes", "max_queued_requests",
        Flag("request_timeout_s", name="request-timeout", none_if=0),
        "max_stream_buffer_bytes", "max_stop_strings", "max_stop_string_len",
        Flag("shutdown_timeout_s", name="shutdown-timeout"), "allowed_origins",
        "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser"),
}
# The groups a command adds: the weights and the mesh, the engine's settings (`jaxserve
# serve` and `jaxserve batch`), the HTTP server's limits (`jaxserve serve`).
MODEL_FLAGS = (Config, ParallelConfig)
ENGINE_FLAGS = (EngineConfig, SchedulerConfig, CacheConfig, SamplerConfig, LoRAConfig)
SERVER_FLAGS = (ServerConfig,)

# The groups a field name is routed into (Config.override, EngineConfig.override, `apply`):
# a name must be a field of exactly one of them.
OVERRIDE_GROUPS = (Config, ParallelConfig, EngineConfig, *ENGINE_GROUPS.values(), ServerConfig)


def field_owners(groups: Iterable[type]) -> dict[str, type]:
    """{field name: the group that has it} over `groups`. Raises ConfigError naming both
    groups when two have a field of the same name (a flag or an override by that name
    would set only one of them)."""
    owners: dict[str, type] = {}
    for cls in groups:
        for f in dataclasses.fields(cls):
            if f.name in owners:
                raise ConfigError(f"field {f.name!r} is in both {owners[f.name].__name__} and "
                                  f"{cls.__name__}: a flag or override by that name would set "
                                  "only one of them; rename one")
            owners[f.name] = cls
    return owners


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its documentation}: the string literal right after the field in the
    class body (an attribute docstring, as Sphinx and vLLM's `get_attr_docs` read them),
    dedented. Fields without one are absent."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def flags_of(cls: type, flags: Mapping[type, tuple[str | Flag, ...]] = FLAGS) -> tuple[Flag, ...]:
    """The Flags of group `cls` (none if it has no list)."""
    return tuple(f if isinstance(f, Flag) else Flag(f) for f in flags.get(cls, ()))


def _unwrap_optional(annotation):
    """X for `X | None` / `Optional[X]`, else the annotation itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _argparse_kwargs(cls: type, field: dataclasses.Field, flag: Flag) -> dict[str, Any]:
    """add_argument's keywords for `field`'s flag (action / type / nargs / choices /
    metavar, help, default None). Raises ConfigError for a field without documentation,
    or whose annotation names no command-line type and whose Flag gives none."""
    where = f"{cls.__name__}.{field.name}"
    doc = field_docs(cls).get(field.name)
    if not doc:
        raise ConfigError(f"{where} has no documentation: write what it is as a string "
                          "right after the field (it is the flag's --help)")
    kw: dict[str, Any] = {"dest": field.name, "default": None}
    annotation = _unwrap_optional(typing.get_type_hints(cls)[field.name])
    if flag.type is not None:
        kw["type"] = flag.type
    elif annotation is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif annotation in (int, float, str):
        kw["type"] = annotation
    elif (typing.get_origin(annotation) is tuple and len(typing.get_args(annotation)) == 2
          and typing.get_args(annotation)[1] is Ellipsis
          and typing.get_args(annotation)[0] in (int, float, str)):
        kw["type"], kw["nargs"] = typing.get_args(annotation)[0], "+"
    else:
        raise ConfigError(f"{where}: no command-line type for {annotation!r}; give its Flag "
                          "a type (and a convert)")
    if "choices" in field.metadata:
        kw["choices"] = field.metadata["choices"]
    elif "action" not in kw:
        kw["metavar"] = flag.metavar or (flag.name or field.name).upper().replace("-", "_")
    help_text = " ".join(doc.split())
    if flag.none_if is not None:
        help_text += f" On the command line {flag.none_if!r} = None."
    if field.default is not dataclasses.MISSING:
        help_text += f" (default: the config's; {cls.__name__}'s default {field.default!r})"
    kw["help"] = help_text.replace("%", "%%")
    return kw


def add_flags(ap: argparse.ArgumentParser, groups: Iterable[type],
              flags: Mapping[type, tuple[str | Flag, ...]] = FLAGS) -> None:
    """Add the flags of `groups` (e.g. MODEL_FLAGS + ENGINE_FLAGS) to `ap`, one argument
    group per config class. Raises ConfigError when two of the groups share a field name,
    a listed name is not a field, or a field cannot be a flag (`_argparse_kwargs`)."""
    groups = tuple(groups)
    field_owners(groups)
    for cls in groups:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        summary = " ".join(inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0].split())
        section = ap.add_argument_group(cls.__name__, summary.replace("%", "%%"))
        for flag in flags_of(cls, flags):
            if flag.field not in fields:
                raise ConfigError(f"FLAGS lists {cls.__name__}.{flag.field}, which is not a field")
            section.add_argument(flag.option, *flag.aliases,
                                 **_argparse_kwargs(cls, fields[flag.field], flag))


def given(args: argparse.Namespace, groups: Iterable[type] = tuple(FLAGS),
          flags: Mapping[type, tuple[str | Flag, ...]] = FLAGS) -> dict[str, Any]:
    """{field: value} of the flags of `groups` given on the command line (the others are
    None: the config's value stays), each value made the field's (Flag.none_if,
    Flag.convert, a list of values as a tuple). Flags the parser does not have are not
    given. Raises ConfigError for a value a Flag's convert refuses."""
    out = {}
    for cls in groups:
        for flag in flags_of(cls, flags):
            value = getattr(args, flag.field, None)
            if value is None:
                continue
            if flag.none_if is not None and value == flag.none_if:
                value = None
            elif flag.convert is not None:
                value = flag.convert(value)
            elif isinstance(value, list):
                value = tuple(value)
            out[flag.field] = value
    return out


def apply(config: Config, fields: Mapping[str, Any]) -> Config:
    """`config` with `fields` set by name: ServerConfig's on config.server, the others by
    Config.override (Config's own, ParallelConfig's, EngineConfig's and its groups').
    Raises ConfigError for an unknown name or a value its group refuses."""
    owners = field_owners(OVERRIDE_GROUPS)
    server = {k: v for k, v in fields.items() if owners.get(k) is ServerConfig}
    if server:
        config = config.replace(server=dataclasses.replace(config.server, **server))
    rest = {k: v for k, v in fields.items() if k not in server}
    return config.override(**rest) if rest else config
