"""The OpenAI-compatible API's bodies, declared as pydantic v2 models.

Requests (`CompletionRequest`, `ChatCompletionRequest`) are parsed straight from the raw
body with `Model.model_validate_json` (pydantic-core's Rust JSON parser, jiter), so the
JSON itself is checked there too: invalid UTF-8, lone UTF-16 surrogates, nesting deeper
than jiter's recursion limit and integer literals of more than 4300 digits are refused
before any Python object is built. Every field's type and range is declared here, with
strict types: a boolean is never an integer, a float never an integer, a string never a
number. Unknown fields are ignored (as vLLM does). What needs the tokenizer or the
server's limits (top_k <= vocabulary, prompt token ids, stop-string limits, context
length) is checked after validation, in `jaxserve.entrypoints.openai.request`.

Responses (`CompletionResponse`, `CompletionChunk`, `ChatCompletionResponse`,
`ChatCompletionChunk`, `Usage`, `ErrorResponse`, `ModelList`, `HealthResponse`) document
what the server sends (`jaxserve.entrypoints.openai.openapi.openapi_schema`); `response.ResponseShape` builds those
bodies and the tests check that they validate against these models.

Source: the OpenAI API reference (Completions, Chat Completions, chat completion chunk,
Models, error objects) and vLLM's `vllm/entrypoints/openai/protocol.py` (the extensions
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, `prompt_logprobs`, and
`max_model_len` in the model card).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from jaxserve.sampling_params import SEED_MAX, SEED_MIN

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1

# Strict scalars: JSON true/false is never a number, 1.0 never an integer, "1" never either.
# Every integer is bounded to 64 bits, so no error message ever has to print a huge one.
StrictStr = Annotated[str, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
PositiveInt = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
TopK = Annotated[int, Field(strict=True, ge=-1, le=INT64_MAX)]
Seed = Annotated[int, Field(strict=True, ge=SEED_MIN, le=SEED_MAX)]
TokenId = NonNegativeInt
Temperature = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
TopP = Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)]
MinP = Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2, allow_inf_nan=False)]
RepetitionPenalty = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
LogitBias = Annotated[float, Field(strict=True, ge=-100, le=100, allow_inf_nan=False)]
JsonObject = dict[str, JsonValue]

FinishReason = Literal["stop", "length", "abort", "error"]


# -- requests -----------------------------------------------------------------------------

class StreamOptions(BaseModel):
    """`stream_options` (only with "stream": true): include_usage adds a last chunk with
    `usage` (and `"usage": null` in every other chunk). Source: OpenAI Chat Completions."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output follows (OpenAI)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """`response_format` (OpenAI): "text" (free), "json_object" (any JSON object) or
    "json_schema" (its json_schema.schema)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """`structured_outputs` (vLLM): exactly one constraint. json: a JSON schema (object or
    its text); regex: matched whole; choice: one of these strings exactly; grammar: a Lark
    (llguidance dialect) or GBNF grammar; json_object: any JSON object."""

    model_config = ConfigDict(extra="ignore")
    json_: JsonObject | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class FunctionDefinition(BaseModel):
    """A tool's function: its name and the JSON schema of its arguments."""

    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    parameters: JsonObject | None = None


class Tool(BaseModel):
    """A tool the model may call (chat `tools`; OpenAI)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    """`tool_choice` naming a function: the reply is a call of it, its arguments matching
    the function's parameters schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class _SamplingRequest(BaseModel):
    """Fields both endpoints share: model, sampling, stop, streaming, and the OpenAI
    parameters this server cannot honour, accepted only at their default (no-op) values
    (`request` refuses any other value with a 400 "not supported")."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="Must be the served model's name.")
    n: PositiveInt | None = Field(None, description="Choices per prompt (at most 128 choices "
                                  "per request); with a seed, choice i samples with seed + i.")
    max_tokens: PositiveInt | None = Field(
        None, description="Most tokens to generate; prompt + max_tokens <= max_model_len.")
    temperature: Temperature | None = Field(None, description="0 is greedy. Default 1.")
    top_p: TopP | None = Field(None, description="Nucleus sampling mass, in (0, 1]. Default 1.")
    top_k: TopK | None = Field(
        None, description="Keep the k most likely tokens; -1 or 0: off. At most the "
                          "vocabulary size (vLLM extension).")
    min_p: MinP | None = Field(None, description="In [0, 1]; 0: off (vLLM extension).")
    seed: Seed | None = Field(None, description="Signed 64-bit; same seed, same output.")
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description="Strings that end generation (not returned); each non-empty, at "
                          "most the server's max_stop_strings of at most max_stop_string_len "
                          "characters.")
    stream: StrictBool | None = Field(None, description="Answer with server-sent events.")
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = Field(None, description="Generate past EOS (vLLM extension).")
    user: StrictStr | None = None
    presence_penalty: Penalty | None = Field(
        None, description="In [-2, 2]: subtracted from the logit of each token already in "
                          "the output. Default 0.")
    frequency_penalty: Penalty | None = Field(
        None, description="In [-2, 2]: times its count in the output, subtracted from each "
                          "token's logit. Default 0.")
    repetition_penalty: RepetitionPenalty | None = Field(
        None, description="> 0: the logit of a token in the prompt or output is divided by "
                          "it (positive) or multiplied (negative). Default 1 (vLLM extension).")
    logit_bias: dict[str, LogitBias] | None = Field(
        None, description="{token id: bias in [-100, 100]} added to the logits.")
    min_tokens: NonNegativeInt | None = Field(
        None, description="No EOS, stop token or stop string before this many tokens "
                          "(vLLM extension).")
    stop_token_ids: list[TokenId] | None = Field(
        None, description="Token ids that end generation (vLLM extension).")
    skip_special_tokens: StrictBool | None = Field(
        None, description="Leave special tokens out of the text. Default true (vLLM "
                          "extension).")
    include_stop_str_in_output: StrictBool | None = Field(
        None, description="Return the matched stop string (vLLM extension).")
    # Not supported: only their no-op values are accepted.
    best_of: PositiveInt | None = Field(None, description="Only 1 is supported.")
    suffix: StrictStr | None = Field(None, description='Only "" is supported.')
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} (any JSON object) or '
                          '{"type": "json_schema", "json_schema": {"name", "schema"}}.')
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's structured outputs: exactly one of json, regex, choice, "
                          "grammar, json_object.")
    guided_json: JsonObject | StrictStr | None = Field(
        None, description="A JSON schema the output follows (vLLM's older name).")
    guided_regex: StrictStr | None = Field(None, description="vLLM's older name.")
    guided_choice: list[StrictStr] | None = Field(None, description="vLLM's older name.")
    guided_grammar: StrictStr | None = Field(None, description="vLLM's older name.")


class CompletionRequest(_SamplingRequest):
    """The body of POST /v1/completions.

    prompt: a string, a list of token ids (each in [0, vocabulary size)), or a batch of
    strings or of token-id lists (each prompt gets n choices, index prompt x n + i);
    default max_tokens 16 (OpenAI's), capped at the room left.
    `CompletionRequest.model_validate_json(raw)` returns the model or raises
    pydantic.ValidationError (`request.parse_completion_request` makes it a 400).
    Source: OpenAI API reference, Completions; vLLM `CompletionRequest`.
    """

    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    logprobs: NonNegativeInt | None = Field(
        None, description="Report the logprob of each token and of this many most likely "
                          "tokens at its position (at most the server's max_logprobs, 20 by "
                          "default). Log-softmax of the raw logits, before logit_bias, "
                          "penalties, temperature and filters (vLLM's default).")
    echo: StrictBool | None = Field(
        None, description="Return the prompt before the completion, with its tokens' logprobs "
                          "when `logprobs` is set (the first token's is null).")


class TextPart(BaseModel):
    """A content part of a chat message; only text parts are supported (no images, audio)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class MessageFunctionCall(BaseModel):
    """The function an earlier assistant turn called: its name and arguments (JSON text)."""

    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr


class MessageToolCall(BaseModel):
    """A call in an earlier assistant turn (`messages[i].tool_calls[j]`), as the API
    returned it."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    """One chat message: role, and content as a string, a list of text parts (joined by
    "\\n" before the chat template, as vLLM does) or null; an assistant turn's
    `tool_calls`, a tool result's `tool_call_id`. Source: OpenAI Chat Completions."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None


class ChatCompletionRequest(_SamplingRequest):
    """The body of POST /v1/chat/completions.

    messages: at least one; rendered with the model's chat template. max_completion_tokens
    wins over the deprecated max_tokens; default: all the room left in the context.
    `model_validate_json(raw)` returns the model or raises pydantic.ValidationError
    (`request.parse_chat_request` makes it a 400).
    Source: OpenAI API reference, Chat Completions; vLLM `ChatCompletionRequest`.
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = Field(
        None, description="Most tokens to generate (wins over max_tokens).")
    logprobs: StrictBool | None = Field(
        None, description="Report each output token's logprob (log-softmax of the raw logits).")
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = Field(
        None, description="With logprobs: the most likely tokens at each position, 0-20.")
    echo: StrictBool | None = Field(None, description="Only false is supported.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"none" (answer in text), "auto" (the default with tools: the '
                          "model decides; needs a server run with --enable-auto-tool-choice), "
                          '"required" (one or more calls, arguments matching their schemas) '
                          'or {"type": "function", "function": {"name"}}: the reply is a '
                          "call of that function with arguments matching its schema.")
    parallel_tool_calls: StrictBool | None = Field(
        None, description="Allow several calls in one reply. Default true.")


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter in directory lora_path,
    on the server's machine, as lora_name (then a request's `model`)."""

    lora_name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving lora_name (lora_int_id, vLLM's,
    accepted and unused)."""

    lora_name: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    lora_int_id: NonNegativeInt | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): the token ids of a `prompt` (with the tokenizer's special
    tokens unless add_special_tokens is false), or of chat `messages` rendered by the
    model's chat template (add_generation_prompt, default true; no special tokens added
    unless add_special_tokens is true), with `tools` as a chat request gives them to the
    template. return_token_strs: also each token's string."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): the text of token ids (special tokens kept)."""

    model: StrictStr | None = None
    tokens: list[NonNegativeInt]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's): the embedding of each input, a string, token ids, or
    a batch of strings or of token-id lists (at most 2048 inputs, OpenAI's limit).
    encoding_format: "float" (lists of numbers) or "base64" (little-endian float32 bytes,
    as the openai SDK asks by default); dimensions: only the model's own (no Matryoshka
    truncation). Source: OpenAI API reference, Embeddings; vLLM's EmbeddingRequest."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    input: (StrictStr | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[StrictStr], Field(min_length=1, max_length=2048)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                        Field(min_length=1, max_length=2048)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: StrictStr | None = None


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions,
    ResponseFormat, JsonSchemaFormat, StructuredOutputsParams, Tool, FunctionDefinition,
    NamedToolChoice, NamedFunction, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
    TokenizeRequest, DetokenizeRequest, EmbeddingRequest)


# -- responses ----------------------------------------------------------------------------

class Usage(BaseModel):
    """Token counts of one request (OpenAI's usage object)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Logprobs of a completion choice's tokens (OpenAI's legacy shape, as vLLM returns
    it): each token's text, its logprob (null for the first prompt token under echo),
    {token text: logprob} of the sampled token and the most likely ones (null where the
    logprob is), and each token's character offset in the returned text. A logprob of
    -inf is sent as -9999.0 (JSON has no infinity; vLLM's value)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """The one choice of a completion (or of a streamed chunk: `text` is the new text)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class _Envelope(BaseModel):
    """What every completion response and chunk starts with."""

    id: str = Field(description='"cmpl-" or "chatcmpl-" + a random hex id, the same in '
                                "every chunk of a stream.")
    created: int = Field(description="Unix seconds.")
    model: str


class CompletionResponse(_Envelope):
    """The 200 body of a non-streamed POST /v1/completions (`text_completion`)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Envelope):
    """One server-sent event of a streamed POST /v1/completions. With include_usage every
    chunk has `usage`: null, except a last one with empty `choices` and the counts."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="Present only with include_usage.")


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, as JSON text.")


class ToolCall(BaseModel):
    """A call of a tool."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The generated chat message: its text (content) and the tools it calls, if any."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(
        None, description="A reasoning model's thinking (with --reasoning-parser).")


class TopLogprob(BaseModel):
    """A most likely token at a position: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    """An output token's logprob and the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Logprobs of a chat choice's tokens (OpenAI's chat shape)."""

    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    """The one choice of a non-streamed chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ToolCallDelta(BaseModel):
    """A streamed tool call: the first delta has its id, type and name, the rest the
    arguments' next text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class ChatDelta(BaseModel):
    """New text of a chat stream; the first delta also has the role, a final one may be {}."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    """The choice of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(_Envelope):
    """The 200 body of a non-streamed POST /v1/chat/completions (`chat.completion`)."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Envelope):
    """One server-sent event of a streamed POST /v1/chat/completions
    (`chat.completion.chunk`); `usage` as in CompletionChunk."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="Present only with include_usage.")


class ErrorDetail(BaseModel):
    """What went wrong: `param` names the offending request field (dotted path), if any."""

    message: str
    type: str = Field(description='"invalid_request_error", "server_error", ...')
    param: str | None
    code: str | None = Field(description='e.g. "context_length_exceeded", "model_not_found"')


class ErrorResponse(BaseModel):
    """Every error body (OpenAI's error object)."""

    error: ErrorDetail


class ModelCard(BaseModel):
    """A served model: the base, or a LoRA adapter over it; max_model_len, root and parent
    are vLLM's extensions (prompt + output tokens; where the weights came from; the base
    an adapter runs on, None for the base)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    """The 200 body of GET /v1/models."""

    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    """The 200 body of GET /health and GET /ready: a status and the engine's counters."""

    model_config = ConfigDict(extra="allow")
    status: str


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    Usage, CompletionResponse, CompletionChunk, ChatCompletionResponse, ChatCompletionChunk,
    ErrorResponse, ModelList, HealthResponse)


class Embedding(BaseModel):
    """One input's embedding: floats, or their little-endian float32 bytes in base64."""

    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """The body of a /v1/embeddings answer (OpenAI's list of embeddings)."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
