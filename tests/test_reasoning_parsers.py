"""Reasoning parsers (jaxserve.entrypoints.openai.reasoning_parsers): thinking split from
the answer, whole and streamed one character at a time (the pieces, joined, are the whole
reply's; no piece of a tag is ever sent). Plain Python."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.openai.reasoning_parsers import ReasoningStream, reasoning_parser

CASES = [  # parser, reply, reasoning_content, content
    ("deepseek_r1", "First, 2 + 2.\nSo 4.</think>\n\nThe answer is 4.", "First, 2 + 2.\nSo 4.",
     "\n\nThe answer is 4."),
    ("deepseek_r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit",
     None),
    ("deepseek_r1", "a < b and c </thin k>?</think>ok", "a < b and c </thin k>?", "ok"),
    ("deepseek_r1", "</think>Direct.", None, "Direct."),
    ("qwen3", "<think>\nUser greets.\n</think>\n\nHello!", "\nUser greets.\n", "\n\nHello!"),
    ("qwen3", "Hello! No thinking here.", None, "Hello! No thinking here."),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "Use <think> tags like this.", None, "Use <think> tags like this."),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed(name, text, reasoning, content):
    parser = reasoning_parser(name)
    assert parser.extract(text) == (reasoning, content)
    stream = ReasoningStream(parser)
    got_r = got_a = ""
    for n in range(1, len(text) + 1):
        r, a = stream.feed(text[:n])
        assert "<think>" not in r + a and "</think>" not in r + a
        got_r, got_a = got_r + r, got_a + a
    r, a = stream.finish(text)
    got_r, got_a = got_r + r, got_a + a
    assert (got_r or None, got_a or None) == (reasoning, content)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \['deepseek_r1', 'qwen3'\]"):
        reasoning_parser("granite")
