"""The OpenAI-compatible server against the model-free FakeEngine: request validation (400s
in OpenAI's error shape), responses and SSE streams, usage, chat template, disconnects."""

import asyncio
import json
import time

import pytest
from starlette.testclient import TestClient

from fake_engine import FakeEngine, tiny_tokenizer
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.openai.api_server import build_app

REPLY = "Hi there! 😀 Bye."
MAX_LEN = 64
MODEL = "fake-model"


@pytest.fixture
def server():
    tok = tiny_tokenizer()
    fake = FakeEngine(tok, REPLY, max_model_len=MAX_LEN)
    bridge = AsyncEngine(fake)
    app = build_app(bridge, tok, MODEL, MAX_LEN)
    with TestClient(app) as client:
        yield client, fake, tok, app
    bridge.shutdown()


def sse_events(resp) -> list:
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    body = resp.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] if e == "data: [DONE]" else json.loads(e[len("data: "):]) for e in events]


REPLY_TOKENS = len(REPLY.encode()) + 1  # one token per byte, then EOS


def test_completion(server):
    client, fake, tok, _ = server
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 40})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": REPLY_TOKENS,
                             "total_tokens": 5 + REPLY_TOKENS}
    assert fake.pages_in_use == 0


def test_completion_lengths_and_stops(server):
    client, fake, tok, _ = server
    post = lambda **kw: client.post("/v1/completions", json={"prompt": "Hello", **kw}).json()
    r = post(max_tokens=3)
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("Hi ", "length")
    r = post(ignore_eos=True)  # OpenAI's default max_tokens: 16
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    r = post(stop="😀", max_tokens=40)
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("Hi there! ", "stop")
    r = post(stop=["nothing", "re!"], max_tokens=40)
    assert r["choices"][0]["text"] == "Hi the"
    r = post(prompt=[72, 105], max_tokens=2)  # token ids
    assert r["usage"]["prompt_tokens"] == 2 and r["choices"][0]["text"] == "Hi"
    r = post(prompt=["Hello"], max_tokens=2)  # a batch of one
    assert r["usage"]["prompt_tokens"] == 5
    r = post(max_tokens=40, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, n=1,
             logprobs=None, best_of=1, echo=False)
    assert r["choices"][0]["text"] == REPLY


def test_chat_completion_applies_template(server):
    client, fake, tok, _ = server
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                                "logprobs": None, "finish_reason": "stop"}]
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nyou<|im_end|>\n<|im_start|>assistant\n"
    assert body["usage"]["prompt_tokens"] == len(tok.encode(prompt, add_special_tokens=False))
    # default max_tokens for chat: all the room left in the context
    r = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True}).json()
    assert r["usage"]["total_tokens"] == MAX_LEN and r["choices"][0]["finish_reason"] == "length"
    # max_completion_tokens wins over max_tokens
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 9,
                                                   "max_completion_tokens": 2}).json()
    assert r["usage"]["completion_tokens"] == 2


def test_streaming_completion(server):
    client, fake, _, _ = server
    events = sse_events(client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "stream": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)
    assert fake.pages_in_use == 0


def test_streaming_chat_with_usage(server):
    client, _, tok, _ = server
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}}))
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == REPLY[:5]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    prompt_tokens = len(tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False))
    assert prompt_tokens == 21  # 3 special tokens + 18 bytes
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                                   "total_tokens": prompt_tokens + 5}


def test_n_choices_and_batched_prompts(server):
    """n choices per prompt, for each prompt of a batch: one engine request per choice,
    with seed + i; choices indexed prompt x n + i; usage counts each prompt once."""
    client, fake, tok, _ = server
    body = client.post("/v1/completions", json={"prompt": ["Hello", "Hi"], "n": 2, "seed": 5,
                                                "max_tokens": 4}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == REPLY[:4] for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 5 + 2, "completion_tokens": 16,
                             "total_tokens": 23}
    seeds = {fake_id: r for fake_id, r in zip(fake.added[-4:], fake.added_params[-4:])}
    assert [p.seed for p in seeds.values()] == [5, 6, 5, 6]
    assert [fake_id.rsplit("-", 1)[1] for fake_id in fake.added[-4:]] == ["0", "1", "2", "3"]
    chat = client.post("/v1/chat/completions", json={"messages": MSGS, "n": 3,
                                                     "max_tokens": 2}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in chat["choices"]] == [REPLY[:2]] * 3
    assert fake.pages_in_use == 0


def test_streamed_n_choices_each_carry_their_index(server):
    client, fake, _, _ = server
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": MSGS, "n": 2, "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True}}))
    chunks = events[:-1]
    by_index = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice)
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"  # each choice's first delta
        assert "".join(c["delta"].get("content", "") for c in choices) == REPLY[:5]
        assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert fake.pages_in_use == 0


def test_disconnect_aborts_every_choice(server):
    client, fake, _, app = server
    fake.step_delay = 0.01
    body = {"prompt": "Hello", "n": 3, "max_tokens": 50, "ignore_eos": True, "stream": True}
    asyncio.run(drive(app, COMP, body, disconnect_after_chunks=2))
    deadline = time.monotonic() + 5
    while not (len(fake.aborted) == 3 and fake.pages_in_use == 0):
        assert time.monotonic() < deadline, "choices not aborted after the client left"
        time.sleep(0.005)


def test_a_refused_choice_runs_none():
    """One request runs and one may wait: of n = 3 choices the third is refused (503), and
    the two already taken are aborted."""
    tok = tiny_tokenizer()
    fake = FakeEngine(tok, REPLY, max_model_len=MAX_LEN, step_delay=0.01, max_num_seqs=1)
    bridge = AsyncEngine(fake, max_queued_requests=1)
    with TestClient(build_app(bridge, tok, MODEL, MAX_LEN)) as client:
        r = client.post("/v1/completions", json={"prompt": "Hello", "n": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 5
        while fake.pages_in_use or fake.requests:
            assert time.monotonic() < deadline, "the first choice still runs"
            time.sleep(0.005)
        assert client.post("/v1/completions", json={"prompt": "Hello"}).status_code == 200
    bridge.shutdown()


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]
BAD_REQUESTS = [
    (COMP, {"prompt": "Hi" * 40}, "prompt", "64"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 60}]}, "messages", "64"),
    (COMP, {"prompt": "Hi", "max_tokens": 63}, "max_tokens", "65"),
    (COMP, {"prompt": "Hi", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (COMP, {"prompt": "Hi", "max_tokens": -3}, "max_tokens", None),
    (COMP, {"prompt": "Hi", "max_tokens": "5"}, "max_tokens", None),
    (COMP, {"prompt": "Hi", "max_tokens": 1.5}, "max_tokens", None),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens", None),
    (COMP, {"prompt": "Hi", "temperature": -0.5}, "temperature", None),
    (COMP, {"prompt": "Hi", "temperature": "hot"}, "temperature", None),
    (COMP, {"prompt": "Hi", "top_p": 0}, "top_p", None),
    (CHAT, {"messages": MSGS, "top_p": 1.5}, "top_p", None),
    (COMP, {"prompt": "Hi", "top_k": 2.5}, "top_k", None),
    (COMP, {"prompt": "Hi", "min_p": 2}, "min_p", None),
    (COMP, {"prompt": "Hi", "seed": "x"}, "seed", None),
    (COMP, {"prompt": "Hi", "n": 0}, "n", None),
    (COMP, {"prompt": "Hi", "stop": 5}, "stop", None),
    (COMP, {"prompt": "Hi", "stop": [""]}, "stop", None),
    (COMP, {"prompt": "Hi", "stream": "yes"}, "stream", None),
    (COMP, {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options", None),
    (COMP, {"prompt": "Hi", "ignore_eos": 1}, "ignore_eos", None),
    (COMP, {"prompt": "Hi", "logit_bias": {"x": 5}}, "logit_bias", "token ids"),
    (COMP, {}, "prompt", None),
    (COMP, {"prompt": ""}, "prompt", "empty"),
    (COMP, {"prompt": 12}, "prompt", None),
    (COMP, {"prompt": [1, 99999]}, "prompt", "99999"),
    (COMP, {"prompt": ["a", [1]]}, "prompt.0", None),
    (CHAT, {}, "messages", None),
    (CHAT, {"messages": []}, "messages", None),
    (CHAT, {"messages": "Hi"}, "messages", None),
    (CHAT, {"messages": [{"content": "Hi"}]}, "messages.0.role", None),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type", "'text'"),
    (CHAT, {"model": 3, "messages": MSGS}, "model", None),
]


def test_bad_requests_400_then_still_serving(server):
    client, fake, _, _ = server
    for path, body, param, fragment in BAD_REQUESTS:
        r = client.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["type"], err["param"]) == ("invalid_request_error", param), (body, err)
        assert fragment is None or fragment in err["message"], err["message"]
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = client.post(COMP, content=raw)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post(CHAT, json={"model": "other", "messages": MSGS})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    assert fake.added == []  # validated at the edge: nothing reached the engine
    r = client.post(CHAT, json={"model": MODEL, "messages": MSGS, "max_tokens": 40})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY


def test_models_health_and_unknown_routes(server):
    client, _, _, _ = server
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [(MODEL, "model", MAX_LEN)]
    assert client.get("/health").status_code == 200
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get(COMP)
    assert r.status_code == 405 and "error" in r.json()


async def drive(app, path, body, *, spec_version="2.3", disconnect_after_chunks=None,
                disconnect_after_s=None):
    """Call the ASGI app directly, as a client that goes away mid-response."""
    got_chunks, gone = [], asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if disconnect_after_s is not None:
            await asyncio.sleep(disconnect_after_s)
            return {"type": "http.disconnect"}
        await gone.wait()
        if spec_version == "2.4":
            await asyncio.Event().wait()  # an ASGI 2.4 server reports the loss through send
        return {"type": "http.disconnect"}

    async def send(message):
        if gone.is_set() and spec_version == "2.4":
            raise OSError("client went away")
        if message["type"] == "http.response.body" and message.get("body"):
            got_chunks.append(message["body"])
            if disconnect_after_chunks is not None and len(got_chunks) >= disconnect_after_chunks:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return got_chunks


async def drive_and_check_aborted(app, fake, path, body, **kw):
    """`drive`, then (with this event loop still open, so delivery to it still works) wait
    for the engine to be told to abort and for the request's pages to be free."""
    chunks = await drive(app, path, body, **kw)
    deadline = time.monotonic() + 5
    while not (len(fake.aborted) == 1 and fake.pages_in_use == 0):
        assert time.monotonic() < deadline, "request not aborted after the client left"
        await asyncio.sleep(0.005)
    return chunks


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_disconnect_mid_stream_aborts_and_frees_pages(server, spec_version):
    client, fake, _, app = server
    fake.step_delay = 0.01
    body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
    chunks = asyncio.run(drive_and_check_aborted(app, fake, COMP, body, spec_version=spec_version,
                                                 disconnect_after_chunks=2))
    assert len(chunks) >= 2
    assert fake.num_steps < 45  # stopped long before max_tokens


def test_disconnect_during_non_streaming_request_aborts(server):
    client, fake, _, app = server
    fake.step_delay = 0.01
    body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
    asyncio.run(drive_and_check_aborted(app, fake, COMP, body, disconnect_after_s=0.1))
    assert fake.num_steps < 45


def test_embeddings_need_pooling(server):
    client, *_ = server
    r = client.post("/v1/embeddings", json={"input": "Hi"})
    assert r.status_code == 400 and "--pooling" in r.json()["error"]["message"]


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize and /detokenize: a prompt's ids (special tokens as the tokenizer
    adds them, or not), chat messages through the chat template (with and without the
    generation prompt), token strings on request, the text of ids back; bad bodies are
    400s naming the field, another model a 404."""
    client, _, tok, _ = server
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_LEN and body["token_strs"] is None
    r = client.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello", add_special_tokens=False)
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    msgs = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert chat == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    bare = client.post("/tokenize", json={"messages": msgs,
                                          "add_generation_prompt": False}).json()["tokens"]
    assert bare == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False),
                              add_special_tokens=False) and bare != chat
    r = client.post("/detokenize", json={"tokens": chat})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(chat, skip_special_tokens=False)}
    for path, body, status, param in (
            ("/tokenize", {"prompt": "a", "messages": msgs}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
            ("/detokenize", {"tokens": [1, tok.vocab_size]}, 400, "tokens.1"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
            ("/detokenize", {"tokens": "x"}, 400, "tokens")):
        r = client.post(path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
