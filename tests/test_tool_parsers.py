"""Tool-call parsers (jaxserve.entrypoints.openai.tool_parsers) against hand-written model
outputs, the well-formed and the malformed ones the trackers report (a tag split over two
deltas, trailing text, several calls, a missing closing tag, invalid JSON), whole and
streamed one character at a time: the streamed content and argument pieces, joined, are
the whole reply's, and no piece of a tag ever goes out as content. Plain Python."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints.openai.tool_parsers import RequiredParser, ToolCallStream, tool_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'

# parser, model output, expected content (None: calls only), expected [(name, arguments)]
CASES = [
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", f"Let me check.\n<tool_call>{WEATHER}</tool_call>", "Let me check.\n",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>'
               '{"name": "b", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>', None,
     [("a", "{}"), ("b", '{"x": [1, {"y": "}"}]}')]),
    ("hermes", f"<tool_call>{WEATHER}", None,  # the generation ended before the end tag
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", f"<tool_call>{WEATHER}</tool_call> Anything else?", " Anything else?",
     [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", 'He wrote "<tool" then stopped.', 'He wrote "<tool" then stopped.', []),
    ("hermes", '<tool_call>{"arguments": {"q": "a\\"b"}, "name": "search"}</tool_call>', None,
     [("search", '{"q": "a\\"b"}')]),
    ("hermes", '<tool_call>[{"name": "a", "arguments": {"n": 1}}, {"name": "b", "arguments": '
               '{}}]</tool_call>', None, [("a", '{"n": 1}'), ("b", "{}")]),  # SmolLM2's form
    ("hermes", '<tool_call>[1, 2]</tool_call>', '<tool_call>[1, 2]</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; '
                    '{"name": "b", "parameters": {}}', None, [("a", '{"n": 1}'), ("b", "{}")]),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    ("llama3_json", '{"name": "a", "parameters": {}} thanks', "thanks", [("a", "{}")]),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "b", "arguments": {}}]', None,
     [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]b{}', "Sure. ",
     [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    ("mistral", "No calls [TOOL here", "No calls [TOOL here", []),
    ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2.5)]', None,
     [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2.5}')]),
    ("pythonic", "Paris.", "Paris.", []),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("required", '[{"name": "a", "parameters": {"n": 1}}, {"name": "b", "parameters": {}}]',
     None, [("a", '{"n": 1}'), ("b", "{}")]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed(name, text, content, calls):
    make = (lambda: RequiredParser()) if name == "required" else (lambda: tool_parser(name))
    parser = make()
    got = parser.extract(text)
    assert got.content == content
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    for c in got.tool_calls:
        json.loads(c.arguments)
        assert c.id.startswith("call_") and len(c.id) == 29
    stream = ToolCallStream(make())
    sent_content, pieces = "", {}
    for n in range(1, len(text) + 1):  # one character at a time
        new, deltas = stream.feed(text[:n])
        sent_content += new
        for d in deltas:
            entry = pieces.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
            if d.id is not None:  # id and name only in a call's first piece
                assert d.index == len(pieces) - 1 and entry["id"] == d.id
            else:
                assert d.name is None
            entry["arguments"] += d.arguments
    new, deltas = stream.finish(text)
    sent_content += new
    for d in deltas:
        pieces.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})["arguments"] += d.arguments
    assert sent_content == (content or "")
    assert [(p["name"], p["arguments"]) for _, p in sorted(pieces.items())] == calls
    assert len({p["id"] for p in pieces.values()}) == len(pieces)
    assert [(c.name, c.arguments) for c in stream.tool_calls] == calls


def test_a_tag_split_over_deltas_is_never_content():
    """Hermes' start tag arriving in two pieces ("<tool" then "_call>..."): nothing of it
    is sent as content, and the call comes out whole (the space before the tag is held
    back until the reply ends: whitespace next to calls may be a gap between them)."""
    stream = ToolCallStream(tool_parser("hermes"))
    text = f"Checking. <tool_call>{WEATHER}</tool_call>"
    cut = text.index("<tool") + len("<tool")
    first, _ = stream.feed(text[:cut])
    assert first == "Checking."
    rest, deltas = stream.feed(text)
    assert rest == "" and deltas[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas) == '{"city": "Paris", "unit": "c"}'
    assert stream.finish(text) == (" ", [])


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \['hermes', 'llama3_json', 'mistral', 'pythonic'\]"):
        tool_parser("openai")
