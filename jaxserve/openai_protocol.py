"""OpenAI API request parsing and response shapes (`/v1/completions`, `/v1/chat/completions`).

Source: the OpenAI API reference (Completions, Chat Completions, streaming chunk objects,
error objects) and vLLM's OpenAI-compatible server (`vllm/entrypoints/openai/protocol.py`)
for the extensions `top_k`, `min_p`, `ignore_eos`. Everything is validated here, at the
edge: a bad request raises ApiError (HTTP 400, or 404 for an unknown model) naming the
parameter, and never reaches the engine.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from jaxserve.chat_template import ChatTemplateError
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Parameters we cannot honour: accepted only at their default (no-op) values, so clients
# that send defaults explicitly (the openai SDK, vLLM's benchmark client) still work.
_NOOP_VALUES = {
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "logit_bias": ({},), "suffix": ("",), "tools": ([],), "tool_choice": ("none", "auto"),
    "response_format": ({"type": "text"},),
}


class ApiError(Exception):
    """A request the server refuses. `status`: HTTP status; `param`: the offending field.

    `body()` is OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> dict[str, Any]:
        """The JSON error object OpenAI returns (HTTP body of the error response)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A validated request: prompt token ids, sampling params, and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object. Raises ApiError (400) if malformed or not an object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _opt(body: Mapping[str, Any], key: str, types: tuple[type, ...], what: str) -> Any:
    """body[key] if present and not null, checked against `types` (bool is never an int)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise ApiError(f"'{key}' must be {what}, got {json.dumps(value)[:80]}", key)
    return value


def _check_common(body: Mapping[str, Any], served_model_name: str) -> None:
    model = _opt(body, "model", (str,), "a string")
    if model is not None and model != served_model_name:
        raise ApiError(f"The model `{model}` does not exist. This server serves "
                       f"`{served_model_name}`.", "model", status=404, code="model_not_found")
    n = _opt(body, "n", (int,), "an integer")
    if n is not None and n != 1:
        raise ApiError(f"'n' must be 1 (one choice per request), got {n}", "n")
    for key, noop in _NOOP_VALUES.items():
        if body.get(key) is not None and body[key] not in noop:
            raise ApiError(f"'{key}' is not supported by this server", key)


def _stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError("'stop' must be a string or a list of strings", "stop")


def _context_error(param: str, max_model_len: int, prompt_len: int, max_tokens: int | None):
    wanted = "" if max_tokens is None else \
        f" plus {max_tokens} requested output tokens = {prompt_len + max_tokens}"
    return ApiError(f"This model's maximum context length is {max_model_len} tokens; the prompt "
                    f"has {prompt_len} tokens{wanted}. Shorten the prompt"
                    f"{'' if max_tokens is None else ' or lower ' + param}.",
                    param, code="context_length_exceeded")


def _parse(body: Mapping[str, Any], prompt_ids: list[int], prompt_param: str,
           max_tokens_keys: tuple[str, ...], default_max_tokens: int,
           max_model_len: int) -> ParsedRequest:
    """What completions and chat share: lengths, sampling params, stream options."""
    if not prompt_ids:
        raise ApiError("the prompt is empty (0 tokens)", prompt_param)
    if len(prompt_ids) >= max_model_len:
        raise _context_error(prompt_param, max_model_len, len(prompt_ids), None)
    key = next((k for k in max_tokens_keys if body.get(k) is not None), max_tokens_keys[0])
    max_tokens = _opt(body, key, (int,), "an integer")
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(f"'{key}' must be >= 1, got {max_tokens}", key)
    room = max_model_len - len(prompt_ids)
    if max_tokens is not None and max_tokens > room:
        raise _context_error(key, max_model_len, len(prompt_ids), max_tokens)
    ignore_eos = _opt(body, "ignore_eos", (bool,), "a boolean")
    stream = _opt(body, "stream", (bool,), "a boolean") or False
    options = _opt(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = (options or {}).get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise ApiError("'stream_options.include_usage' must be a boolean", "stream_options")
    given = {name: body[name] for name in ("temperature", "top_p", "top_k", "min_p", "seed")
             if body.get(name) is not None}
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else min(default_max_tokens, room),
            stop=_stop_strings(body), ignore_eos=bool(ignore_eos), **given)
    except InvalidRequest as e:
        field = key if e.field == "max_tokens" else e.field
        raise ApiError(str(e), field) from None
    return ParsedRequest(prompt_ids, params, stream, include_usage)


def _completion_prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """A completions `prompt`: a string, token ids, or a batch of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError("batched prompts are not supported: send one prompt per request", "prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise ApiError(f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})",
                           "prompt")
        return list(prompt)
    if prompt is None:
        raise ApiError("'prompt' is required", "prompt")
    raise ApiError("'prompt' must be a string or a list of token ids", "prompt")


def parse_completion_request(body: Mapping[str, Any], tokenizer: Tokenizer,
                             served_model_name: str, max_model_len: int) -> ParsedRequest:
    """Validate a `/v1/completions` body. Raises ApiError. Default max_tokens: 16 (OpenAI)."""
    _check_common(body, served_model_name)
    ids = _completion_prompt_ids(body.get("prompt"), tokenizer)
    return _parse(body, ids, "prompt", ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS,
                  max_model_len)


def _message(m: Any, i: int) -> dict[str, Any]:
    """One chat message with its content flattened to a string (text parts joined by "\\n",
    as vLLM does); other part types (images, audio) are refused."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(f"messages[{i}] must be an object with a string 'role'", "messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(f"messages[{i}].content: only text parts are supported", "messages")
        content = "\n".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string, a list of text parts or null",
                       "messages")
    return {**m, "content": content}


def parse_chat_request(body: Mapping[str, Any], tokenizer: Tokenizer,
                       served_model_name: str, max_model_len: int) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body: render `messages` with the model's chat
    template (add_generation_prompt=True) and tokenize without adding special tokens.
    max_completion_tokens wins over the deprecated max_tokens; default: all the room left
    (max_model_len - prompt tokens). Raises ApiError (including the template's own errors).
    """
    _check_common(body, served_model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' is required and must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(f"chat template: {e}", "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return _parse(body, ids, "messages", ("max_completion_tokens", "max_tokens"), max_model_len,
                  max_model_len)


# -- responses ----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass(frozen=True)
class ResponseShape:
    """How one endpoint words its answers (OpenAI's completion vs chat.completion objects).

    id_prefix: "cmpl" / "chatcmpl". object / chunk_object: the `object` field of a full
    response and of a streamed chunk. chat: choices carry `message`/`delta`, not `text`.
    """

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        """The single choice of a non-streamed response."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """The choice of a streamed chunk; a chat stream's first delta carries the role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            body = {"delta": delta}
        else:
            body = {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason}

    def response(self, request_id: str, created: int, model: str, choice: dict,
                 usage_: dict) -> dict[str, Any]:
        """A full (non-streamed) response object."""
        return {"id": request_id, "object": self.object, "created": created, "model": model,
                "choices": [choice], "usage": usage_}

    def chunk(self, request_id: str, created: int, model: str, choices: list[dict],
              include_usage: bool, usage_: dict | None = None) -> dict[str, Any]:
        """A streamed chunk; with include_usage every chunk has `usage` (null but the last)."""
        out = {"id": request_id, "object": self.chunk_object, "created": created, "model": model,
               "choices": choices}
        if include_usage:
            out["usage"] = usage_
        return out


COMPLETION = ResponseShape("cmpl", "text_completion", "text_completion", chat=False)
CHAT = ResponseShape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def sse_event(data: Any) -> bytes:
    """One server-sent event: `data: <json>\\n\\n` (or `data: [DONE]\\n\\n` for the string)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n".encode("utf-8")
