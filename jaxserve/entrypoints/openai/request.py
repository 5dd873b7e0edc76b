"""OpenAI API request parsing (`/v1/completions`, `/v1/chat/completions`, `/v1/embeddings`,
`/tokenize`, `/detokenize`); a chat prompt's rendering with its tools is
`jaxserve.entrypoints.openai.chat_prompt`, the responses' shapes
`jaxserve.entrypoints.openai.response`.

A request body goes straight from raw bytes into a declared pydantic model
(`jaxserve.entrypoints.openai.protocol`), which checks the JSON, every field's type and range; then what
needs the tokenizer or the server's limits is checked here (top_k <= vocabulary, prompt
token ids, stop strings, context length, parameters only accepted at their no-op value).
Whatever the bytes, the outcome is a ParsedRequest or an ApiError (HTTP 400, or 404 for an
unknown model) naming the parameter: nothing invalid reaches the engine. (Any other
exception would be a bug here: the server answers it with a 500 without its text; the
hypothesis tests feed arbitrary bodies to find such bugs.)

Source: the OpenAI API reference (Completions, Chat Completions, streaming chunk objects,
error objects) and vLLM's OpenAI-compatible server (`vllm/entrypoints/openai/protocol.py`)
for the extensions `top_k`, `min_p`, `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Collection, TypeVar

import pydantic

from jaxserve.entrypoints.openai.chat_prompt import ChatParsers, chat_text, tool_choice
from jaxserve.entrypoints.openai.chat_reply import ReplyFormat
from jaxserve.entrypoints.openai.errors import MAX_MESSAGE_CHARS as _MAX_MESSAGE_CHARS
from jaxserve.entrypoints.openai.errors import ApiError
from jaxserve.entrypoints.openai.protocol import (REQUEST_MODELS, ChatCompletionRequest,
                                                  CompletionRequest, DetokenizeRequest,
                                                  EmbeddingRequest, TokenizeRequest,
                                                  _SamplingRequest)
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.sample.grammar import StructuredOutput
from jaxserve.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxserve.config import ServerConfig

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Most choices one request may ask for: n x the prompts of a batch (OpenAI's limit on n).
MAX_CHOICES = 128

# Parameters we cannot honour: accepted only at their default (no-op) values, so clients
# that send defaults explicitly (the openai SDK, vLLM's benchmark client) still work.
_NOOP_VALUES = {"best_of": (1,), "suffix": ("",)}
_CHAT_NOOP_VALUES = {**_NOOP_VALUES, "echo": (False,)}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for (the parse functions enforce it; a request over a
    limit is a 400). max_model_len: prompt + output tokens; max_stop_strings /
    max_stop_string_len: most `stop` strings, most characters in one. Source: vLLM's
    max_model_len; this server's `ServerConfig`."""

    max_model_len: int
    max_stop_strings: int = 16
    max_stop_string_len: int = 1024

    @classmethod
    def of(cls, server: ServerConfig, max_model_len: int) -> "RequestLimits":
        """The limits of a server configured by `server` (its max_stop_strings and
        max_stop_string_len) serving a model of `max_model_len` tokens."""
        return cls(max_model_len, server.max_stop_strings, server.max_stop_string_len)


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A validated request: its prompts' token ids (several for a batched completions
    prompt), sampling params, `n` choices per prompt, and how to answer. Choice
    `p * n + i` is prompt p's i-th (`choices`). echo: completions' `echo` (each choice's
    text starts with its prompt's, prompt_texts[p], and its logprobs with the prompt's);
    the response reports logprobs when params.logprobs is not None. reply: how a chat
    request's replies are read (reasoning, tool calls: `chat_reply.ReplyFormat`), None
    for completions. lora_name: the LoRA adapter the request names as its `model` (None:
    the base model)."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False
    prompt_texts: list[str] | None = None
    reply: ReplyFormat | None = None
    lora_name: str | None = None

    @property
    def prompt_ids(self) -> list[int]:
        """The first prompt (a chat request's only one)."""
        return self.prompts[0]

    def choices(self) -> list[tuple[int, list[int], SamplingParams]]:
        """(index, prompt token ids, params) of every choice to generate. With a seed,
        choice i of a prompt samples with seed + i, as vLLM does, so each of the n choices
        is the one a single request with that seed gets (wrapping around within the
        signed 64-bit seeds)."""
        out = []
        for p, ids in enumerate(self.prompts):
            for i in range(self.n):
                params = self.params
                if i and params.seed is not None:
                    seed = (params.seed + i + 2**63) % 2**64 - 2**63
                    params = dataclasses.replace(params, seed=seed)
                out.append((p * self.n + i, ids, params))
        return out


# -- validation errors --------------------------------------------------------------------

_FIELD_NAMES = frozenset(name for m in REQUEST_MODELS for name in m.model_fields)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's error location as a dotted path of field names and list indices; union
    member tags ("str", "list[int]") and dict keys (client text) are left out."""
    parts = [str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES]
    return ".".join(parts) or None


def _from_validation_error(e: pydantic.ValidationError) -> ApiError:
    """The first field's error as an ApiError. Of a union's errors, the deepest is named,
    with the messages of the members that failed at that same place ("a string, or a list")."""
    errors = e.errors(include_url=False, include_context=False, include_input=False)
    if not errors:
        return ApiError("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first["msg"].removeprefix("Invalid JSON: ")[:_MAX_MESSAGE_CHARS]
        return ApiError(f"request body is not valid JSON: {detail}")
    if not first["loc"]:
        return ApiError("request body must be a JSON object")
    group = [x for x in errors if x["loc"][:1] == first["loc"][:1]]
    deepest = max(group, key=lambda x: len(x["loc"]))
    param = _param(deepest["loc"])
    messages = list(dict.fromkeys(x["msg"] for x in group if _param(x["loc"]) == param))
    text = ", or ".join(messages)[:_MAX_MESSAGE_CHARS]
    return ApiError(f"{param}: {text}" if param else text, param)


_Request = TypeVar("_Request", bound=_SamplingRequest)


def validate_body(model, raw: bytes):
    """`raw` (a request body) parsed and validated as pydantic `model`, or ApiError (400)
    naming the field (what every endpoint's body goes through)."""
    return _validate(model, raw)


def _validate(model: type[_Request], raw: bytes) -> _Request:
    """`raw` (the request body) parsed and validated as `model`, or ApiError (400)."""
    if not isinstance(raw, (bytes, bytearray, str)):
        raise ApiError("request body must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise _from_validation_error(e) from None


# -- checks that need the tokenizer or the limits ------------------------------------------

def _check_common(req: _SamplingRequest, served_model_name: str,
                  noops: dict = _NOOP_VALUES, lora_names: Collection[str] = ()) -> str | None:
    """Check the model and the no-op parameters; returns the LoRA adapter the request
    names as its model (None: the base model)."""
    _check_model(req.model, served_model_name, lora_names)
    for key, noop in noops.items():
        value = getattr(req, key)
        if value is not None and value not in noop:
            raise ApiError(f"'{key}' is not supported by this server (only "
                           f"{json.dumps(noop[0])} is accepted)", key)
    return req.model if req.model is not None and req.model != served_model_name else None


def _stop_strings(stop: str | list[str] | None, limits: RequestLimits) -> tuple[str, ...]:
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > limits.max_stop_strings:
        raise ApiError(f"stop: at most {limits.max_stop_strings} stop strings are allowed, "
                       f"got {len(stop)}", "stop")
    for s in stop:
        if not s:
            raise ApiError("stop: stop strings must be non-empty", "stop")
        if len(s) > limits.max_stop_string_len:
            raise ApiError(f"stop: a stop string may have at most {limits.max_stop_string_len} "
                           f"characters, got one of {len(s)}", "stop")
    return stop


def _context_error(param: str, max_model_len: int, prompt_len: int, max_tokens: int | None):
    wanted = "" if max_tokens is None else \
        f" plus {max_tokens} requested output tokens = {prompt_len + max_tokens}"
    return ApiError(f"This model's maximum context length is {max_model_len} tokens; the prompt "
                    f"has {prompt_len} tokens{wanted}. Shorten the prompt"
                    f"{'' if max_tokens is None else ' or lower ' + param}.",
                    param, code="context_length_exceeded")


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """`logit_bias` with its keys (token ids as JSON strings) as integers in the
    vocabulary, or ApiError naming "logit_bias"."""
    out = {}
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else None
        if token is None or token >= vocab_size:
            raise ApiError(f"logit_bias: keys must be token ids in [0, {vocab_size}), got "
                           f"{json.dumps(key[:40])}", "logit_bias")
        if token in out:
            raise ApiError(f"logit_bias: token {token} appears twice", "logit_bias")
        out[token] = value
    return out


def _structured_output(req: _SamplingRequest, tool_schema: dict | None = None,
                       tool_label: str = "", after: str = "") -> StructuredOutput | None:
    """The one output constraint a request asks for, from OpenAI's `response_format`,
    vLLM's `structured_outputs` or its older `guided_*` fields, or the schema of the calls
    a tool_choice asks for (tool_schema; tool_label names the tool(s) in errors); compiled
    here once to check it; `after`: the text it starts after (a reasoning model's end of
    thinking; "" = at once). Raises
    ApiError naming the field: two constraints, an empty one, or one the grammar engine
    refuses ("tools" for a tool's schema)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(StructuredOutput("json_object", "", "response_format"))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError("response_format: type json_schema needs json_schema.schema",
                               "response_format")
            found.append(StructuredOutput("json", json.dumps(rf.json_schema.schema_),
                                          "response_format"))
    so = req.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex),
                                     ("choice", so.choice), ("grammar", so.grammar),
                                     ("json_object", so.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise ApiError("structured_outputs: give exactly one of json, regex, choice, "
                           "grammar, json_object", "structured_outputs")
        found.append(_spec(*given[0], "structured_outputs"))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{key}")
        if value is not None:
            found.append(_spec(key, value, f"guided_{key}"))
    if tool_schema is not None:
        found.append(StructuredOutput("json", json.dumps(tool_schema), "tool_choice"))
    if not found:
        return None
    if len(found) > 1:
        raise ApiError(f"{found[1].field}: only one output constraint per request (also "
                       f"given: {found[0].field})", found[1].field)
    spec = found[0]
    if after:  # the constraint starts after the thinking (vLLM's way)
        spec = dataclasses.replace(spec, after=after)
    try:
        spec.validate()
    except InvalidRequest as e:
        if spec.field == "tool_choice":
            raise ApiError(f"tools: the grammar engine cannot compile the parameters schema "
                           f"of {tool_label}: {str(e)[:_MAX_MESSAGE_CHARS]}", "tools") from None
        raise ApiError(str(e)[:_MAX_MESSAGE_CHARS], e.field) from None
    return spec


def _spec(kind: str, value, field: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value),
                                field)
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(value), field)
    return StructuredOutput(kind, "" if kind == "json_object" else value, field)


def _parse(req: _SamplingRequest, prompts: list[list[int]], prompt_param: str,
           max_tokens_key: str, max_tokens: int | None, default_max_tokens: int,
           tokenizer: Tokenizer, limits: RequestLimits, logprobs: int | None = None,
           echo: bool = False, structured: StructuredOutput | None = None) -> ParsedRequest:
    """What completions and chat share: lengths, sampling params, choices, stream options."""
    n = req.n or 1
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(f"n: at most {MAX_CHOICES} choices per request (n x prompts), got "
                       f"{n} x {len(prompts)}", "n")
    max_model_len = limits.max_model_len
    room = max_model_len
    for p, prompt_ids in enumerate(prompts):
        param = prompt_param if len(prompts) == 1 else f"{prompt_param}.{p}"
        if not prompt_ids:
            raise ApiError("the prompt is empty (0 tokens)", param)
        if len(prompt_ids) >= max_model_len:
            raise _context_error(param, max_model_len, len(prompt_ids), None)
        if max_tokens is not None and max_tokens > max_model_len - len(prompt_ids):
            raise _context_error(max_tokens_key, max_model_len, len(prompt_ids), max_tokens)
        room = min(room, max_model_len - len(prompt_ids))
    if req.top_k is not None and req.top_k > tokenizer.vocab_size:
        raise ApiError(f"top_k: must be -1 or 0 (off), or at most the vocabulary size "
                       f"{tokenizer.vocab_size}, got {req.top_k}", "top_k")
    stop = _stop_strings(req.stop, limits)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "min_tokens", "skip_special_tokens",
        "include_stop_str_in_output") if getattr(req, name) is not None}
    bad = next((t for t in req.stop_token_ids or () if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise ApiError(f"stop_token_ids: token id {bad} is outside the vocabulary "
                       f"[0, {tokenizer.vocab_size})", "stop_token_ids")
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else min(default_max_tokens, room),
            stop=stop, ignore_eos=bool(req.ignore_eos),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            logit_bias=_logit_bias(req.logit_bias, tokenizer.vocab_size),
            logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
            structured_outputs=structured, **given)
    except InvalidRequest as e:
        field = max_tokens_key if e.field == "max_tokens" else e.field
        raise ApiError(str(e)[:_MAX_MESSAGE_CHARS], field) from None
    return ParsedRequest(prompts, params, stream, include_usage, n, echo)


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception:
        log.exception("tokenizer failed on a request")
        raise ApiError(f"{param}: the text could not be tokenized", param) from None


def _completion_prompts(prompt: Any, tokenizer: Tokenizer, field: str = "prompt"
                        ) -> list[list[int]]:
    """A completions `prompt` (or an embeddings `input`: field) as token ids: a string or
    token ids (one prompt), or a batch of strings or of token-id lists (OpenAI's and
    vLLM's batched prompts); errors name `field` ("prompt.2": a batch's third)."""
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (str, list)):
        batch, names = [prompt], [field]
    else:
        batch, names = prompt, [f"{field}.{p}" for p in range(len(prompt))]
    out = []
    for one, param in zip(batch, names):
        if isinstance(one, str):
            out.append(_encode(tokenizer, one, True, param))
            continue
        bad = next((t for t in one if t >= tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(f"{param}: token id {bad} is outside the vocabulary "
                           f"[0, {tokenizer.vocab_size})", param)
        out.append(list(one))
    return out


def _parse_completion(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                      limits: RequestLimits, lora_names: Collection[str] = ()) -> ParsedRequest:
    req = _validate(CompletionRequest, raw)
    lora = _check_common(req, served_model_name, lora_names=lora_names)
    prompts = _completion_prompts(req.prompt, tokenizer)
    parsed = _parse(req, prompts, "prompt", "max_tokens", req.max_tokens,
                    DEFAULT_COMPLETION_MAX_TOKENS, tokenizer, limits, req.logprobs,
                    bool(req.echo), _structured_output(req))
    if parsed.echo:
        texts = ([req.prompt] if isinstance(req.prompt, str) else
                 [p if isinstance(p, str) else None for p in req.prompt]
                 if req.prompt and isinstance(req.prompt[0], (str, list)) else [None])
        texts = [t if t is not None else tokenizer.decode(ids, skip_special_tokens=False)
                 for t, ids in zip(texts, prompts)]
        parsed = dataclasses.replace(parsed, prompt_texts=texts)
    return dataclasses.replace(parsed, lora_name=lora)


def parse_completion_request(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                             limits: RequestLimits, lora_names: Collection[str] = ()
                             ) -> ParsedRequest:
    """Validate a `/v1/completions` body (`raw`: the request's bytes; a CompletionRequest).

    Returns the ParsedRequest: each prompt's token ids (a string prompt encoded with
    special tokens; a batch of strings or token-id lists gives several), SamplingParams
    (default max_tokens 16, OpenAI's, capped at the room the longest prompt leaves), n,
    stream and include_usage; lora_name, when `model` names one of `lora_names` (the LoRA
    adapters served now). Raises ApiError: 404 (code model_not_found) if `model` is
    neither `served_model_name` nor an adapter; 400 naming the parameter for anything else (malformed JSON, a
    type or range error, token ids outside the vocabulary ("prompt.2" for a batch's third),
    more than MAX_CHOICES choices (n x prompts), an unsupported
    parameter, too many or too long stop strings, prompt + max_tokens over
    `limits.max_model_len`: code context_length_exceeded). Never anything else.
    Source: OpenAI API reference, Completions; vLLM `CompletionRequest`.
    """
    return _parse_completion(raw, tokenizer, served_model_name, limits, lora_names)


def _parse_chat(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                limits: RequestLimits, lora_names: Collection[str] = (),
                parsers: ChatParsers = ChatParsers()) -> ParsedRequest:
    req = _validate(ChatCompletionRequest, raw)
    lora = _check_common(req, served_model_name, _CHAT_NOOP_VALUES, lora_names)
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs: requires 'logprobs': true", "top_logprobs")
    reply, tool_schema, tool_label = tool_choice(req, parsers)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] \
        if reply.tools is not None else []
    text = chat_text(req.messages, tokenizer, True, tools, parsers.tool_parser)
    ids = _encode(tokenizer, text, False, "messages")
    # a reasoning model thinks first, unless the template closed its thinking in the
    # prompt (Qwen3 with thinking off): then constraints start at once
    end = parsers.reasoning.end_tag if parsers.reasoning is not None else ""
    after = end if end and not text.rstrip().endswith(end) else ""
    if end and not after:
        reply = dataclasses.replace(reply, reasoning=None)
    key = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    parsed = _parse(req, [ids], "messages", key, max_tokens, limits.max_model_len, tokenizer,
                    limits, (req.top_logprobs or 0) if req.logprobs else None,
                    structured=_structured_output(req, tool_schema, tool_label, after))
    return dataclasses.replace(parsed, reply=reply, lora_name=lora)


def _check_model(model: str | None, served_model_name: str, lora_names: Collection[str]) -> None:
    if model is not None and model != served_model_name and model not in lora_names:
        also = f" and the LoRA adapters {sorted(lora_names)}" if lora_names else ""
        raise ApiError(f"The model `{model[:200]}` does not exist. This server serves "
                       f"`{served_model_name}`{also}."[:_MAX_MESSAGE_CHARS], "model",
                       status=404, code="model_not_found")


def parse_tokenize_request(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                           lora_names: Collection[str] = (),
                           parsers: ChatParsers = ChatParsers()) -> tuple[list[int], list | None]:
    """Validate a `/tokenize` body (a TokenizeRequest) and tokenize it: (token ids, each
    token's string or None unless return_token_strs). Messages with `tools` render as a
    chat request with them does (`parsers.tool_parser`'s format for a template without
    tools), so that the count is what the chat prompt costs. Raises ApiError: 404 for an
    unknown model; 400 naming the field for a body with neither or both of prompt and
    messages, or messages the chat template refuses. Source: vLLM's /tokenize."""
    req = _validate(TokenizeRequest, raw)
    _check_model(req.model, served_model_name, lora_names)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError("give either 'prompt' or 'messages'", "prompt")
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        text = chat_text(req.messages, tokenizer, req.add_generation_prompt, tools,
                          parsers.tool_parser)
        ids = _encode(tokenizer, text, bool(req.add_special_tokens), "messages")
    else:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = _encode(tokenizer, req.prompt, special, "prompt")
    return ids, ([tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None)


def parse_detokenize_request(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                             lora_names: Collection[str] = ()) -> str:
    """Validate a `/detokenize` body (a DetokenizeRequest): the text of its tokens
    (special tokens kept). Raises ApiError: 404 for an unknown model; 400 naming
    "tokens.i" for an id outside the vocabulary. Source: vLLM's /detokenize."""
    req = _validate(DetokenizeRequest, raw)
    _check_model(req.model, served_model_name, lora_names)
    bad = next((i for i, t in enumerate(req.tokens) if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise ApiError(f"tokens.{bad}: token id {req.tokens[bad]} is outside the vocabulary "
                       f"[0, {tokenizer.vocab_size})", f"tokens.{bad}")
    return tokenizer.decode(req.tokens, skip_special_tokens=False)


def parse_chat_request(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                       limits: RequestLimits, lora_names: Collection[str] = (),
                       parsers: ChatParsers = ChatParsers()) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body (`raw`: the request's bytes; a
    ChatCompletionRequest): render `messages` with the model's chat template
    (add_generation_prompt=True) and tokenize without adding special tokens.

    Returns the ParsedRequest. max_completion_tokens wins over the deprecated max_tokens;
    default: all the room left (limits.max_model_len - prompt tokens). Raises ApiError as
    `parse_completion_request` does, and 400 naming "messages" when the chat template
    rejects the messages (or the model has none), "tool_choice" for "auto" without
    `parsers.auto_tool_choice` or a choice without tools, "tools" for a tool schema the
    grammar engine cannot compile. `parsers`: the server's tool-call and reasoning parsers
    (ParsedRequest.reply). Never anything else.
    Source: OpenAI API reference, Chat Completions; vLLM `ChatCompletionRequest`.
    """
    return _parse_chat(raw, tokenizer, served_model_name, limits, lora_names, parsers)


@dataclasses.dataclass(frozen=True)
class ParsedEmbedding:
    """A validated /v1/embeddings request: each input's token ids, how to encode the
    vectors ("float" / "base64"), and the LoRA adapter it names as its model (or None)."""

    prompts: list[list[int]]
    encoding_format: str = "float"
    lora_name: str | None = None


def parse_embedding_request(raw: bytes, tokenizer: Tokenizer, served_model_name: str,
                            limits: RequestLimits, hidden_size: int,
                            lora_names: Collection[str] = ()) -> ParsedEmbedding:
    """Validate a `/v1/embeddings` body (an EmbeddingRequest): strings are tokenised with
    the tokenizer's special tokens, as completions prompts. Raises ApiError: 404 for an
    unknown model; 400 naming the field ("input.2" for a batch's third) for an empty input,
    a token id outside the vocabulary, an input of max_model_len tokens or more (code
    context_length_exceeded), or `dimensions` other than the model's `hidden_size` (no
    Matryoshka truncation). Source: OpenAI API reference, Embeddings; vLLM's
    serving_embedding."""
    req = _validate(EmbeddingRequest, raw)
    _check_model(req.model, served_model_name, lora_names)
    if req.dimensions is not None and req.dimensions != hidden_size:
        raise ApiError(f"dimensions: this model's embeddings have {hidden_size} dimensions; "
                       f"other sizes (Matryoshka truncation) are not supported, got "
                       f"{req.dimensions}", "dimensions")
    prompts = _completion_prompts(req.input, tokenizer, "input")
    for p, ids in enumerate(prompts):
        param = "input" if len(prompts) == 1 else f"input.{p}"
        if not ids:
            raise ApiError("the input is empty (0 tokens)", param)
        if len(ids) >= limits.max_model_len:  # the same room as a prompt's
            raise _context_error(param, limits.max_model_len, len(ids), None)
    lora = req.model if req.model is not None and req.model != served_model_name else None
    return ParsedEmbedding(prompts, req.encoding_format, lora)
