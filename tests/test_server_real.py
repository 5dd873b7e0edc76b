"""serve.py on the real model (tests/configs/smollm2_small.py, max_model_len 512), as a
crowd of careless and hostile clients meets it, through tools/stress_server.py:

- isolation: 8 long greedy streams run while the named hostile inputs of issue 13 (seeds
  and top_k beyond their range, lone surrogates, JSON nested 100k deep, 5001-digit
  integers, a 20 MB body, ...), `--fuzz-examples` hypothesis-drawn bodies (300 in CI) and
  8 clients that leave mid-stream arrive; every stream completes with all its tokens, no
  response is a 5xx, no connection is reset, every page comes back, and the greedy answer
  to a probe prompt is unchanged afterwards;
- /metrics agrees with that workload (finished = the choices of the 200s, refused = 4xx);
- the API key (from $JAXSERVE_API_KEY) guards /v1/* and leaves /health, /ready open;
- /health keeps answering while a 4 MB prompt is tokenised;
- SIGTERM drains: new requests get 503 and /ready 503, a short in-flight stream completes,
  a long one is aborted at --shutdown-timeout, the process exits 0 (last: it stops the
  server).
"""

import contextlib
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench import serve as bench_serving
from tools import stress_server

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "configs" / "smollm2_small.py"
TWO_SHAPES = ROOT / "tests" / "configs" / "smollm2_two_shapes.py"
MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-jaxserve-test"
# The drain test's two streams on the f32 two-shape engine (~130 ms a token on a 2-core Zen 3
# VM alone, 2x that beside the suite's other worker): the short stream's 8 tokens finish
# well inside the timeout even on a loaded machine, the long stream's 480 cannot on one 4x
# faster. (At 3 s with 16 short tokens the short stream was cut once under the whole suite.)
SHUTDOWN_TIMEOUT_S = 6
SHORT_TOKENS, LONG_TOKENS = 8, 480
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def launched_server(cache_dir, log_dir: Path, config: Path = CONFIG):
    """serve.py with an API key from the environment, once /ready answers 200; killed on
    exit if still running."""
    log = log_dir / "serve.log"
    proc, url, _ = bench_serving.launch(
        config, cache_dir, log_path=log,
        extra_args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
        env={**os.environ, "JAXSERVE_API_KEY": KEY, "PYTHONUNBUFFERED": "1"})
    base = url.removesuffix("/v1")
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"serve.py exited:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(base + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        yield proc, base, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(smollm2_checkpoint, cache_dir, tmp_path_factory):
    """The module's server."""
    with launched_server(cache_dir, tmp_path_factory.mktemp("serve")) as srv:
        yield srv


def scrape(base: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_api_key_guards_the_api(server):
    _, base, _ = server
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(base + path).status_code == 200, path


@pytest.mark.full  # fast tier: the real server's limits, health and drain
def test_hostile_clients_harm_no_other_request(server, fuzz_examples):
    proc, base, log = server
    before = scrape(base)
    report = stress_server.stress(base, MODEL, streams=8, stream_tokens=160,
                                  fuzz=fuzz_examples, disconnects=8, api_key=KEY)
    stress_server.print_report(report)
    assert not report.server_errors and not report.connection_errors
    assert not report.bad_expectations and not report.streams_lost
    assert report.pages_returned and report.probe_before == report.probe_after
    assert report.probe_before and report.fuzz_cases == fuzz_examples
    assert report.by_status.get(200, 0) >= 8 + 8 + 3 and report.by_status.get(400, 0) >= 15
    assert proc.poll() is None
    after = scrape(base)
    delta = lambda name: total(after, name) - total(before, name)
    # refused by the generating endpoints (/tokenize and /detokenize never reach the engine)
    refused = sum(n for path in stress_server.ENGINE_PATHS
                  for status, n in report.by_path.get(path, {}).items() if 400 <= status < 500)
    if fuzz_examples >= 100:  # each path was fuzzed (1 in 9 bodies goes to each of three)
        assert set(report.by_path) >= set(stress_server.FUZZ_PATHS), report.by_path
    # one per choice (n per prompt) of every request answered 200
    assert delta("jaxserve:request_success_total") == report.choices
    assert delta("jaxserve:requests_failed_total") == 0
    assert delta("jaxserve:requests_rejected_total") == refused
    assert delta("jaxserve:time_to_first_token_seconds_count") >= 8 + 3
    assert delta("jaxserve:generation_tokens_total") >= 8 * 160
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-4000:]


@pytest.mark.full  # fast tier: the same over the app (tests/test_server_limits.py, 1 MB)
def test_health_answers_while_a_4mb_prompt_is_tokenised(server):
    """The body is parsed, and the prompt tokenised, off the event loop (and the tokenizer
    releases the GIL): /health keeps answering throughout. Measured against the request's
    own time, not a fixed number: were parsing on the event loop, a /health sent while it
    runs would wait for most of it."""
    _, base, _ = server
    _wait_for_warmup(base)  # the background warm-up's tracing holds the GIL
    result = {}

    def post():
        result["r"] = httpx.post(base + "/v1/completions", headers=AUTH, timeout=120,
                                 json={"prompt": "hello world " * (4 * 2**20 // 12)})
    thread = threading.Thread(target=post)
    t_post = time.perf_counter()
    thread.start()
    latencies = []
    with httpx.Client() as client:
        while thread.is_alive():
            t0 = time.perf_counter()
            assert client.get(base + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    thread.join()
    took = time.perf_counter() - t_post
    assert result["r"].status_code == 400
    assert result["r"].json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 10, "the prompt was not large enough to take a while"
    assert max(latencies) < took / 3, (f"/health took {max(latencies) * 1000:.0f} ms while "
                                       f"the prompt took {took * 1000:.0f} ms")


def _wait_for_warmup(base: str) -> None:
    deadline = time.monotonic() + 240
    while httpx.get(base + "/health").json()["warmup_pending"]:
        assert time.monotonic() < deadline, "background warm-up never finished"
        time.sleep(0.2)


def test_a_mixed_workload_compiles_nothing_after_warmup(server):
    """Once the background warm-up is done, concurrent requests with structured output,
    n > 1, penalties, logit_bias, logprobs and prompt logprobs, seeds, stop strings and
    streaming add no JAX trace, lowering, compilation or compilation-cache fetch: /health's
    and /metrics' counts of them (every jax.monitoring compile event of the server process)
    stay where they were. Speculation: tests/test_spec_decode.py (verify steps)."""
    _, base, _ = server
    _wait_for_warmup(base)
    health = httpx.get(base + "/health").json()
    before = scrape(base)
    assert health["jax_compile_events"] == total(before, "jaxserve:jax_compile_events_total") > 0
    assert health["jax_traces"] > 0 and health["jax_compilations"] > 0  # warm-up's
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 12}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    bodies = [
        ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
            "max_tokens": 60}),
        ("/v1/chat/completions", {**chat, "n": 3, "temperature": 1.0, "seed": 5}),
        ("/v1/chat/completions", {**chat, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                                  "logit_bias": {"13": 5}, "logprobs": True,
                                  "top_logprobs": 3}),
        ("/v1/chat/completions", {**chat, "stream": True, "temperature": 0.7, "top_p": 0.9}),
        ("/v1/completions", {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 16,
                             "echo": True, "logprobs": 2, "stop": [" 9"],
                             "repetition_penalty": 1.1, "min_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "The sky is " * 60, "max_tokens": 8,
                             "n": 2, "temperature": 0.8, "top_k": 20, "min_p": 0.05}),
    ]

    def send(item):
        url, body = item
        r = httpx.post(base + url, json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, (body, r.text)
        return r

    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(send, bodies))
    answer = json.loads(replies[0].json()["choices"][0]["message"]["content"])
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    assert len(replies[1].json()["choices"]) == 3
    after = scrape(base)
    events = {key: value for key, value in before.items()
              if key[0] == "jaxserve:jax_compile_events_total"}
    assert {dict(labels)["kind"] for _, labels in events} == {"trace", "lowering",
                                                             "compilation", "cache_fetch"}
    assert {key: after[key] for key in events} == events
    assert httpx.get(base + "/health").json()["jax_compile_events"] == health["jax_compile_events"]


def _stream(base: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    payload = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", base + "/v1/completions", json=payload, headers=AUTH,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    out["events"] = events


def test_sigterm_drains_then_exits_0(smollm2_checkpoint, cache_dir, tmp_path):
    """A server of its own (SIGTERM stops it; the module's stays up for the other tests, in
    any order), of the two-shape config: its warm-up, which the test waits for, is two
    compilations instead of twelve."""
    with launched_server(cache_dir, tmp_path, TWO_SHAPES) as srv:
        _drain(*srv)


def _drain(proc, base, log) -> None:
    """SIGTERM while a short and a long stream run: new requests get 503 at once, the short
    stream finishes, the long one is cut at the shutdown timeout, exit status 0."""
    # the step shapes compiled first (its background warm-up over): a short stream that
    # has to compile a shape on demand on a loaded machine can miss the 3 s timeout, which
    # is not what this test is about (it failed so under the full suite beside a busy job)
    deadline = time.monotonic() + 240
    while httpx.get(base + "/health", headers=AUTH, timeout=5).json().get("warmup_pending"):
        assert time.monotonic() < deadline, "background warm-up still running"
        time.sleep(0.5)
    results = {"short": {}, "long": {}}
    started = {k: threading.Event() for k in results}
    threads = [threading.Thread(target=_stream, args=(base, n, results[k], started[k]))
               for k, n in (("short", SHORT_TOKENS), ("long", LONG_TOKENS))]
    for t in threads:
        t.start()
    for e in started.values():
        assert e.wait(60)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    time.sleep(0.3)
    r = httpx.post(base + "/v1/completions", json={"prompt": "Hi"}, headers=AUTH)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(base + "/ready").status_code == 503
    for t in threads:
        t.join(60)
    rc = proc.wait(30)
    assert rc == 0, log.read_text()[-4000:]
    assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT_S + 10
    short = [json.loads(e) for e in results["short"]["events"][:-1]]
    assert results["short"]["events"][-1] == "[DONE]"
    assert short[-1]["usage"]["completion_tokens"] == SHORT_TOKENS, "the short stream finished"
    long_ = results["long"]["events"]
    assert long_[-1] == "[DONE]" and "shutting_down" in long_[-2], long_[-2:]
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
