"""What a chat choice's generated text becomes in the response: the message's `content`,
`reasoning_content` and `tool_calls`, whole (`ChatReply.message`) and as the text streams
(`ChatReply.feed`: the fields of each `delta`).

The reasoning parser (if the server runs one) splits the thinking off first; the tool-call
side then reads the answer after it: a named tool_choice's answer is the call's arguments
(the grammar made them match the schema); "required"'s is a JSON array of calls (also
grammar-made); "auto"'s is free text that the server's tool-call parser reads; without
tools it is the content. Source: vLLM's serving_chat (reasoning before tool parsing,
finish_reason "tool_calls" once tools were called by "auto" or "required", the first call
only without parallel_tool_calls).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStream
from jaxserve.entrypoints.openai.tool_parsers import (RequiredParser, ToolCallStream,
                                                      ToolParser, call_id)

NAMED, AUTO, REQUIRED = "named", "auto", "required"


@dataclasses.dataclass(frozen=True)
class ReplyFormat:
    """How a chat request's replies are read. reasoning: the server's reasoning parser, or
    None. tools: None (the answer is content), NAMED (the answer is the arguments of
    `function`), AUTO (`parser`, the server's tool-call parser, reads it) or REQUIRED (a JSON
    array of calls). parallel: keep every call (else only the first)."""

    reasoning: ReasoningParser | None = None
    tools: str | None = None
    function: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True

    def tool_parser(self) -> ToolParser | None:
        """The parser reading the answer's calls (AUTO's or REQUIRED's), else None."""
        return RequiredParser() if self.tools == REQUIRED else \
            self.parser if self.tools == AUTO else None


def _calls_body(calls: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    return [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls]


class ChatReply:
    """One choice's reply. `message(text)`: the whole reply's message object;
    `feed(new_text, final)`: the delta fields of text as it streams (held-back text, a tag
    arriving in pieces, comes out later or with `final`). `called`: tool calls were made
    (AUTO / REQUIRED), so the finish_reason "stop" reads "tool_calls"."""

    def __init__(self, fmt: ReplyFormat):
        self.fmt = fmt
        self.called = False
        self._text = self._answer = ""
        self._reasoning = ReasoningStream(fmt.reasoning) if fmt.reasoning else None
        parser = fmt.tool_parser()
        self._tools = ToolCallStream(parser) if parser is not None else None
        self._named_id: str | None = None

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of the whole reply `text`."""
        fmt = self.fmt
        reasoning, answer = fmt.reasoning.extract(text) if fmt.reasoning else (None, text)
        out: dict[str, Any] = {"role": "assistant", "content": answer or ""}
        if fmt.tools == NAMED:
            out["content"] = None
            out["tool_calls"] = _calls_body([(call_id(), fmt.function, answer or "")])
        elif fmt.tools is not None:
            got = fmt.tool_parser().extract(answer or "")
            calls = got.tool_calls if fmt.parallel else got.tool_calls[:1]
            if calls:
                self.called = True
                out["content"] = got.content
                out["tool_calls"] = _calls_body([(c.id, c.name, c.arguments) for c in calls])
        if fmt.reasoning is not None:
            out["reasoning_content"] = reasoning
            if not answer and "tool_calls" not in out:
                out["content"] = None
        return out

    def feed(self, new_text: str, final: bool = False) -> dict[str, Any]:
        """The delta fields (content / reasoning_content / tool_calls) that `new_text`, the
        reply's next text, makes ready; `final`: the reply is whole (all held text goes
        out, a named call with no arguments yet gets its id and name)."""
        self._text += new_text
        delta: dict[str, Any] = {}
        if self._reasoning is not None:
            reasoning, answer = self._reasoning.feed(self._text, final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        else:
            answer = new_text
        self._answer += answer
        fmt = self.fmt
        if fmt.tools == NAMED:
            if answer or (final and self._named_id is None):
                call: dict[str, Any] = {"index": 0, "function": {"arguments": answer}}
                if self._named_id is None:
                    self._named_id = call_id()
                    call = {"index": 0, "id": self._named_id, "type": "function",
                            "function": {"name": fmt.function, "arguments": answer}}
                delta["tool_calls"] = [call]
        elif self._tools is not None:
            content, deltas = (self._tools.finish if final else self._tools.feed)(self._answer)
            if content:
                delta["content"] = content
            calls = []
            for d in deltas:
                if d.index and not fmt.parallel:
                    continue
                self.called = True
                call = {"index": d.index, "function": {"arguments": d.arguments}}
                if d.id is not None:
                    call = {"index": d.index, "id": d.id, "type": "function",
                            "function": {"name": d.name, "arguments": d.arguments}}
                calls.append(call)
            if calls:
                delta["tool_calls"] = calls
        elif answer:
            delta["content"] = answer
        return delta


__all__ = ["AUTO", "NAMED", "REQUIRED", "ChatReply", "ReplyFormat"]
