"""Reasoning parsers: a reasoning model's thinking (`<think>...</think>`) split from its
answer, whole (`ReasoningParser.extract`) and as the text streams (`ReasoningStream`), as
vLLM's `--reasoning-parser` does for `message.reasoning_content` /
`delta.reasoning_content`.

- "deepseek_r1" (DeepSeek-R1 and its distills): the chat template opens the thinking in
  the prompt, so the reply starts inside it (a leading `<think>` is accepted too); the text
  up to `</think>` is reasoning, the rest the answer; a reply with no `</think>` is all
  reasoning (the generation stopped while thinking).
- "qwen3" (Qwen3): thinking only when the reply opens with `<think>` (thinking can be
  switched off); then as deepseek_r1; otherwise all answer.

While streaming, a tag arriving in pieces is held back, never sent as either text. The
texts are the model's as written (no whitespace trimmed), as vLLM returns them.

Source: vLLM's reasoning parsers (vllm/reasoning: deepseek_r1_reasoning_parser,
qwen3_reasoning_parser) and the chat templates of DeepSeek-R1 and Qwen3.
"""

from __future__ import annotations

import dataclasses

from jaxserve.entrypoints.openai.tool_parsers import held_prefix

from jaxserve.config.server import REASONING_PARSERS
START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    """`split(text, final)`: (reasoning so far or None, answer so far) of a reply;
    `extract(text)` the whole reply's. name: a REASONING_PARSERS entry."""

    name: str

    @property
    def end_tag(self) -> str:
        """The text that ends the thinking."""
        return END

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        body = text
        opened = body.lstrip().startswith(START)
        if opened:
            body = body.lstrip()[len(START):]
        elif not final and START.startswith(body.lstrip()) and body.strip():
            return None, ""  # maybe the opening tag, still arriving
        if self.name == "qwen3" and not opened:
            return None, text
        end = body.find(END)
        if end < 0:  # still thinking (or stopped while thinking)
            hold = 0 if final else held_prefix(body, END)
            return body[:len(body) - hold], ""
        return body[:end], body[end + len(END):]

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole reply, each None when empty."""
        reasoning, answer = self.split(text, final=True)
        return (reasoning or None), (answer or None)


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser named `name`. Raises ValueError listing REASONING_PARSERS."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {list(REASONING_PARSERS)}")
    return ReasoningParser(name)


class ReasoningStream:
    """A reply's text as it streams -> (new reasoning, new answer) per `feed(text_so_far)`;
    `finish(text)` the rest once the reply is whole (text held back as a possible tag)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self._reasoning = self._answer = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning, answer = self.parser.split(text, final)
        reasoning = reasoning or ""
        new_r = reasoning[self._reasoning:]
        new_a = answer[self._answer:]
        self._reasoning = max(self._reasoning, len(reasoning))
        self._answer = max(self._answer, len(answer))
        return new_r, new_a

    def finish(self, text: str) -> tuple[str, str]:
        return self.feed(text, final=True)


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "reasoning_parser"]
