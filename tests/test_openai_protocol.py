"""The request/response layer on its own (no server, no model): every request field's type
and range gives a 400 naming it, malformed bodies of any kind give a 400 (never another
exception), valid requests give the expected ParsedRequest, and the OpenAPI document is
self-contained and agrees with what the server sends."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from fake_engine import tiny_tokenizer
from jaxserve.config import ServerConfig
from jaxserve.entrypoints.openai.protocol import (ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, CompletionChunk,
                                                  CompletionRequest, CompletionResponse,
                                                  ErrorResponse, ModelList)
from jaxserve.entrypoints.openai.request import (MAX_CHOICES, ApiError, ParsedRequest,
                                                 RequestLimits, parse_chat_request,
                                                 parse_completion_request,
                                                 parse_embedding_request)
from jaxserve.entrypoints.openai.response import CHAT, COMPLETION, usage
from jaxserve.entrypoints.openai.openapi import openapi_schema
from jaxserve.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from jaxserve.tokenization.tokenizer import Tokenizer

from tools import request_fuzz  # noqa: E402
from jaxserve.entrypoints.openai.chat_reply import ReplyFormat  # noqa: E402

request_strategies, dump_body = request_fuzz.request_strategies, request_fuzz.dump_body

TOK = tiny_tokenizer()
VOCAB = TOK.vocab_size  # 258
MODEL = "fake-model"
LIMITS = RequestLimits(64)
BIG = RequestLimits(4096)  # prompts with tools described in them (one token per byte)
MSGS = [{"role": "user", "content": "Hi"}]


def _raw(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def comp(body, limits=LIMITS, tok=TOK) -> ParsedRequest:
    return parse_completion_request(_raw(body), tok, MODEL, limits)


def chat(body, limits=LIMITS, tok=TOK) -> ParsedRequest:
    return parse_chat_request(_raw(body), tok, MODEL, limits)


def refused(parse, body, param, fragment=None, status=400, **kw) -> ApiError:
    """Assert `parse(body)` raises ApiError naming `param` (message has `fragment`)."""
    with pytest.raises(ApiError) as info:
        parse(body, **kw)
    e = info.value
    assert (e.status, e.param) == (status, param), (body if len(str(body)) < 300 else "...", e.message)
    assert fragment is None or fragment in e.message, e.message
    assert "Traceback" not in e.message
    assert len(e.message) <= 500
    body_ = e.body()["error"]
    assert set(body_) == {"message", "type", "param", "code"}
    return e


# -- seed, top_k, integers ----------------------------------------------------------------

@pytest.mark.parametrize("seed", [-5, 0, 7, SEED_MIN, SEED_MAX])
def test_seed_accepted_over_its_whole_range(seed):
    assert comp({"prompt": "Hi", "seed": seed}).params.seed == seed
    assert chat({"messages": MSGS, "seed": seed}).params.seed == seed


@pytest.mark.parametrize("seed, fragment", [
    (2**63, "less than or equal to 9223372036854775807"), (2**64, "9223372036854775807"),
    (-2**63 - 1, "greater than or equal to -9223372036854775808"),
    (True, "valid integer"), (False, None), (1.5, None), (1.0, None), ("3", None), ([3], None),
    ({}, None)])
def test_seed_out_of_range_or_wrong_type(seed, fragment):
    refused(comp, {"prompt": "Hi", "seed": seed}, "seed", fragment)
    refused(chat, {"messages": MSGS, "seed": seed}, "seed", fragment)


def test_huge_integers_refused_without_echoing_them():
    digits = b"9" * 5001
    for raw in (b'{"prompt": "Hi", "seed": ' + digits + b"}",
                b'{"prompt": "Hi", "extra": ' + digits + b"}",
                b'{"prompt": "Hi", "extra": [-' + digits + b"]}"):
        e = refused(comp, raw, None, "not valid JSON")
        assert "99999" not in e.message
    # Thousands of digits that the JSON parser does take: refused by the field's range.
    e = refused(comp, b'{"prompt": "Hi", "seed": ' + b"9" * 4000 + b"}", "seed", "less than")
    assert "99999" not in e.message
    e = refused(comp, b'{"prompt": "Hi", "max_tokens": ' + b"9" * 4000 + b"}", "max_tokens")
    assert "99999" not in e.message
    refused(comp, b'{"prompt": [' + b"9" * 4000 + b"]}", "prompt.0")
    refused(comp, b'{"prompt": "Hi", "top_k": ' + b"9" * 4000 + b"}", "top_k")
    assert comp(b'{"prompt": "Hi", "extra": ' + b"9" * 4000 + b"}").prompt_ids == [72, 105]


@pytest.mark.parametrize("top_k", [-1, 0, 1, 5, VOCAB])
def test_top_k_accepted_up_to_the_vocabulary(top_k):
    assert comp({"prompt": "Hi", "top_k": top_k}).params.top_k == top_k


@pytest.mark.parametrize("top_k, fragment", [(VOCAB + 1, str(VOCAB)), (2**31, str(VOCAB)),
                                             (2**63, None), (-2, "-1"), (2.5, None),
                                             (True, None), ("5", None)])
def test_top_k_refused(top_k, fragment):
    refused(comp, {"prompt": "Hi", "top_k": top_k}, "top_k", fragment)
    refused(chat, {"messages": MSGS, "top_k": top_k}, "top_k", fragment)


def test_n_choices_and_their_seeds():
    assert comp({"prompt": "Hi", "n": 1}).params.max_tokens == 16
    r = comp({"prompt": "Hi", "n": 3, "seed": 7, "temperature": 0.5})
    assert r.n == 3 and r.prompts == [TOK.encode("Hi")]
    assert [(i, p.seed) for i, _, p in r.choices()] == [(0, 7), (1, 8), (2, 9)]
    top = comp({"prompt": "Hi", "n": 2, "seed": SEED_MAX})
    assert [p.seed for _, _, p in top.choices()] == [SEED_MAX, SEED_MIN]
    unseeded = chat({"messages": MSGS, "n": 2})
    assert [(i, p.seed) for i, _, p in unseeded.choices()] == [(0, None), (1, None)]
    for n in (0, -1, True, 1.0, "1", 2**64):
        refused(comp, {"prompt": "Hi", "n": n}, "n")
    refused(comp, {"prompt": "Hi", "n": MAX_CHOICES + 1}, "n", str(MAX_CHOICES))
    refused(comp, {"prompt": ["a", "b"], "n": MAX_CHOICES // 2 + 1}, "n", "x 2")


def test_batched_prompts():
    r = comp({"prompt": ["Hi", "you there"], "n": 2})
    assert r.prompts == [TOK.encode("Hi"), TOK.encode("you there")]
    assert [(i, ids) for i, ids, _ in r.choices()] == [
        (0, r.prompts[0]), (1, r.prompts[0]), (2, r.prompts[1]), (3, r.prompts[1])]
    assert comp({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    assert comp({"prompt": [[1, 2]]}).prompts == [[1, 2]]  # a batch of one
    refused(comp, {"prompt": [[1, 2], [3, VOCAB]]}, "prompt.1", str(VOCAB))
    refused(comp, {"prompt": ["a", ""]}, "prompt.1", "empty")
    refused(comp, {"prompt": ["a", "x" * 70]}, "prompt.1", "64")


# -- JSON-level refusals ------------------------------------------------------------------

SURROGATE_BODIES = [
    (comp, b'{"prompt": "a\\ud800b"}'),
    (comp, b'{"prompt": "\\udc00"}'),
    (chat, b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}'),
    (chat, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
    (comp, b'{"prompt": "Hi", "stop": ["ok", "\\ud800"]}'),
    (comp, b'{"prompt": "Hi", "stop": "\\udfff"}'),
    (comp, b'{"prompt": "Hi", "extra": "\\ud800"}'),
    (comp, '{"prompt": "a\ud800"}'.encode("utf-8", "surrogatepass")),  # raw, not escaped
]


@pytest.mark.parametrize("parse, raw", SURROGATE_BODIES)
def test_lone_surrogates_refused(parse, raw):
    refused(parse, raw, None, "not valid JSON")


def test_a_valid_surrogate_pair_is_one_character():
    assert comp(b'{"prompt": "\\ud83d\\ude00"}').prompt_ids == list("😀".encode())


@pytest.mark.parametrize("parse", [comp, chat])
def test_deep_nesting_refused(parse):
    depth = 100_000
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        raw = b'{"prompt": "Hi", "messages": [], "extra": ' + opener * depth + b"1" + closer * depth + b"}"
        refused(parse, raw, None, "not valid JSON")
    refused(parse, b"[" * depth + b"]" * depth, None)


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"3", b"null", b"true", b"[]",
                                 b'[{"prompt": "Hi"}]'])
def test_body_not_an_object(raw):
    for parse in (comp, chat):
        refused(parse, raw, None, "request body must be a JSON object")


@pytest.mark.parametrize("raw", [b"", b" ", b"{not json", b"\xff\xfe", b'{"prompt": "\xff"}',
                                 b'{"prompt": "\xc3"}', b'{"prompt": "\xed\xa0\x80"}',
                                 b'\xef\xbb\xbf{"prompt": "Hi"}', b'{"prompt": "Hi"} x',
                                 b'{"prompt": "Hi",}', b"\x00"])
def test_malformed_bodies(raw):
    for parse in (comp, chat):
        refused(parse, raw, None, "not valid JSON")


# -- sampling fields ----------------------------------------------------------------------

@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", -0.5, "greater than or equal to 0"), ("temperature", "hot", None),
    ("temperature", True, None), ("temperature", 1e400, "finite"),
    ("top_p", 0, "greater than 0"), ("top_p", 1.5, "less than or equal to 1"), ("top_p", -1, None),
    ("min_p", 2, "less than or equal to 1"), ("min_p", -0.1, None),
    ("presence_penalty", 2.5, "less than or equal to 2"), ("presence_penalty", -3, "-2"),
    ("frequency_penalty", 3, "less than or equal to 2"),
    ("repetition_penalty", 0, "greater than 0"), ("repetition_penalty", -1, None),
    ("max_tokens", 0, "greater than or equal to 1"), ("max_tokens", -3, None),
    ("max_tokens", "5", None), ("max_tokens", 1.5, None), ("max_tokens", True, None),
    ("stream", "yes", None), ("stream", 1, None), ("ignore_eos", 1, None),
    ("stop", 5, None), ("stop", [""], "non-empty"), ("model", 3, None),
])
def test_field_out_of_range_or_wrong_type(field, value, fragment):
    refused(comp, {"prompt": "Hi", field: value}, field, fragment)
    refused(chat, {"messages": MSGS, field: value}, field, fragment)


@pytest.mark.parametrize("raw", [b'{"prompt": "Hi", "temperature": NaN}',
                                 b'{"prompt": "Hi", "temperature": Infinity}',
                                 b'{"prompt": "Hi", "top_p": -Infinity}'])
def test_non_finite_floats(raw):
    with pytest.raises(ApiError) as info:
        comp(raw)
    assert info.value.status == 400 and info.value.param in (None, "temperature", "top_p")


@pytest.mark.parametrize("field, value", [("best_of", 2), ("suffix", "x")])
def test_in_range_but_not_supported(field, value):
    refused(comp, {"prompt": "Hi", field: value}, field, "not supported")
    refused(chat, {"messages": MSGS, field: value}, field, "not supported")


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_structured_output_fields_become_one_constraint():
    def spec(parse, body):
        so = parse(body).params.structured_outputs
        return so if so is None else (so.kind, so.value, so.field)
    assert spec(chat, {"messages": MSGS, "response_format": {"type": "text"}}) is None
    assert spec(chat, {"messages": MSGS, "response_format": {"type": "json_object"}}) == \
        ("json_object", "", "response_format")
    assert spec(comp, {"prompt": "Hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}) == \
        ("json", json.dumps(SCHEMA), "response_format")
    assert spec(comp, {"prompt": "Hi", "structured_outputs": {"regex": "[a-z]+"}}) == \
        ("regex", "[a-z]+", "structured_outputs")
    assert spec(comp, {"prompt": "Hi", "structured_outputs": {"choice": ["a", "b"]}}) == \
        ("choice", '["a", "b"]', "structured_outputs")
    assert spec(comp, {"prompt": "Hi", "guided_json": json.dumps(SCHEMA)})[0] == "json"
    assert spec(comp, {"prompt": "Hi", "guided_grammar": 'start: "x"+'})[0] == "grammar"


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "(("}, "guided_regex", "invalid regex"),
    ({"guided_json": "{nope"}, "guided_json", "invalid json"),
    ({"guided_grammar": "start: (("}, "guided_grammar", "invalid grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "only one"),
])
def test_structured_output_errors_name_the_field(body, param, fragment):
    refused(comp, {"prompt": "Hi", **body}, param, fragment)


def test_named_tool_choice_constrains_to_the_function_schema():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "noop"}}]
    r = chat({"messages": MSGS, "tools": tools,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
             limits=BIG)
    assert (r.reply.tools, r.reply.function) == ("named", "get_weather")
    so = r.params.structured_outputs
    assert (so.kind, json.loads(so.value), so.field) == ("json", SCHEMA, "tool_choice")
    r = chat({"messages": MSGS, "tools": tools,
              "tool_choice": {"type": "function", "function": {"name": "noop"}}},
             limits=BIG)
    assert json.loads(r.params.structured_outputs.value) == {"type": "object"}
    none = chat({"messages": MSGS, "tools": tools, "tool_choice": "none"})
    assert none.reply.tools is None and none.params.structured_outputs is None
    # "none": the tools are not shown to the model
    assert none.prompt_ids == chat({"messages": MSGS}).prompt_ids
    refused(chat, {"messages": MSGS, "tools": tools}, "tool_choice", "--enable-auto-tool-choice")
    refused(chat, {"messages": MSGS, "tools": tools, "tool_choice": "auto"}, "tool_choice",
            "--enable-auto-tool-choice")
    refused(chat, {"messages": MSGS, "tools": tools, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "no tool named",
            limits=BIG)
    refused(chat, {"messages": MSGS, "tool_choice": "required"}, "tool_choice", "needs 'tools'")


def _parsers(**kw):
    from jaxserve.config import ServerConfig
    from jaxserve.entrypoints.openai.request import ChatParsers
    return ChatParsers.of(ServerConfig(**kw))


def test_auto_and_required_tool_choice():
    """"auto" (with --enable-auto-tool-choice) leaves the reply free for the parser; the
    tools reach the prompt (here described in a system message: the tiny template takes
    no `tools`). "required" holds the reply to vLLM's array-of-calls schema, one call
    without parallel_tool_calls. A schema the grammar engine refuses is a 400 naming
    `tools` and the tool."""
    import llguidance
    from jaxserve.sample.grammar import JSON_OPTIONS
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "noop"}}]
    parsers = _parsers(enable_auto_tool_choice=True, tool_call_parser="hermes")
    parse = lambda body: parse_chat_request(_raw(body), TOK, MODEL, BIG,  # noqa: E731
                                            parsers=parsers)
    auto = parse({"messages": MSGS, "tools": tools})
    assert auto.reply.tools == "auto" and auto.reply.parser.name == "hermes"
    assert auto.params.structured_outputs is None
    prompt = TOK.decode(auto.prompt_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"get_weather"' in prompt
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                       "<|im_start|>assistant\n")
    req = parse({"messages": MSGS, "tools": tools, "tool_choice": "required"})
    assert req.reply.tools == "required" and req.reply.parallel
    schema = json.loads(req.params.structured_outputs.value)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    one = parse({"messages": MSGS, "tools": tools, "tool_choice": "required",
                 "parallel_tool_calls": False})
    assert json.loads(one.params.structured_outputs.value)["maxItems"] == 1
    assert not one.reply.parallel
    # the schema admits calls of the tools and nothing else
    m = llguidance.LLMatcher(llguidance.LLTokenizer(TOK.backend.to_str(), n_vocab=VOCAB,
                                                     eos_token=[257]),
                             llguidance.LLMatcher.grammar_from_json_schema(
                                 json.dumps(schema), defaults=JSON_OPTIONS))
    good = json.dumps([{"name": "get_weather", "parameters": {"a": 3}},
                       {"name": "noop", "parameters": {}}], separators=(",", ":"))
    assert all(m.consume_token(t) for t in TOK.encode(good, add_special_tokens=False))
    m.reset()
    bad = json.dumps([{"name": "send_email", "parameters": {}}], separators=(",", ":"))
    assert not all(m.consume_token(t) for t in TOK.encode(bad, add_special_tokens=False))
    # a schema the grammar engine cannot compile: 400 naming the tool
    broken = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}]
    refused(parse, {"messages": MSGS, "tools": broken, "tool_choice": "required"}, "tools",
            '"f"')
    refused(parse, {"messages": MSGS, "tools": broken, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tools", 'tool "f"')


def test_tool_history_round_trips_through_the_template():
    """An assistant turn's tool_calls and the tool's result reach the prompt: written in
    the parser's format for a template without `tools`, passed as objects (arguments
    parsed) to one that takes them. Bad arguments are a 400 naming the call."""
    from jaxserve.tokenization.tokenizer import Tokenizer
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "14 C, rain"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    parsers = _parsers(enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = parse_chat_request(_raw({"messages": history, "tools": tools}), TOK, MODEL,
                           BIG, parsers=parsers)
    prompt = TOK.decode(r.prompt_ids, skip_special_tokens=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\nget_weather returned: 14 C, rain<|im_end|>" in prompt
    # a template that takes tools gets them and the history as objects
    native = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}"
              "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.city }})"
              "{% else %}{{ m.content }}{% endif %}{% if m.tool_call_id %}#{{ m.tool_call_id }}"
              "{% endif %}|{% endfor %}")
    tok = Tokenizer(TOK.backend, chat_template=native)
    r = parse_chat_request(_raw({"messages": history, "tools": tools}), tok, MODEL,
                           BIG, parsers=parsers)
    assert tok.decode(r.prompt_ids) == ("[get_weather]user:Weather in Paris?|"
                                        "assistant:get_weather(Paris)|tool:14 C, rain#call_1|")
    bad = [*history[:1], {**history[1], "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "{oops"}}]}]
    refused(chat, {"messages": bad}, "messages.1.tool_calls.0.function.arguments", "JSON")


def test_a_qwen25_style_tool_template_renders_tools_calls_and_results():
    """The tool-calling chat template of the Qwen2.5 family (its structure, in
    tests/data/qwen25_tool_template.jinja) through the chat parser: the tools listed in
    its system turn, a past call with its arguments as JSON, two tool results in one user
    turn in <tool_response> tags, and the reply the hermes parser reads in its format."""
    from pathlib import Path

    from jaxserve.entrypoints.openai.tool_parsers import tool_parser
    from jaxserve.tokenization.tokenizer import Tokenizer
    source = (Path(__file__).parent / "data" / "qwen25_tool_template.jinja").read_text()
    tok = Tokenizer(TOK.backend, chat_template=source)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    history = [{"role": "user", "content": "Weather in Paris and Lyon?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"a": 1}'}},
                   {"id": "c2", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"a": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "14 C"},
               {"role": "tool", "tool_call_id": "c2", "content": "16 C"}]
    r = parse_chat_request(_raw({"messages": history, "tools": tools}), tok, MODEL, BIG,
                           parsers=_parsers(enable_auto_tool_choice=True,
                                            tool_call_parser="hermes"))
    prompt = tok.decode(r.prompt_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": ' \
        in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"a": 2}}\n</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\n14 C\n</tool_response>\n<tool_response>\n"
            "16 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt
    # what such a model writes back in that format, read by the server's parser
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"a": 3}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in tool_parser("hermes").extract(reply).tool_calls] \
        == [("get_weather", '{"a": 3}')]


def test_reasoning_parser_defers_structured_output_to_the_answer():
    """With a reasoning parser, a constraint starts after "</think>" unless the prompt
    already closed the thinking (then it starts at once and the reply is all answer)."""
    parsers = _parsers(reasoning_parser="deepseek_r1")
    body = {"messages": MSGS, "response_format": {"type": "json_object"}}
    r = parse_chat_request(_raw(body), TOK, MODEL, LIMITS, parsers=parsers)
    assert r.params.structured_outputs.after == "</think>" and r.reply.reasoning.name == "deepseek_r1"
    assert chat(body).params.structured_outputs.after == ""
    from jaxserve.tokenization.tokenizer import Tokenizer
    closed = Tokenizer(TOK.backend, chat_template=TOK.chat_template.source +
                       "{% if add_generation_prompt %}<think>\n\n</think>\n\n{% endif %}")
    r = parse_chat_request(_raw(body), closed, MODEL, LIMITS, parsers=parsers)
    assert r.params.structured_outputs.after == "" and r.reply.reasoning is None


def test_echo_is_refused_in_chat():
    refused(chat, {"messages": MSGS, "echo": True}, "echo", "not supported")


def test_sampling_controls_and_logprobs_reach_the_params():
    p = comp({"prompt": "Hi", "presence_penalty": 1, "frequency_penalty": -0.5,
              "repetition_penalty": 1.2, "logit_bias": {"7": 5, "0": -100}, "min_tokens": 3,
              "stop_token_ids": [9, 10], "skip_special_tokens": False, "logprobs": 2,
              "include_stop_str_in_output": True}).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, -0.5, 1.2)
    assert p.logit_bias == ((0, -100), (7, 5)) and p.min_tokens == 3
    assert p.stop_token_ids == (9, 10) and not p.skip_special_tokens
    assert p.include_stop_str_in_output and p.logprobs == 2 and p.prompt_logprobs is None
    r = comp({"prompt": [72, 105], "logprobs": 1, "echo": True, "max_tokens": 1})
    assert r.echo and r.prompt_texts == ["Hi"] and r.params.prompt_logprobs == 1
    assert comp({"prompt": ["a", "b"], "echo": True}).prompt_texts == ["a", "b"]
    assert comp({"prompt": [[72], [105]], "echo": True}).prompt_texts == ["H", "i"]
    assert chat({"messages": MSGS, "logprobs": True, "top_logprobs": 3}).params.logprobs == 3
    assert chat({"messages": MSGS, "logprobs": True}).params.logprobs == 0
    assert chat({"messages": MSGS}).params.logprobs is None


@pytest.mark.parametrize("body, param, fragment", [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"999": 1}}, "logit_bias", "[0, 258)"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "100"),
    ({"stop_token_ids": [300]}, "stop_token_ids", "outside the vocabulary"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens=10"),
    ({"presence_penalty": 2.5}, "presence_penalty", None),
    ({"repetition_penalty": 0}, "repetition_penalty", None),
    ({"logprobs": -1}, "logprobs", None),
])
def test_sampling_control_errors_name_the_field(body, param, fragment):
    refused(comp, {"prompt": "Hi", **body}, param, fragment)


def test_top_logprobs_needs_logprobs_in_chat():
    refused(chat, {"messages": MSGS, "top_logprobs": 2}, "top_logprobs", "logprobs")
    refused(chat, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs", None)


def test_no_op_values_accepted():
    body = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
            "logprobs": None, "top_logprobs": 0, "echo": False, "best_of": 1, "logit_bias": {},
            "suffix": "", "tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
            "user": "me", "n": 1, "model": MODEL, "seed": None, "stop": None}
    assert comp({"prompt": "Hi", **body}).params == SamplingParams(max_tokens=16)
    assert chat({"messages": MSGS, **body, "logprobs": False, "tool_choice": "none"}).params.seed is None
    assert chat({"messages": MSGS, "top_logprobs": 0}).params.logprobs is None
    assert comp({"prompt": "Hi", "logprobs": 0}).prompt_ids == [72, 105]


def test_unknown_fields_ignored():
    r = comp({"prompt": "Hi", "foo": {"bar": [1, 2, None]}, "best_of_n": "x", "stop_tokens": 3})
    assert r.prompt_ids == [72, 105]


def test_stop_count_and_length_limits():
    assert comp({"prompt": "Hi", "stop": ["s"] * 16}).params.stop == ("s",) * 16
    refused(comp, {"prompt": "Hi", "stop": ["s"] * 17}, "stop", "at most 16")
    refused(chat, {"messages": MSGS, "stop": ["s"] * 17}, "stop", "at most 16")
    assert comp({"prompt": "Hi", "stop": "x" * 1024}).params.stop == ("x" * 1024,)
    e = refused(comp, {"prompt": "Hi", "stop": "x" * 1025}, "stop", "at most 1024 characters")
    assert "xxxx" not in e.message
    refused(comp, {"prompt": "Hi", "stop": ["ok", "y" * 100_000]}, "stop", "1024")
    small = RequestLimits(64, max_stop_strings=2, max_stop_string_len=3)
    assert comp({"prompt": "Hi", "stop": ["abc", "d"]}, limits=small).params.stop == ("abc", "d")
    refused(comp, {"prompt": "Hi", "stop": ["a", "b", "c"]}, "stop", "at most 2", limits=small)
    refused(comp, {"prompt": "Hi", "stop": "abcd"}, "stop", "at most 3", limits=small)
    refused(comp, {"prompt": "Hi", "stop": ["a", 5]}, "stop.1")


def test_request_limits_of_server_config():
    limits = RequestLimits.of(ServerConfig(max_stop_strings=3, max_stop_string_len=7), 99)
    assert limits == RequestLimits(99, 3, 7)


def test_stream_options():
    r = comp({"prompt": "Hi", "stream": True, "stream_options": {"include_usage": True}})
    assert (r.stream, r.include_usage) == (True, True)
    r = comp({"prompt": "Hi", "stream": True, "stream_options": {}})
    assert (r.stream, r.include_usage) == (True, False)
    r = comp({"prompt": "Hi", "stream": False})
    assert (r.stream, r.include_usage) == (False, False)
    refused(comp, {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options",
            "only allowed with")
    refused(comp, {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage")
    refused(comp, {"prompt": "Hi", "stream": True, "stream_options": []}, "stream_options")


def test_model_name():
    assert comp({"prompt": "Hi", "model": MODEL}).prompt_ids == [72, 105]
    e = refused(chat, {"messages": MSGS, "model": "other"}, "model", "other", status=404)
    assert e.code == "model_not_found"


# -- prompts, messages, lengths -----------------------------------------------------------

def test_completion_prompts():
    assert comp({"prompt": "Hello"}).prompt_ids == TOK.encode("Hello", add_special_tokens=True)
    assert comp({"prompt": [72, 105]}).prompt_ids == [72, 105]
    assert comp({"prompt": [0, VOCAB - 1]}).prompt_ids == [0, VOCAB - 1]
    assert comp({"prompt": ["Hello"]}).prompt_ids == TOK.encode("Hello")
    assert comp({"prompt": [[72, 105]]}).prompt_ids == [72, 105]


@pytest.mark.parametrize("prompt, param, fragment", [
    (None, "prompt", None), ("", "prompt", "empty"), ([], "prompt", "empty"),
    ([[]], "prompt", "empty"), (12, "prompt", None), ({"text": "Hi"}, "prompt", None),
    ([1, VOCAB], "prompt", str(VOCAB)), ([1, 99999], "prompt", "99999"),
    ([-1], "prompt.0", None), ([True], "prompt.0", None), ([1.0], "prompt.0", None),
    ([2**64], "prompt.0", None), (["a", ""], "prompt.1", "empty"),
    ([[1], []], "prompt.1", "empty"), ([1, "a"], "prompt.1", None),
    ("Hi" * 40, "prompt", "64"), (list(range(64)), "prompt", "context length")])
def test_bad_completion_prompts(prompt, param, fragment):
    body = {} if prompt is None else {"prompt": prompt}
    refused(comp, body, param, fragment)


def test_max_tokens_and_context_length():
    assert comp({"prompt": "Hi", "max_tokens": 62}).params.max_tokens == 62
    e = refused(comp, {"prompt": "Hi", "max_tokens": 63}, "max_tokens", "65")
    assert e.code == "context_length_exceeded" and "64" in e.message
    refused(comp, {"prompt": "Hi", "max_tokens": 2**63 - 1}, "max_tokens", "context length")
    refused(comp, {"prompt": "Hi", "max_tokens": 2**63}, "max_tokens")
    # completions default 16, capped at the room left; chat default: all the room left
    assert comp({"prompt": "x" * 60}).params.max_tokens == 4
    assert comp({"prompt": "x" * 40}).params.max_tokens == 16
    r = chat({"messages": MSGS})
    assert r.params.max_tokens == 64 - len(r.prompt_ids)
    assert chat({"messages": MSGS, "max_tokens": 9, "max_completion_tokens": 2}).params.max_tokens == 2
    assert chat({"messages": MSGS, "max_tokens": 9}).params.max_tokens == 9
    e = refused(chat, {"messages": MSGS, "max_completion_tokens": 60}, "max_completion_tokens")
    assert e.code == "context_length_exceeded"
    refused(chat, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens")
    refused(chat, {"messages": [{"role": "user", "content": "x" * 60}]}, "messages", "64")


def test_valid_requests_give_the_same_parsed_request():
    r = comp({"prompt": "Hello", "max_tokens": 40, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
              "min_p": 0.1, "seed": 3, "stop": ["a", "b"], "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}})
    assert r == ParsedRequest(
        [TOK.encode("Hello")], SamplingParams(max_tokens=40, temperature=0.5, top_p=0.9, top_k=5,
                                            min_p=0.1, seed=3, stop=("a", "b"), ignore_eos=True),
        stream=True, include_usage=True)
    assert comp({"prompt": "Hi", "temperature": 0, "stop": "x"}).params == \
        SamplingParams(max_tokens=16, temperature=0.0, stop=("x",))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "you"}]}]
    r = chat({"messages": messages, "max_completion_tokens": 5})
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nyou<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert r == ParsedRequest([TOK.encode(text, add_special_tokens=False)],
                              SamplingParams(max_tokens=5), stream=False, include_usage=False,
                              reply=ReplyFormat())


@pytest.mark.parametrize("messages, param, fragment", [
    (None, "messages", None), ([], "messages", None), ("Hi", "messages", None),
    ([5], "messages.0", None), ([{"content": "Hi"}], "messages.0.role", None),
    ([{"role": "bot", "content": "Hi"}], "messages.0.role", "'user'"),
    ([{"role": 1, "content": "Hi"}], "messages.0.role", None),
    ([{"role": "user", "content": 5}], "messages.0.content", None),
    (MSGS + [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages.1.content.0.type", "'text'"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text", None),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages.0.content.0.text", None),
    ([{"role": "user", "content": None}], "messages", "chat template"),
    ([{"role": "user"}], "messages", "chat template"),
])
def test_bad_messages(messages, param, fragment):
    body = {} if messages is None else {"messages": messages}
    refused(chat, body, param, fragment)


def test_template_and_tokenizer_failures_are_400s(monkeypatch):
    no_template = Tokenizer(TOK.backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    refused(chat, {"messages": MSGS}, "messages", "no chat template", tok=no_template)

    broken = tiny_tokenizer()
    monkeypatch.setattr(broken, "apply_chat_template",
                        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    e = refused(chat, {"messages": MSGS}, "messages", "chat template", tok=broken)
    assert "RuntimeError" not in e.message

    def bad_encode(*a, **k):
        raise RuntimeError("tokenizer exploded")
    monkeypatch.setattr(broken, "encode", bad_encode)
    e = refused(comp, {"prompt": "Hi"}, "prompt", "tokenized", tok=broken)
    assert "RuntimeError" not in e.message and "exploded" not in e.message


# -- anything in, ApiError or ParsedRequest out -------------------------------------------

FUZZ = request_strategies(MODEL, VOCAB)


def _chat_with_parsers(raw, tok, model, limits):
    """The chat parser of a server with auto tool choice (hermes) and a reasoning parser,
    with room for tools described in the prompt."""
    return parse_chat_request(raw, tok, model, BIG, parsers=_parsers(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3"))


def check_outcome(raw: bytes) -> None:
    """Every parser (completions, chat with and without tool / reasoning parsers,
    embeddings) answers `raw` with its parsed request or an ApiError (any other exception
    is a bug, and fails the test), and a parsed request is within the limits."""
    try:
        e = parse_embedding_request(raw, TOK, MODEL, LIMITS, hidden_size=16)
    except ApiError as err:
        assert err.status in (400, 404) and len(err.message) <= 500
    else:
        assert e.prompts and all(0 < len(p) < LIMITS.max_model_len and
                                 all(0 <= t < VOCAB for t in p) for p in e.prompts)
    for parse in (parse_completion_request, parse_chat_request, _chat_with_parsers):
        limits = BIG if parse is _chat_with_parsers else LIMITS
        try:
            r = parse(raw, TOK, MODEL, limits)
        except ApiError as e:
            assert e.status in (400, 404) and e.type == "invalid_request_error"
            assert e.message and "Traceback" not in e.message
            assert len(e.message) <= 500 and (e.param is None or len(e.param) <= 100)
            json.dumps(e.body())
        else:
            assert isinstance(r, ParsedRequest)
            assert r.prompt_ids and all(0 <= t < VOCAB for t in r.prompt_ids)
            assert len(r.prompt_ids) + r.params.max_tokens <= limits.max_model_len
            assert r.params.seed is None or SEED_MIN <= r.params.seed <= SEED_MAX
            assert -1 <= r.params.top_k <= VOCAB


@settings(max_examples=300, deadline=None)
@given(FUZZ.any_json, st.booleans())
def test_any_json_value(value, ascii_):
    check_outcome(dump_body(value, ascii_))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes(raw):
    check_outcome(raw)


@settings(max_examples=300, deadline=None)
@given(FUZZ.known_dicts, st.booleans())
def test_any_dict_of_known_keys(body, ascii_):
    check_outcome(dump_body(body, ascii_))


@settings(max_examples=300, deadline=None)
@given(FUZZ.plausible_dicts, st.booleans())
def test_plausible_requests(body, ascii_):
    check_outcome(dump_body(body, ascii_))


# -- responses and the OpenAPI document ---------------------------------------------------

def test_response_shapes_match_the_response_models():
    u = usage(5, 3)
    assert u == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    CompletionResponse.model_validate(COMPLETION.response("cmpl-1", 1, MODEL,
                                                          [COMPLETION.choice("x", "stop")], u))
    ChatCompletionResponse.model_validate(CHAT.response("chatcmpl-1", 1, MODEL,
                                                        [CHAT.choice("x", "length", 1)], u))
    for include_usage in (False, True):
        for first in (True, False):
            for text, finish in (("x", None), ("", "stop"), ("", None)):
                CompletionChunk.model_validate(COMPLETION.chunk(
                    "c", 1, MODEL, [COMPLETION.delta_choice(text, finish, first)], include_usage))
                ChatCompletionChunk.model_validate(CHAT.chunk(
                    "c", 1, MODEL, [CHAT.delta_choice(text, finish, first)], include_usage))
        CompletionChunk.model_validate(COMPLETION.chunk("c", 1, MODEL, [], True, u))
        ChatCompletionChunk.model_validate(CHAT.chunk("c", 1, MODEL, [], True, u))
    ErrorResponse.model_validate(ApiError("bad", "seed").body())
    ModelList.model_validate({"object": "list", "data": [{
        "id": MODEL, "object": "model", "created": 1, "owned_by": "jaxserve", "max_model_len": 64}]})


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _resolve(doc, ref: str):
    assert ref.startswith("#/"), ref
    node = doc
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_openapi_schema():
    doc = openapi_schema(MODEL)
    json.dumps(doc)
    assert doc["openapi"].startswith("3.1")
    refs = list(_refs(doc))
    assert refs and all(isinstance(_resolve(doc, r), dict) for r in refs)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "CompletionResponse",
                 "ChatCompletionResponse", "CompletionChunk", "ChatCompletionChunk", "Usage",
                 "ErrorResponse", "ModelList"):
        assert name in schemas, name
    seed = schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (SEED_MIN, SEED_MAX)
    paths = doc["paths"]
    assert set(paths) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                          "/ready", "/metrics", "/tokenize", "/detokenize"}
    for path, model, parse in (("/v1/completions", CompletionRequest, parse_completion_request),
                               ("/v1/chat/completions", ChatCompletionRequest, parse_chat_request)):
        op = paths[path]["post"]
        body = op["requestBody"]["content"]["application/json"]
        assert _resolve(doc, body["schema"]["$ref"]) is schemas[model.__name__]
        model.model_validate_json(json.dumps(body["example"]))
        assert isinstance(parse(json.dumps(body["example"]).encode(), TOK, MODEL,
                                BIG), ParsedRequest)
        assert {"application/json", "text/event-stream"} <= set(op["responses"]["200"]["content"])
        for code in ("400", "401", "404", "413", "503"):
            ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/ErrorResponse"
    models = paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
    assert models["schema"]["$ref"].endswith("/ModelList")
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
