"""Structured output on the real model through the OpenAI API: outputs for several JSON
schemas parse and validate (jsonschema), json_object gives an object, a regex holds, a
named tool_choice gives a call whose arguments validate, streamed as they are whole.

The schemas bound their fields (maxLength, integer ranges): a grammar allows a JSON number
any number of digits, and the 135M model, greedy, can repeat a digit until max_tokens
(seen with an unbounded "number": "0.8888..."), which no grammar engine prevents."""

import json
import re

import jsonschema  # a test extra: missing, this module fails rather than skips
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                      "minItems": 1, "maxItems": 3},
        "role": {"enum": ["engineer", "artist", "teacher"]},
    },
    "required": ["name", "age", "languages", "role"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        "coastal": {"type": "boolean"},
        "location": {"type": "object", "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False},
    },
    "required": ["city", "country", "population_millions", "coastal", "location"],
    "additionalProperties": False,
}
STEPS = {"type": "array", "items": {"type": "object", "properties": {
    "step": {"type": "integer", "minimum": 1}, "action": {"type": "string", "maxLength": 40}},
    "required": ["step", "action"], "additionalProperties": False},
    "minItems": 2, "maxItems": 4}
CASES = [("Describe a fictional person as JSON.", PERSON),
         ("Give facts about Lisbon as JSON.", CITY),
         ("List the steps to make tea as JSON.", STEPS)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("prompt, schema", CASES, ids=["person", "city", "steps"])
def test_json_schema_outputs_validate(small_llm_client, prompt, schema, temperature):
    """The output validates; jump-forward added some of its tokens (the schema's keys and
    punctuation, in SmolLM2's tokens: /health's num_forced_tokens grew)."""
    forced = small_llm_client.get("/health").json()["num_forced_tokens"]
    r = small_llm_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 300,
        "temperature": temperature, "seed": 7,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": schema}}}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert small_llm_client.get("/health").json()["num_forced_tokens"] > forced


def test_json_object_regex_and_choice(small_llm_client):
    post = small_llm_client.post
    r = post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Give the name and age of a cat as a JSON "
                                                 "object with keys name and age."}],
        "max_tokens": 200, "temperature": 0, "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    pattern = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
    r = post("/v1/completions", json={"prompt": "The Apollo 11 landing date was",
                                      "max_tokens": 20, "temperature": 0.7, "seed": 1,
                                      "structured_outputs": {"regex": pattern}}).json()
    assert re.fullmatch(pattern, r["choices"][0]["text"]), r
    r = post("/v1/completions", json={"prompt": "Is the sky blue? Answer:", "max_tokens": 5,
                                      "guided_choice": ["yes", "no", "sometimes"]}).json()
    assert r["choices"][0]["text"] in ("yes", "no", "sometimes")


def test_named_tool_choice_returns_a_valid_call_streamed_too(small_llm_client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": tools, "max_tokens": 100, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = small_llm_client.post("/v1/chat/completions", json=body).json()
    message = r["choices"][0]["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        tools[0]["function"]["parameters"])
    events = small_llm_client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in events.text.split("\n")
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_")
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"]
                        for d in deltas if d.get("tool_calls"))
    assert arguments == call["function"]["arguments"]


def test_reasoning_parser_constrains_the_answer_after_the_thinking(small_llm, small_llm_bridge):
    """--reasoning-parser deepseek_r1 on the real model: shown two thinking-then-answer
    turns, it thinks in <think></think> tags itself; the thinking comes back as
    reasoning_content, and response_format holds only the answer after "</think>" (free
    thinking, then JSON), whole and streamed."""
    from starlette.testclient import TestClient

    from jaxserve.config import ServerConfig
    from jaxserve.entrypoints.openai.api_server import build_app
    app = build_app(small_llm_bridge, small_llm.tokenizer, "smollm2",
                    small_llm.engine.engine_config.max_model_len,
                    ServerConfig(reasoning_parser="deepseek_r1"))
    shots = [{"role": "system", "content": "Think inside <think></think> tags, then answer."},
             {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "<think>2 plus 2 is 4.</think>4"},
             {"role": "user", "content": "What color is the sky?"},
             {"role": "assistant", "content": "<think>The sky is blue on a clear day.</think>Blue"},
             {"role": "user", "content": "Give the name and age of a cat as JSON."}]
    body = {"messages": shots, "temperature": 0, "max_tokens": 80}
    with TestClient(app) as client:
        free = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert free["reasoning_content"] and "<think>" not in free["reasoning_content"]
        with pytest.raises(ValueError):
            json.loads(free["content"])  # left free, the answer is not JSON
        body["response_format"] = {"type": "json_object"}
        held = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert held["message"]["reasoning_content"] == free["reasoning_content"]
        assert isinstance(json.loads(held["message"]["content"]), dict)
        events = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"]
              for e in events.split("\n\n") if e.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        held["message"]["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == held["message"]["content"]
