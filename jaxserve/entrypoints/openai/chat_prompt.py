"""A chat request's prompt: its messages (and the tools the model may call) rendered by the
model's chat template, and how its replies are read, from `tool_choice` and the server's
tool-call and reasoning parsers (`ChatParsers`, `tool_choice`, `chat_text`).

Source: vLLM's chat handling (`tools` passed to the template, tool_choice "auto" with
--enable-auto-tool-choice, "required"'s schema), transformers' `apply_chat_template(tools=)`,
llama.cpp's generic tool-call fallback for templates without tools.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from jaxserve.entrypoints.openai.chat_reply import AUTO, NAMED, REQUIRED, ReplyFormat
from jaxserve.entrypoints.openai.errors import MAX_MESSAGE_CHARS, ApiError
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.reasoning_parsers import ReasoningParser, reasoning_parser
from jaxserve.entrypoints.openai.tool_parsers import HermesParser, ToolParser, tool_parser
from jaxserve.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxserve.config import ServerConfig


@dataclasses.dataclass(frozen=True)
class ChatParsers:
    """How the server reads chat replies: its tool-call parser (--tool-call-parser; also
    the format tools are described in for chat templates without tools), whether "auto"
    tool choice is on (--enable-auto-tool-choice), its reasoning parser
    (--reasoning-parser). Source: vLLM's flags of those names."""

    tool_parser: ToolParser | None = None
    auto_tool_choice: bool = False
    reasoning: ReasoningParser | None = None

    @classmethod
    def of(cls, server: ServerConfig) -> "ChatParsers":
        """The parsers `server` names (its names are checked by ServerConfig)."""
        return cls(tool_parser(server.tool_call_parser) if server.tool_call_parser else None,
                   server.enable_auto_tool_choice,
                   reasoning_parser(server.reasoning_parser) if server.reasoning_parser
                   else None)


def _tool_arguments(arguments: str, param: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(f"{param}: must be a JSON object's text", param)
    return value


def chat_text(messages, tokenizer: Tokenizer, add_generation_prompt: bool,
              tools: list[dict] | None = None, parser: ToolParser | None = None) -> str:
    """ChatMessages rendered by the model's chat template (text parts joined by "\\n", as
    vLLM does), with `tools` (OpenAI tool objects the model may call). A template that
    takes `tools` gets them, and the history's `tool_calls` (arguments as objects) and
    `tool_call_id`s, as transformers passes them; one that does not (SmolLM2's) gets the
    tools described in a system message in `parser`'s format (hermes when none), the
    history's calls written in it and tool results as user turns in words (after
    llama.cpp's generic fallback). Raises ApiError (400, "messages...") when the template
    refuses them or a call's arguments are not a JSON object."""
    template = tokenizer.chat_template
    native = template is not None and "tools" in template.variables
    parser = parser or HermesParser()
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or () if c.id}
    rendered = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        calls = [(c.id, c.function.name, _tool_arguments(
            c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"))
            for j, c in enumerate(m.tool_calls or ())]
        if native:
            one = {"role": m.role, "content": content, "name": m.name,
                   "tool_call_id": m.tool_call_id}
            if calls:
                one["tool_calls"] = [{"id": cid, "type": "function",
                                      "function": {"name": name, "arguments": args}}
                                     for cid, name, args in calls]
        elif m.role == "tool":
            one = {"role": "user", "content": parser.render_result(
                content or "", names.get(m.tool_call_id) or m.name)}
        elif calls:
            written = parser.render_calls([(name, args) for _, name, args in calls])
            one = {"role": m.role, "content": f"{content}\n{written}" if content else written}
        else:
            one = {"role": m.role, "content": content, "name": m.name}
        rendered.append(one)
    kwargs = {}
    if tools and native:
        kwargs["tools"] = tools
    elif tools:
        prompt = parser.system_prompt(tools)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content'] or ''}\n\n{prompt}".lstrip()}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as e:  # ChatTemplateError, or a template failing in another way
        detail = str(e) if isinstance(e, ValueError) else "the template failed on these messages"
        raise ApiError(f"chat template: {detail}"[:MAX_MESSAGE_CHARS], "messages") from None
    if not isinstance(text, str):
        raise ApiError("chat template: the template did not render text", "messages")
    return text


def tool_choice(req: ChatCompletionRequest, parsers: ChatParsers
                 ) -> tuple[ReplyFormat, dict | None, str]:
    """How the replies are read (ReplyFormat), the schema a grammar holds the calls to
    (None: none) and the tool(s) it comes from (for errors). "auto" (the default with
    tools) needs --enable-auto-tool-choice, as in vLLM; "required" is a JSON array of one
    (parallel_tool_calls false) or more calls of the tools, each {"name", "parameters"}
    and no other key (vLLM's schema, which xgrammar holds to those keys by default);
    named: that function's arguments."""
    choice, tools = req.tool_choice, req.tools or []
    parallel = req.parallel_tool_calls is not False
    base = ReplyFormat(reasoning=parsers.reasoning, parallel=parallel)
    if choice == "none" or (choice in (None, "auto") and not tools):
        return base, None, ""
    if not tools:
        raise ApiError("tool_choice: needs 'tools' to choose from", "tool_choice")
    if choice in (None, "auto"):
        if not parsers.auto_tool_choice:
            raise ApiError("tool_choice: \"auto\" (the default with tools) needs a server run "
                           "with --enable-auto-tool-choice --tool-call-parser NAME; send "
                           "\"required\", a named function ({\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}) or \"none\"", "tool_choice")
        return dataclasses.replace(base, tools=AUTO, parser=parsers.tool_parser), None, ""
    if choice == "required":
        options = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]},
            "parameters": t.function.parameters or {"type": "object"}},
            "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
        if not parallel:
            schema["maxItems"] = 1
        label = ", ".join(json.dumps(t.function.name[:100]) for t in tools)
        return dataclasses.replace(base, tools=REQUIRED), schema, f"the tools {label}"[:300]
    for tool in tools:
        if tool.function.name == choice.function.name:
            return (dataclasses.replace(base, tools=NAMED, function=tool.function.name),
                    tool.function.parameters or {"type": "object"},
                    f"tool {json.dumps(tool.function.name[:100])}")
    raise ApiError(f"tool_choice: no tool named {json.dumps(choice.function.name[:100])} in "
                   "tools", "tool_choice")
