"""OpenAI API response shapes (`/v1/completions`, `/v1/chat/completions`): usage, logprobs
in OpenAI's shapes, the response and streaming-chunk bodies, SSE events.

Source: the OpenAI API reference (Completions, Chat Completions, streaming chunk objects)
and vLLM's serving_completion / serving_chat.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.tokenization.tokenizer import Tokenizer

# A logprob of -inf in a response (JSON has no infinity): vLLM's value.
MIN_LOGPROB = -9999.0


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object (`protocol.Usage`) for these token counts."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LogprobsFormatter:
    """Token logprobs (jaxserve.engine.sequence.TokenLogprobs) in OpenAI's response shapes.
    A token's text is its own decoding (special tokens included), cached by id; a logprob
    of -inf is sent as MIN_LOGPROB. Source: OpenAI API reference (the legacy completions
    `logprobs` object; chat `logprobs.content`), vLLM's serving_completion /
    serving_chat (the sampled token is always in the completions top_logprobs dict, so it
    may hold logprobs + 1 entries; the first prompt token's entries are null)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        t = self._texts.get(token_id)
        if t is None:
            if len(self._texts) > 65536:
                self._texts.clear()
            t = self._texts[token_id] = self.tokenizer.decode([token_id],
                                                              skip_special_tokens=False)
        return t

    def completion(self, token_ids: list[int], entries: list, offset: int = 0
                   ) -> dict[str, Any]:
        """The completions `logprobs` object of these tokens (entries[i]: token_ids[i]'s
        TokenLogprobs, or None for a token without one: the first prompt token);
        text_offset counts characters from `offset`."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self.text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_clamp(entry.logprob))
            top = {self.text(t): _clamp(lp) for t, lp in entry.top}
            top.setdefault(text, _clamp(entry.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def chat(self, entries: list) -> dict[str, Any]:
        """The chat `logprobs` object ({"content": [...]}) of these TokenLogprobs."""
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.text(token_id)
            return {"token": text, "logprob": _clamp(logprob),
                    "bytes": list(text.encode("utf-8"))}

        return {"content": [{**one(e.token_id, e.logprob),
                             "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}


def _clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


@dataclasses.dataclass(frozen=True)
class ResponseShape:
    """How one endpoint words its answers (OpenAI's completion vs chat.completion objects).

    id_prefix: "cmpl" / "chatcmpl". object / chunk_object: the `object` field of a full
    response and of a streamed chunk. chat: choices carry `message`/`delta`, not `text`.
    The dicts it builds are the bodies `protocol` declares (CompletionResponse,
    CompletionChunk, ChatCompletionResponse, ChatCompletionChunk).
    """

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None, message: dict | None = None) -> dict[str, Any]:
        """Choice `index` of a non-streamed response (logprobs: its `LogprobsFormatter`
        object, or None). message: a chat choice's message object
        (`chat_reply.ChatReply.message`; default: `text` as its content)."""
        if not self.chat:
            body = {"text": text}
        else:
            body = {"message": message if message is not None else
                    {"role": "assistant", "content": text}}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None, first: bool,
                     index: int = 0, logprobs: dict | None = None,
                     delta: dict | None = None) -> dict[str, Any]:
        """Choice `index` of a streamed chunk. delta: a chat choice's new fields
        (`chat_reply.ChatReply.feed`; default: `text` as content); the first delta of a
        chat choice carries the role (and content "", as OpenAI's, unless it has calls)."""
        if not self.chat:
            body = {"text": text}
        else:
            fields = delta if delta is not None else ({"content": text} if text else {})
            if first:  # OpenAI's first delta: the role, content "" unless calls come
                fields = {"role": "assistant", **({} if "tool_calls" in fields else
                                                  {"content": ""}), **fields}
            body = {"delta": fields}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, request_id: str, created: int, model: str, choices: list[dict],
                 usage_: dict) -> dict[str, Any]:
        """A full (non-streamed) response object."""
        return {"id": request_id, "object": self.object, "created": created, "model": model,
                "choices": choices, "usage": usage_}

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
