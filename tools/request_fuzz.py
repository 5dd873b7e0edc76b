"""Hypothesis strategies for OpenAI request bodies, from any JSON to near-valid requests at
the edges of every field's range. Shared by the request-layer unit tests
(tests/test_openai_protocol.py) and the server stress tool (tools/stress_server.py), which
sends them over HTTP. Needs `hypothesis` (a test extra).

    s = request_strategies("SmolLM2-135M-Instruct", vocab_size=49152)
    s.any_json        any JSON value (scalars at integer / float edges, nested lists, dicts)
    s.known_dicts     objects of the API's known keys, each with any value
    s.plausible_dicts well-typed values around each range's edges (many are accepted)
    s.bodies          the three together

Values may hold lone surrogates: dump with `dump_body`, which keeps them (as JSON escapes
with ensure_ascii, or as surrogatepass bytes), the way a hostile client could send them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import strategies as st


@dataclasses.dataclass(frozen=True)
class RequestStrategies:
    """The strategies of `request_strategies` (see the module docstring)."""

    any_json: st.SearchStrategy
    known_dicts: st.SearchStrategy
    plausible_dicts: st.SearchStrategy

    @property
    def bodies(self) -> st.SearchStrategy:
        """Any of the three."""
        return self.any_json | self.known_dicts | self.plausible_dicts


def request_strategies(model: str, vocab_size: int, max_tokens: int = 70) -> RequestStrategies:
    """Strategies for bodies of /v1/completions, /v1/chat/completions (tools and their
    history too) and /v1/embeddings addressed to
    `model` over a vocabulary of `vocab_size` tokens; plausible bodies ask for at most
    `max_tokens` output tokens (-1..max_tokens)."""
    v = vocab_size
    edge_ints = st.sampled_from([0, 1, -1, -2, 16, 63, 64, v - 1, v, v + 1, 2**31, 2**63 - 1,
                                 2**63, -2**63, -2**63 - 1, 2**64, 10**30])
    any_text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=12)
    scalars = (st.none() | st.booleans() | st.integers() | edge_ints | any_text
               | st.floats(allow_nan=False, allow_infinity=False)
               | st.sampled_from([0.0, 0.5, 1.0, 1.5, -0.5, 2.0, -2.0, 1e308]))
    any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(any_text, inner, max_size=4), max_leaves=16)
    message = st.fixed_dictionaries({}, optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bot"])
        | any_json,
        "content": any_text | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": any_text}), max_size=3)
        | any_json,
        "name": any_text | any_json, "tool_calls": any_json, "tool_call_id": any_json})
    known = {
        "model": st.just(model) | any_json,
        "prompt": any_text | st.lists(edge_ints, max_size=5) | any_json,
        "messages": st.lists(message, max_size=3) | any_json, "max_tokens": edge_ints | any_json,
        "max_completion_tokens": edge_ints | any_json, "temperature": scalars, "top_p": scalars,
        "top_k": edge_ints | scalars, "min_p": scalars, "seed": edge_ints | scalars,
        "n": edge_ints | scalars, "stop": any_text | st.lists(any_text, max_size=20) | any_json,
        "stream": st.booleans() | any_json,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | scalars})
        | any_json,
        "ignore_eos": st.booleans() | any_json, "presence_penalty": scalars,
        "frequency_penalty": scalars, "repetition_penalty": scalars, "logprobs": scalars,
        "top_logprobs": scalars, "echo": scalars, "best_of": scalars, "logit_bias": any_json,
        "suffix": any_json, "tools": any_json, "tool_choice": any_json,
        "parallel_tool_calls": any_json, "response_format": any_json, "user": any_json,
        "input": any_text | st.lists(edge_ints, max_size=5) | any_json,
        "encoding_format": any_json, "dimensions": edge_ints | any_json,
        "structured_outputs": any_json, "guided_json": any_json, "guided_regex": any_json,
        "guided_choice": any_json, "guided_grammar": any_json, "min_tokens": edge_ints | any_json,
        "stop_token_ids": st.lists(edge_ints, max_size=3) | any_json,
        "include_stop_str_in_output": scalars, "skip_special_tokens": scalars,
        "add_special_tokens": scalars, "add_generation_prompt": scalars,
        "return_token_strs": scalars, "tokens": st.lists(edge_ints, max_size=5) | any_json}
    # well-typed values around the edges of each range, so that bodies get past the types
    # and reach the checks that need the tokenizer and the limits (and many are accepted)
    short_text = st.text(alphabet=st.characters(codec=None, categories=None), min_size=1,
                         max_size=8)
    schema = st.sampled_from([
        None, {"type": "object"}, {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]},
        {"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}},
        {"type": "nonsense"}])
    # structured output: constraints that compile, ones that do not, and several at once
    # (exactly one is allowed)
    json_schema = schema | st.sampled_from(['{"type": "integer"}', "{oops"])
    constraint = st.sampled_from([
        {"regex": "[a-c]{1,3}"}, {"regex": "(("}, {"regex": ""}, {"choice": ["yes", "no"]},
        {"choice": [""]}, {"choice": []}, {"grammar": 'start: "a" | "b"'},
        {"grammar": 'root ::= "x" | "y"'}, {"grammar": "nonsense ::="}, {"json_object": True},
        {"json_object": False}, {"regex": "a", "choice": ["a"]}, {}]) \
        | st.fixed_dictionaries({"json": json_schema})
    response_format = st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                       {"type": "json_schema"}]) \
        | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                 st.fixed_dictionaries({"name": st.just("reply")},
                                                       optional={"schema": schema})})
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "add", ""]) | short_text},
        optional={"parameters": schema, "description": short_text})})
    call = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({
        "name": st.sampled_from(["get_weather", "add"]),
        "arguments": st.sampled_from(['{"city": "Paris"}', "{}", "{oops", "[1]", ""])})},
        optional={"id": st.sampled_from(["call_1", "call_2"])})
    plausible = {
        "model": st.just(model),
        "prompt": short_text | st.lists(st.integers(-1, v), min_size=1, max_size=8)
        | st.lists(short_text, min_size=1, max_size=2),
        "messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
            "content": short_text | st.lists(st.fixed_dictionaries(
                {"type": st.just("text"), "text": short_text}), min_size=1, max_size=2)
            | st.none()}, optional={
                "tool_calls": st.lists(call, max_size=2),
                "tool_call_id": st.sampled_from(["call_1", "call_9"])}),
            min_size=1, max_size=3),
        "max_tokens": st.integers(-1, max_tokens),
        "max_completion_tokens": st.integers(-1, max_tokens),
        "temperature": st.floats(-0.5, 3), "top_p": st.floats(-0.1, 1.1),
        "min_p": st.floats(-0.1, 1.1), "top_k": st.integers(-3, v + 2),
        "seed": edge_ints | st.integers(), "n": st.integers(0, 2),
        "stop": short_text | st.lists(st.text(max_size=3), max_size=18),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.sampled_from([0, 0.0, 1, -2, 2, 2.5]),
        "frequency_penalty": st.sampled_from([0, -0.5, -2.5]),
        "repetition_penalty": st.sampled_from([1, 1.0, 1.2, 0, -1]),
        "logprobs": st.sampled_from([None, False, 0, True, 3]),
        "echo": st.sampled_from([False, True]), "best_of": st.sampled_from([1, 2]),
        "logit_bias": st.sampled_from([{}, {"1": 2}]),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries({
            "type": st.just("function"), "function": st.fixed_dictionaries({
                "name": st.sampled_from(["get_weather", "add", "nope"])})}),
        "parallel_tool_calls": st.booleans(),
        "input": short_text | st.lists(st.integers(-1, v), min_size=1, max_size=8)
        | st.lists(short_text, min_size=1, max_size=2) | st.just(""),
        "encoding_format": st.sampled_from(["float", "base64", "int8"]),
        "dimensions": st.sampled_from([1, 16, 576]),
        "response_format": response_format, "structured_outputs": constraint,
        "guided_json": json_schema, "guided_regex": st.sampled_from(["[0-9]{1,4}", "(("]),
        "guided_choice": st.sampled_from([["red", "green"], []]),
        "guided_grammar": st.sampled_from(['start: "ok"', "::="]),
        "min_tokens": st.integers(-1, max_tokens + 2),
        "stop_token_ids": st.lists(st.integers(-1, v), max_size=3),
        "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
        "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
        "return_token_strs": st.booleans(),
        "tokens": st.lists(st.integers(-1, v), max_size=8)}
    # a prompt, messages, or both (each endpoint ignores the other's; /tokenize takes one)
    rest = {k: s for k, s in plausible.items() if k not in ("prompt", "messages")}
    plausible_dicts = st.one_of([st.fixed_dictionaries({k: plausible[k] for k in keys},
                                                       optional=rest)
                                 for keys in (("prompt", "messages"), ("prompt",),
                                              ("messages",))])
    return RequestStrategies(any_json, st.fixed_dictionaries({}, optional=known),
                             plausible_dicts)


def dump_body(value: Any, ensure_ascii: bool) -> bytes:
    """`value` as a JSON request body; lone surrogates survive (escaped, or as the bytes a
    broken client would send)."""
    return json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
