"""End to end: the official `openai` client against `serve.py` run as a subprocess with the
real SmolLM2-135M-Instruct (tests/configs/smollm2_two_shapes.py: max_model_len 512). Checks what
the in-process tests with the fake engine (test_server.py) cannot: the real CLI, uvicorn,
the real model and the SDK's parsing of our responses, SSE streams and error objects."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "tests/configs/smollm2_two_shapes.py"  # 2 step shapes to warm up
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 240
PROMPT = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Server:
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid`, all threads (Linux /proc); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def launched_server(cache_dir, log_dir: Path):
    """serve.py on a free port, once /health answers 200; stopped (SIGINT) on exit."""
    port = _free_port()
    log_path = log_dir / "serve.log"
    cmd = [sys.executable, "serve.py", "--config", CONFIG, "--port", str(port),
           "--cache-dir", str(cache_dir), "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes"]
    with open(log_path, "wb") as log:  # a file, not a PIPE: nobody drains a pipe
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    srv = Server(port, proc, log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve.py exited with {proc.returncode} before it was healthy:\n"
                            f"{srv.log_tail()}")
            try:
                if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve.py not healthy after {STARTUP_TIMEOUT_S} s:\n{srv.log_tail()}")
            time.sleep(0.5)
        yield srv
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def server(smollm2_checkpoint, cache_dir, tmp_path_factory):
    """The module's server (the model is fetched and converted in-process first, by
    `smollm2_checkpoint`, so the server only loads and warms up)."""
    with launched_server(cache_dir, tmp_path_factory.mktemp("serve")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    # No retries: an error must surface as the status the server sent, not be retried away.
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    from jaxserve.tokenization.tokenizer import Tokenizer
    return Tokenizer.from_dir(smollm2_checkpoint)


@pytest.fixture(scope="module")
def greedy_completion(client):
    """The non-streamed greedy completion of PROMPT (16 tokens) that streams must equal."""
    return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def greedy_chat(client):
    return client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                          max_tokens=32)


def test_models_list(client):
    models = client.models.list().data
    assert MODEL in [m.id for m in models]
    assert all(m.object == "model" for m in models)


def test_completion(greedy_completion, client, tokenizer):
    r = greedy_completion
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in {"length", "stop"}
    u = r.usage
    assert u.prompt_tokens == len(tokenizer.encode(PROMPT, add_special_tokens=True)) > 0
    if choice.finish_reason == "length":
        assert u.completion_tokens == 16
    else:
        assert 1 <= u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # ignore_eos (vLLM's extension): exactly max_tokens tokens, whatever the model says.
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=7,
                                  extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "length")
    assert r.usage.prompt_tokens == u.prompt_tokens


def test_streaming_completion_matches(greedy_completion, client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                            max_tokens=16, stream=True))
    assert len(chunks) >= 2
    assert all(len(c.choices) == 1 and c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == greedy_completion.choices[0].text
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == greedy_completion.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_chat_completion(greedy_chat):
    r = greedy_chat
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert "Paris" in msg.content
    assert r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens < 32 and r.usage.prompt_tokens > 0


def test_streaming_chat_matches(greedy_chat, client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                                 max_tokens=32, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == greedy_chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stream_include_usage(greedy_completion, client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                            max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and len(c.choices) == 1 for c in deltas)
    assert "".join(c.choices[0].text for c in deltas) == greedy_completion.choices[0].text
    want = greedy_completion.usage
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (want.prompt_tokens, want.completion_tokens, want.total_tokens)


def test_errors_then_still_serving(client):
    with pytest.raises(openai.NotFoundError) as e:  # 404, as OpenAI answers an unknown model
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    assert (e.value.status_code, e.value.code, e.value.param) == (404, "model_not_found", "model")
    assert "no-such-model" in e.value.message

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.param == "max_tokens"

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.param == "temperature"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 1000, max_tokens=4)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].text


def test_client_disconnect_mid_stream(server, client):
    """A client that goes away mid-stream: its request is aborted, its pages are freed
    (/health's counters), the server process goes idle (its engine thread sleeps when it has
    no requests, where the 400-token request would keep a core busy for many seconds), and
    the next request is served promptly."""
    stream = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    got = [next(it) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in got)
    busy_stats = httpx.get(f"{server.url}/health", timeout=30).json()
    assert busy_stats["running"] == 1 and busy_stats["free_pages"] < busy_stats["total_pages"]
    stream.close()

    deadline = time.monotonic() + 10  # the abort reaches the engine thread at its next step
    while True:
        stats = httpx.get(f"{server.url}/health", timeout=30).json()
        if stats["running"] == 0 and stats["free_pages"] == stats["total_pages"]:
            break
        assert time.monotonic() < deadline, f"request not cancelled / pages not freed: {stats}"
        time.sleep(0.1)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S  # serve.py compiles the rest of its
    while httpx.get(f"{server.url}/health", timeout=30).json()["warmup_pending"]:  # shapes
        assert time.monotonic() < deadline, "background warm-up never finished"  # meanwhile
        time.sleep(0.2)
    cpu0, t0 = _cpu_seconds(server.proc.pid), time.monotonic()
    if cpu0 is not None:
        time.sleep(2.0)
        busy = (_cpu_seconds(server.proc.pid) - cpu0) / (time.monotonic() - t0)
        assert busy < 0.25, f"server still using {busy:.2f} cores after the client left"

    t0 = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=8,
                                  extra_body={"ignore_eos": True}, timeout=30)
    assert time.monotonic() - t0 < 30
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (8, "length")
    assert server.proc.poll() is None
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-4000:]


# -- the OpenAI surface beyond text: logprobs, structured output, tool calls ----------------

def test_sdk_parses_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4,
                                  logprobs=3, echo=True)
    lp = r.choices[0].logprobs  # openai.types.completion_choice.Logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.total_tokens
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs[1:])


def test_sdk_parses_chat_logprobs_streamed_and_not(client):
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
              top_logprobs=2)
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(full) == 6 and all(len(t.top_logprobs) == 2 for t in full)
    assert all(t.bytes == list(t.token.encode()) for t in full)
    streamed = [t for chunk in client.chat.completions.create(**kw, stream=True)
                for c in chunk.choices if c.logprobs and c.logprobs.content
                for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in full]


def test_sdk_structured_output_parses_into_a_pydantic_model(client):
    """`client.chat.completions.parse(response_format=Model)`: the SDK sends the model's
    strict JSON schema and parses the reply into it."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: int = Field(ge=0, le=50)

    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Lisbon."}],
        response_format=City, temperature=0, max_tokens=100)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_sdk_named_tool_call_and_vllm_extras(client):
    import json
    tools = [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}}}]
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0,
        max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    # vLLM's extensions through extra_body, OpenAI's penalties and logit_bias as arguments
    r = client.completions.create(
        model=MODEL, prompt="The answer is", max_tokens=3, temperature=0,
        logit_bias={"45": 100}, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.1, "min_tokens": 3,
                    "structured_outputs": {"regex": "=+"}})
    assert r.choices[0].text == "==="


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


def test_sdk_agent_loop_call_result_answer(client):
    """Two turns of an agent loop on the real model through the SDK: "required" makes the
    call (grammar-held to the tool's schema); the call and the tool's result go back in
    the history (SmolLM2's template takes no tools: described in a system message, the
    result in words); with "auto" the model, free, writes another call in Hermes' tags,
    which the hermes parser reads (streamed, the SDK's accumulation gives the same call);
    with "none" it answers from the result."""
    import json
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = ask + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": json.dumps({"temperature_c": 14, "sky": "rain"})}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    [again] = r.choices[0].message.tool_calls
    assert again.function.name == "get_weather"
    assert json.loads(again.function.arguments) == {"city": "Paris"}
    with client.chat.completions.stream(model=MODEL, messages=history, tools=[WEATHER],
                                        temperature=0, max_tokens=60) as stream:
        pieces = sum(1 for e in stream if e.type == "tool_calls.function.arguments.delta")
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == \
        (again.function.name, again.function.arguments)
    assert pieces > 1 and final.choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_tokens=60)
    answer = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and answer.tool_calls is None
    assert "14" in answer.content and "Paris" in answer.content


@pytest.mark.full  # fast tier: the SIGTERM drain of test_server_real
def test_sigint_shuts_down_cleanly(smollm2_checkpoint, cache_dir, tmp_path):
    """Ctrl-C is a graceful shutdown, exit status 0 (a server of its own: the module's
    stays up for the other tests, in any order)."""
    with launched_server(cache_dir, tmp_path) as server:
        server.proc.send_signal(signal.SIGINT)
        try:
            rc = server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve.py still running 20 s after SIGINT:\n{server.log_tail()}")
        log = server.log_tail(100_000)
    assert "Application shutdown complete" in log
    assert rc == 0 and "Traceback" not in log, log[-4000:]


def test_tokenize_counts_what_the_chat_prompt_costs(greedy_chat, server, tokenizer):
    """/tokenize of the chat's messages gives as many tokens as the chat completion's
    usage.prompt_tokens (the same template and tokenizer), and the model's max_model_len;
    /detokenize of them gives back the rendered prompt with its special tokens."""
    import httpx
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": CHAT},
                   timeout=30).json()
    assert r["count"] == greedy_chat.usage.prompt_tokens == len(r["tokens"])
    assert r["max_model_len"] > r["count"]
    text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": r["tokens"]},
                      timeout=30).json()["prompt"]
    assert text == tokenizer.apply_chat_template(CHAT) and "<|im_start|>" in text
