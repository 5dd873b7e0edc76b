"""Tool calls and reasoning through the server with the model-free FakeEngine (its reply is
a canned text, streamed a byte a token): the message fields of whole replies, the SSE
deltas as they stream (tags arriving in pieces held back, call ids and names once, then
the arguments in pieces), and the openai SDK's own accumulation of those deltas. The real
model's tool calls are tests/test_openai_client.py's."""

import json

import openai
import pytest
from starlette.testclient import TestClient

from fake_engine import FakeEngine, tiny_tokenizer
from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.openai.api_server import build_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
AUTO = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def serve(reply: str, config: ServerConfig):
    tok = tiny_tokenizer()
    bridge = AsyncEngine(FakeEngine(tok, reply, max_model_len=4096))
    client = TestClient(build_app(bridge, tok, "fake", 4096, config))
    return client, bridge


@pytest.fixture
def server(request):
    reply, config = request.param
    client, bridge = serve(reply, config)
    with client:
        yield client
    bridge.shutdown()


def post(client, body, stream=False):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 400, **body,
                                                  "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


def joined(chunks, field):
    return "".join(c["delta"].get(field) or "" for c in chunks)


def streamed_calls(chunks) -> list[dict]:
    """The calls the deltas make, accumulated as the OpenAI SDK does (by index: id and name
    from the first piece, arguments appended), checking each id and name comes once."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c["delta"].get("tool_calls") or ():
            if d["index"] not in calls:
                assert d["id"].startswith("call_") and d["type"] == "function"
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"],
                                     "arguments": ""}
            else:
                assert "id" not in d and "name" not in d["function"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("server", [(f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>", AUTO)],
                         indirect=True)
def test_auto_hermes_call_whole_and_streamed(server):
    choice = post(server, {"tools": [WEATHER]})
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check.\n"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = post(server, {"tools": [WEATHER]}, stream=True)
    assert chunks[-1]["finish_reason"] == "tool_calls"
    assert joined(chunks, "content") == "Let me check.\n"
    assert all("<" not in (c["delta"].get("content") or "") for c in chunks)  # no tag pieces
    [call] = streamed_calls(chunks)
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    pieces = [d for c in chunks for d in c["delta"].get("tool_calls") or ()]
    assert len(pieces) > 3  # the arguments came in pieces, as they were generated
    # "none": the same text is content, the tools are not parsed
    choice = post(server, {"tools": [WEATHER], "tool_choice": "none"})
    assert choice["message"]["content"].endswith("</tool_call>")
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


TWO = f"<tool_call>{CALL}</tool_call>\n<tool_call>" + CALL.replace("Paris", "Lyon") + \
    "</tool_call>"


@pytest.mark.parametrize("server", [(TWO, AUTO)], indirect=True)
def test_parallel_calls_and_parallel_tool_calls_false(server):
    message = post(server, {"tools": [WEATHER]})["message"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == \
        ["Paris", "Lyon"]
    assert len({c["id"] for c in message["tool_calls"]}) == 2 and message["content"] is None
    calls = streamed_calls(post(server, {"tools": [WEATHER]}, stream=True))
    assert [json.loads(c["arguments"])["city"] for c in calls] == ["Paris", "Lyon"]
    only = post(server, {"tools": [WEATHER], "parallel_tool_calls": False})["message"]
    assert len(only["tool_calls"]) == 1
    assert len(streamed_calls(post(server, {"tools": [WEATHER], "parallel_tool_calls": False},
                                   stream=True))) == 1


@pytest.mark.parametrize("server", [(TWO, AUTO)], indirect=True)
def test_the_openai_sdk_accumulates_the_streamed_calls(server):
    """The SDK's stream helper (ChatCompletionStreamState) rebuilds the message from our
    deltas: the same calls as the non-streamed reply."""
    with openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=server,
                       max_retries=0) as client:
        whole = client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER])
        with client.chat.completions.stream(model="fake", messages=ASK,
                                            tools=[WEATHER]) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
    got = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert got == [(c.function.name, c.function.arguments)
                   for c in whole.choices[0].message.tool_calls]
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"


REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'


@pytest.mark.parametrize("server", [(REQUIRED, ServerConfig())], indirect=True)
def test_required_reads_the_array_of_calls_without_a_parser(server):
    choice = post(server, {"tools": [WEATHER], "tool_choice": "required"})
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = post(server, {"tools": [WEATHER], "tool_choice": "required"}, stream=True)
    assert [(c["name"], c["arguments"]) for c in streamed_calls(chunks)] == \
        [("get_weather", '{"city": "Paris"}')]
    assert joined(chunks, "content") == ""


THINKING = "I should look it up.</think>\n\nIt is sunny."
R1 = ServerConfig(reasoning_parser="deepseek_r1")


@pytest.mark.parametrize("server", [(THINKING, R1)], indirect=True)
def test_reasoning_content_whole_and_streamed(server):
    message = post(server, {})["message"]
    assert message["reasoning_content"] == "I should look it up."
    assert message["content"] == "\n\nIt is sunny."
    chunks = post(server, {}, stream=True)
    assert joined(chunks, "reasoning_content") == "I should look it up."
    assert joined(chunks, "content") == "\n\nIt is sunny."
    assert all("<" not in joined([c], "reasoning_content") + joined([c], "content")
               for c in chunks)  # the end tag, arriving a byte at a time, never leaks


@pytest.mark.parametrize("server", [
    (f"Weather needs a tool.</think><tool_call>{CALL}</tool_call>",
     ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                  reasoning_parser="deepseek_r1"))], indirect=True)
def test_tool_calls_are_read_after_the_reasoning(server):
    choice = post(server, {"tools": [WEATHER]})
    assert choice["message"]["reasoning_content"] == "Weather needs a tool."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    chunks = post(server, {"tools": [WEATHER]}, stream=True)
    assert joined(chunks, "reasoning_content") == "Weather needs a tool."
    assert [c["name"] for c in streamed_calls(chunks)] == ["get_weather"]
    assert joined(chunks, "content") == ""


@pytest.mark.parametrize("server", [("Sunny.", AUTO)], indirect=True)
def test_tokenize_with_tools_counts_what_the_chat_prompt_costs(server):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "14 C"}]
    usage = server.post("/v1/chat/completions", json={
        "messages": history, "tools": [WEATHER], "max_tokens": 2}).json()["usage"]
    count = server.post("/tokenize", json={"messages": history, "tools": [WEATHER]}).json()
    assert count["count"] == usage["prompt_tokens"]
    assert server.post("/tokenize", json={"messages": history}).json()["count"] < count["count"]
