"""Tool-call parsers: the function calls in a model's free text, in the formats the chat
templates of the families we serve teach their models (vLLM's `--tool-call-parser`
names), whole (`ToolParser.extract`) and as the text streams (`ToolCallStream`).

- "hermes" (Hermes 2/3, Qwen2.5): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, text before the first one is the message's content; a JSON array of such
  objects in one tag is read too (SmolLM2's function-calling format);
- "llama3_json" (Llama 3.1/3.2 JSON tool calling): the reply is `{"name": ...,
  "parameters": {...}}` (optionally after `<|python_tag|>`), several joined by ";";
- "mistral": `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects, or (v11+
  tokenizers) `name{...}` per call, text before it is content;
- "pythonic" (Llama 3.2 / 4 pythonic, ToolACE): the reply is a Python list of calls,
  `[get_weather(city="Paris"), f(x=1)]`, keyword arguments of literal values.

What the trackers report broken is handled: a tag split over two streamed deltas (the
partial tag is held back, never sent as content), trailing text after the calls (kept as
content, not lost), several calls in one reply, a closing tag missing at the end of the
generation (a complete JSON object still counts), an object that is not valid JSON (the
text stays content, nothing is dropped).

A call's `arguments` is a JSON string: for the JSON formats the text of the arguments
object exactly as the model wrote it (so that the streamed pieces, joined, are the final
string, as the OpenAI SDK accumulates them), for pythonic `json.dumps` of the literal
values. Streaming (`ToolCallStream.feed`) re-reads the text so far with a tolerant
scanner and sends what is new: content, then per call its id and name once, then its
arguments in pieces.

Source: vLLM's tool parsers (vllm/entrypoints/openai/tool_parsers: hermes, llama3_json,
mistral, pythonic) and the chat templates of Hermes 3, Llama 3.1/3.2 and Mistral v0.3.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid

from jaxserve.config.server import TOOL_CALL_PARSERS as TOOL_PARSERS


def call_id() -> str:
    """A new tool call id: "call_" + 24 hex digits (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class ToolCall:
    """One function call: id, name, arguments (a JSON object's text)."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=call_id)


@dataclasses.dataclass
class Extracted:
    """A reply split into its content (None when only calls) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class _Partial:
    """A call as far as the text shows it: name once complete, arguments' text so far
    (grows by appending), done once its object is closed."""

    name: str | None = None
    arguments: str = ""
    done: bool = False


# --- a tolerant scanner of (possibly unfinished) JSON objects -----------------------------

def _skip_string(text: str, i: int) -> int:
    """The index after the JSON string starting at text[i] == '"', or -1 if it is not
    closed."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


def _skip_value(text: str, i: int) -> tuple[int, bool]:
    """(end, complete) of the JSON value starting at text[i] (after whitespace)."""
    n = len(text)
    if i >= n:
        return n, False
    if text[i] == '"':
        end = _skip_string(text, i)
        return (end, True) if end >= 0 else (n, False)
    if text[i] in "{[":
        depth, j = 0, i
        while j < n:
            c = text[j]
            if c == '"':
                j = _skip_string(text, j)
                if j < 0:
                    return n, False
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1, True
            j += 1
        return n, False
    m = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(text, i)
    if m is None:
        return i, False
    return m.end(), m.end() < n  # a number may go on while the text does


def _scan_call(text: str, args_key: tuple[str, ...]) -> tuple[_Partial, int] | None:
    """The call object starting at text[0] == "{": its name (once its string is closed),
    the text of its arguments value so far (`args_key`'s), whether the object is closed,
    and the index after it. None when the text is not such an object (a key other than
    name / args_key, or not JSON)."""
    call = _Partial()
    i, n = 1, len(text)
    ws = re.compile(r"\s*")
    while True:
        i = ws.match(text, i).end()
        if i >= n:
            return call, n
        if text[i] == "}":
            call.done = call.name is not None
            return (call, i + 1) if call.done else None
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        end = _skip_string(text, i)
        if end < 0:
            return call, n
        key = text[i + 1:end - 1]
        i = ws.match(text, end).end()
        if i >= n:
            return call, n
        if text[i] != ":":
            return None
        i = ws.match(text, i + 1).end()
        vend, complete = _skip_value(text, i)
        if key == "name":
            if complete:
                try:
                    call.name = json.loads(text[i:vend])
                except ValueError:
                    return None
                if not isinstance(call.name, str):
                    return None
        elif key in args_key:
            if i < n and text[i] != "{":
                return None
            call.arguments = text[i:vend]
        else:
            return None
        if not complete:
            return call, n
        i = vend


def _array_calls(body: str, args_key: tuple[str, ...]) -> list[_Partial] | None:
    """The calls of a JSON array of call objects (body[0] == "["), as far as it goes; None
    when an element is not a call object."""
    calls, i = [], 1
    while True:
        i += len(body[i:]) - len(body[i:].lstrip())
        if i >= len(body) or body[i] == "]":
            return calls
        if body[i] == ",":
            i += 1
            continue
        scanned = _scan_call(body[i:], args_key)
        if scanned is None:
            return None
        call, end = scanned
        calls.append(call)
        if not call.done:
            return calls
        i += end


# --- the parsers ------------------------------------------------------------------------

class ToolParser:
    """A reply's content and calls as far as `text` shows them (`partial`), and whole
    (`extract`). Subclasses are the formats."""

    name = ""

    def partial(self, text: str, final: bool) -> tuple[str, list[_Partial]]:
        """(content so far, calls so far) of `text`; `final`: the text is the whole
        reply (nothing more is coming, held-back text is content)."""
        raise NotImplementedError

    def extract(self, text: str) -> Extracted:
        """The whole reply's content (None if empty) and its complete calls."""
        content, calls = self.partial(text, final=True)
        done = [ToolCall(c.name, c.arguments or "{}") for c in calls if c.done]
        return Extracted(content if content.strip() or not done else None, done)

    # For chat templates that do not take `tools` (SmolLM2's, many fine-tunes'): the tools
    # are described in a system message in this parser's format, and the history's calls
    # and results written as text in it, as llama.cpp's generic tool-call fallback does.

    def system_prompt(self, tools: list[dict]) -> str:
        """The instructions describing `tools` (OpenAI tool objects) and the call format."""
        raise NotImplementedError

    def render_calls(self, calls: list[tuple[str, dict]]) -> str:
        """An assistant turn's calls ((name, arguments object) each) as this format's text."""
        raise NotImplementedError

    @staticmethod
    def render_result(content: str, name: str | None) -> str:
        """A tool's result (`name`: the function whose call it answers, if known), as the
        text of the user turn that carries it back: plain words, which a model not
        trained on a tool format answers from (measured on SmolLM2-135M: wrapped in
        Hermes' <tool_response> tags it echoes them instead)."""
        return f"{name or 'The tool'} returned: {content}"


def _tool_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `tag` (held back
    while streaming: they may be the start of the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _content(segments: list[str], have_calls: bool, final: bool) -> str:
    """The content of text segments around tool calls: with calls, the whitespace-only
    segments (the newlines between calls) are not content; while streaming, trailing
    whitespace is held back until text follows it (it may turn out to be such a gap)."""
    text = "".join(seg for seg in segments if not (have_calls and not seg.strip()))
    return text if final else text.rstrip()


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def system_prompt(self, tools):  # the Hermes 3 / Qwen2.5 templates' words
        return ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                f"tags:\n<tools>\n{_tool_lines(tools)}\n</tools>\n\nFor each function call, "
                "return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")

    def render_calls(self, calls):
        return "\n".join(f"{self.START}\n" + json.dumps({"name": n, "arguments": a},
                                                        ensure_ascii=False) + f"\n{self.END}"
                         for n, a in calls)

    def partial(self, text, final):
        calls, segments, i = [], [], 0
        while True:
            j = text.find(self.START, i)
            if j < 0:
                rest = text[i:]
                hold = 0 if final else held_prefix(rest, self.START)
                segments.append(rest[:len(rest) - hold])
                return _content(segments, bool(calls), final), calls
            segments.append(text[i:j])
            body_start = j + len(self.START)
            k = text.find(self.END, body_start)
            body = text[body_start:k if k >= 0 else len(text)]
            lead = len(body) - len(body.lstrip())
            if body[lead:lead + 1] == "[":  # several calls in one tag (SmolLM2's format)
                many = _array_calls(body[lead:], ("arguments", "parameters"))
                scanned = (many, 0) if many is not None else None
            else:
                scanned = _scan_call(body[lead:], ("arguments", "parameters")) \
                    if body[lead:lead + 1] in ("{", "") else None
                scanned = ([scanned[0]], 0) if scanned is not None else None
            if scanned is None:  # not a call: the text is content
                if k < 0:
                    if final:
                        segments.append(text[j:])
                    return _content(segments, bool(calls), final), calls
                segments.append(text[j:k + len(self.END)])
                i = k + len(self.END)
                continue
            calls.extend(scanned[0])
            if k < 0:
                return _content(segments, True, final), calls
            i = k + len(self.END)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def system_prompt(self, tools):  # the Llama 3.1 template's words
        return ("Given the following functions, please respond with a JSON for a function "
                "call with its proper arguments that best answers the given prompt.\n\n"
                "Respond in the format {\"name\": function name, \"parameters\": dictionary "
                "of argument name and its value}. Do not use variables.\n\n"
                + "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools))

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)

    def partial(self, text, final):
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(body):  # maybe the tag, still arriving
            return "", []
        if not final and not body:
            return "", []
        if not body.startswith("{"):
            return text, []
        calls, i = [], 0
        while True:
            scanned = _scan_call(body[i:], ("parameters", "arguments"))
            if scanned is None:  # not a call object: the reply is text
                return (text, []) if final or not calls else ("", calls)
            call, end = scanned
            calls.append(call)
            if not call.done:
                return "", calls
            rest = body[i + end:].lstrip()
            if not rest.startswith(";"):  # the end, or trailing text: content
                return rest, calls
            rest = rest[1:].lstrip()
            if not rest:
                return "", calls
            i = len(body) - len(rest)


class MistralParser(ToolParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def system_prompt(self, tools):
        return (f"[AVAILABLE_TOOLS]{json.dumps(tools, ensure_ascii=False)}[/AVAILABLE_TOOLS]\n"
                "To call functions, reply with [TOOL_CALLS] followed by a JSON list of "
                "{\"name\": function name, \"arguments\": arguments object}.")

    def render_calls(self, calls):
        return self.TAG + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                     ensure_ascii=False)

    def partial(self, text, final):
        j = text.find(self.TAG)
        if j < 0:
            hold = 0 if final else held_prefix(text, self.TAG)
            return text[:len(text) - hold], []
        content, body = _content([text[:j]], True, final), text[j + len(self.TAG):].lstrip()
        calls = []
        if body.startswith("["):  # a JSON array of {"name", "arguments"}
            calls = _array_calls(body, ("arguments", "parameters"))
            return ((text if final else content), []) if calls is None else (content, calls)
        # v11+: name{arguments} per call, each after its own [TOOL_CALLS]
        for piece in text[j:].split(self.TAG)[1:]:
            m = re.match(r"\s*([A-Za-z_][\w.\-]*)\s*(\{.*)?", piece, re.S)
            if m is None:
                continue
            call = _Partial(name=m.group(1) if m.group(2) is not None or final else None)
            if m.group(2) is not None:
                end, complete = _skip_value(m.group(2), 0)
                call.arguments, call.done = m.group(2)[:end], complete
            calls.append(call)
        return content, calls


class PythonicParser(ToolParser):
    name = "pythonic"

    def system_prompt(self, tools):  # the Llama 3.2 pythonic template's words
        return ("You are an expert in composing functions. You are given a question and a set "
                "of possible functions. Based on the question, you will need to make one or "
                "more function/tool calls to achieve the purpose.\nIf you decide to invoke any "
                "of the function(s), you MUST put it in the format of [func_name1(params_name1"
                "=params_value1, params_name2=params_value2...), func_name2(params)]\nYou "
                "SHOULD NOT include any other text in the response if you call a function\n"
                "Here is a list of functions in JSON format that you can invoke.\n"
                + json.dumps(tools, indent=4, ensure_ascii=False))

    def render_calls(self, calls):
        return "[" + ", ".join(
            f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
            for n, a in calls) + "]"

    def partial(self, text, final):
        body = text.strip()
        if not body.startswith("["):
            return ("" if not final and not body else text), []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return (text if final else ""), []  # unfinished: nothing to send yet
        if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call)
                                                      for e in tree.elts):
            return text, []
        calls = []
        try:
            for e in tree.elts:
                if e.args:
                    raise ValueError("positional arguments")
                args = {k.arg: ast.literal_eval(k.value) for k in e.keywords}
                calls.append(_Partial(name=ast.unparse(e.func), done=True,
                                      arguments=json.dumps(args, ensure_ascii=False)))
        except ValueError:
            return text, []
        return "", calls


class RequiredParser(ToolParser):
    """`tool_choice: "required"`: the reply is what the grammar made it, a JSON array of
    {"name", "parameters"} objects (vLLM's form for required), read as it streams. Not a
    --tool-call-parser."""

    name = "required"

    def partial(self, text, final):
        body = text.lstrip()
        calls = _array_calls(body, ("parameters", "arguments")) if body.startswith("[") else None
        return ("", calls) if calls is not None else ((text if final else ""), [])


_PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser named `name` (TOOL_PARSERS). Raises ValueError listing them."""
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {list(TOOL_PARSERS)}")
    return _PARSERS[name]()


# --- streaming --------------------------------------------------------------------------

@dataclasses.dataclass
class ToolCallDelta:
    """A streamed call's piece (OpenAI's `delta.tool_calls[i]`): index; id and name in the
    call's first piece only; arguments' new text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class ToolCallStream:
    """A reply's text as it streams -> what to send: `feed(text_so_far)` returns (new
    content, [ToolCallDelta]); `finish(text)` the rest once the reply is whole. Each
    call's id and name go out once its name is complete, its arguments as they grow."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self._content = 0
        self._sent: list[ToolCallDelta] = []  # per call: id, name, arguments sent so far

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        content, calls = self.parser.partial(text, final)
        new_content = content[self._content:] if len(content) > self._content else ""
        self._content = max(self._content, len(content))
        deltas = []
        for i, call in enumerate(calls):
            if call.name is None or (final and not call.done):
                break
            if i == len(self._sent):
                sent = ToolCallDelta(i, "", call_id(), call.name)
                self._sent.append(sent)
                deltas.append(ToolCallDelta(i, "", sent.id, call.name))
            sent = self._sent[i]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                piece = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                if deltas and deltas[-1].index == i:
                    deltas[-1].arguments += piece
                else:
                    deltas.append(ToolCallDelta(i, piece))
        return new_content, deltas

    def finish(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The rest of a whole reply: content held back (a partial tag that never became
        one), arguments not sent yet; a call left with no arguments gets "{}"."""
        content, deltas = self.feed(text, final=True)
        for sent in self._sent:
            if not sent.arguments:
                sent.arguments = "{}"
                deltas.append(ToolCallDelta(sent.index, "{}"))
        return content, deltas

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls sent so far, each with its arguments joined."""
        return [ToolCall(s.name, s.arguments, s.id) for s in self._sent]


__all__ = ["TOOL_PARSERS", "Extracted", "ToolCall", "ToolCallDelta", "ToolCallStream",
           "ToolParser", "held_prefix", "tool_parser"]
