"""jaxserve.bench.serve (`jaxserve bench serve`): metric definitions from synthetic timestamps, the shipped prompt
dataset, seeded sampling and arrivals, and end-to-end runs against a real HTTP server
(uvicorn in a thread) over the model-free FakeEngine."""

import asyncio
import json
import math
import statistics

import httpx
import pytest

from app_server import uvicorn_thread
from fake_engine import FakeEngine, tiny_tokenizer
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.bench import serve as bench_serving
from jaxserve.entrypoints.openai.api_server import build_app



bs = bench_serving
MODEL = "fake-model"


# --- metrics from synthetic timestamps ------------------------------------------------------

def test_summarise_chunks_ttft_itl_latency():
    r = bs.summarise_chunks(10.0, [10.5, 10.6, 10.8, 11.1], 11.2, usage_tokens=6)
    assert r.success and r.output_tokens == 6
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.latency == pytest.approx(1.2)  # the last chunk with choices (finish_reason)
    r = bs.summarise_chunks(0.0, [0.2, 0.5], None, usage_tokens=None)  # no usage: count chunks
    assert r.output_tokens == 2 and r.latency == pytest.approx(0.5)
    r = bs.summarise_chunks(0.0, [], 0.3, usage_tokens=5)
    assert not r.success and "content" in r.error


def test_request_body_takes_extra_fields_which_win():
    for endpoint in ("completions", "chat"):
        plain = bs.request_body(endpoint, "m", "hi", 8)
        body = bs.request_body(endpoint, "m", "hi", 8,
                               {"skip_special_tokens": False, "temperature": 0.5})
        assert body["skip_special_tokens"] is False and body["temperature"] == 0.5
        assert "skip_special_tokens" not in plain and plain["temperature"] == 0.0
        assert {k: v for k, v in body.items() if k not in ("skip_special_tokens",
                                                           "temperature")} == \
            {k: v for k, v in plain.items() if k != "temperature"}


def test_calculate_metrics_known_values():
    R = bs.RequestResult
    results = [
        R(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.1, 0.1]),
        R(success=True, prompt_len=20, output_tokens=3, ttft=0.2, latency=0.6, itl=[0.2, 0.2]),
        R(success=True, prompt_len=30, output_tokens=1, ttft=0.3, latency=0.3, itl=[]),
        R(success=True, prompt_len=40, output_tokens=11, ttft=0.4, latency=1.4, itl=[0.1] * 10),
        R(success=False, prompt_len=50, error="HTTP 500: boom"),
    ]
    m = bs.calculate_metrics(results, duration_s=2.0, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (4, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (100, 20)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(10.0)
    assert m["total_token_throughput"] == pytest.approx(60.0)
    # TTFT 0.1 0.2 0.3 0.4 s: mean 250 ms, population std sqrt(0.0125) s, p99 by linear
    # interpolation at rank 0.99 * 3 = 2.97 -> 0.3 + 0.97 * 0.1
    assert m["mean_ttft_ms"] == pytest.approx(250)
    assert m["median_ttft_ms"] == pytest.approx(250)
    assert m["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(0.0125))
    assert m["p99_ttft_ms"] == pytest.approx(397)
    assert m["p50_ttft_ms"] == pytest.approx(250)
    # TPOT: (e2e - ttft) / (n - 1), only for n > 1: 0.1, 0.2, 0.1 s
    assert m["mean_tpot_ms"] == pytest.approx(1000 * 0.4 / 3)
    assert m["median_tpot_ms"] == pytest.approx(100)
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.98 * 100)  # rank 1.98 of [.1, .1, .2]
    # ITL: all 16 gaps pooled: fourteen of 0.1 s, two of 0.2 s
    assert m["mean_itl_ms"] == pytest.approx(1000 * (14 * 0.1 + 2 * 0.2) / 16)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["p99_itl_ms"] == pytest.approx(200)
    # E2E: 0.3 0.5 0.6 1.4 s
    assert m["mean_e2el_ms"] == pytest.approx(700)
    assert m["median_e2el_ms"] == pytest.approx(550)
    assert m["p99_e2el_ms"] == pytest.approx(600 + 0.97 * 800)
    assert bs.summarise_errors(results) == {"HTTP 500: boom": 1}


def test_calculate_metrics_all_failed_is_zero_not_nan():
    m = bs.calculate_metrics([bs.RequestResult(error="x")], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0


def test_counter_deltas():
    before = {"num_compilations": 3, "num_steps": 10, "kv_live_token_steps": 100,
              "kv_allocated_token_steps": 400, "host_seconds": 1.0, "step_seconds": 5.0,
              "jax_compile_events": 40}
    after = {"num_compilations": 4, "num_steps": 60, "kv_live_token_steps": 400,
             "jax_compile_events": 43,
             "kv_allocated_token_steps": 1000, "host_seconds": 2.0, "step_seconds": 9.0, "new": 1}
    d = bs.counter_deltas(before, after)
    assert d["server_counters"]["num_steps"] == 50 and "new" not in d["server_counters"]
    assert d["compilations_during_run"] == 1 and d["jax_compile_events_during_run"] == 3
    assert d["kv_utilization"] == pytest.approx(0.5)
    assert d["host_overhead"] == pytest.approx(0.25)
    d = bs.counter_deltas({"num_steps": 1}, {"num_steps": 5})  # fields missing: None
    assert d["server_counters"] == {"num_steps": 4}
    assert d["compilations_during_run"] is d["kv_utilization"] is d["host_overhead"] is None
    assert bs.counter_deltas(None, after)["server_counters"] is None


def test_health_without_counters_is_skipped():
    def handler(request):
        if request.url.path == "/health":
            return httpx.Response(404, text="not found")
        return httpx.Response(200, text="<html>ok</html>")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            assert await bs.fetch_server_counters(c, "http://x/v1") is None
        ok = lambda r: httpx.Response(200, json={"status": "ok", "num_steps": 3, "ready": True})
        async with httpx.AsyncClient(transport=httpx.MockTransport(ok)) as c:
            assert await bs.fetch_server_counters(c, "http://x/v1/") == {"num_steps": 3}

    asyncio.run(go())
    assert bs.server_root("http://h:1/v1/") == "http://h:1"


# --- dataset, sampling, arrivals ------------------------------------------------------------

def test_dataset_file():
    entries = bs.read_dataset()
    assert len(entries) >= 300
    assert bs.DEFAULT_DATASET.stat().st_size < 320 * 1024
    words = {"the", "a", "an", "of", "and", "to", "is", "are", "in", "for", "with", "this", "it",
             "what", "how", "why", "who", "which", "do", "me", "my", "write", "explain", "list"}
    for e in entries:
        text = e.prompt
        assert sum(c.isascii() for c in text) / len(text) > 0.97  # English, not other scripts
        assert words & set(text.lower().replace("?", " ").split()), text[:80]
        assert 16 <= e.output_len <= 256
    out = [e.output_len for e in entries]
    assert 110 <= statistics.mean(out) <= 150 and statistics.pstdev(out) > 40
    plens = [e.prompt_len for e in entries]
    assert all(isinstance(n, int) and n > 0 for n in plens)
    assert min(plens) < 20 and max(plens) > 700
    assert 80 <= statistics.median(plens) <= 220
    assert statistics.pstdev(plens) > 120  # a real spread, not one length
    assert len({e.prompt for e in entries}) == len(entries)
    sources = [json.loads(line).get("source", "") for line in bs.DEFAULT_DATASET.open()]
    assert len({s.split(":")[0] for s in sources}) >= 4


def test_seeded_sampling():
    a = bs.load_dataset(num_prompts=50, seed=7)
    assert [r.prompt for r in a] == [r.prompt for r in bs.load_dataset(num_prompts=50, seed=7)]
    assert [r.prompt for r in a] != [r.prompt for r in bs.load_dataset(num_prompts=50, seed=8)]
    assert len({r.prompt for r in a}) == 50  # without replacement
    n = len(bs.read_dataset())
    big = bs.load_dataset(num_prompts=n + 100, seed=1, output_len=32)  # with replacement
    assert len(big) == n + 100 and {r.output_len for r in big} == {32}
    with pytest.raises(ValueError):
        bs.load_dataset(num_prompts=0)


def test_bad_dataset_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "hi", "output_len": 4}\n{"prompt": "", "output_len": 4}\n')
    with pytest.raises(ValueError, match=":2:"):
        bs.read_dataset(p)


def test_arrival_times_poisson():
    assert bs.arrival_times(3) == [0.0, 0.0, 0.0]
    t = bs.arrival_times(20000, request_rate=10.0, seed=3)
    assert t == bs.arrival_times(20000, request_rate=10.0, seed=3)
    assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential


# --- end to end over HTTP ---------------------------------------------------------------------

class TrackingFakeEngine(FakeEngine):
    """FakeEngine recording the most requests it ever held at once."""
    max_running = 0

    def step(self):
        self.max_running = max(self.max_running, len(self.requests))
        return super().step()


@pytest.fixture
def live_server():
    """(API base URL, fake engine) of jaxserve's app served by uvicorn on a free port."""
    tok = tiny_tokenizer()
    fake = TrackingFakeEngine(tok, "Hi there! 😀 Bye.", max_model_len=512, page_size=16,
                              num_pages=1024, step_delay=0.002)
    bridge = AsyncEngine(fake)
    try:
        with uvicorn_thread(build_app(bridge, tok, MODEL, 512), start_timeout_s=10) as url:
            yield url, fake
    finally:
        bridge.shutdown()


def _requests(n):
    return [bs.BenchRequest(f"Question number {i}: why is the sky blue?", 5 + (i * 7) % 20)
            for i in range(n)]


def test_end_to_end_max_concurrency(live_server):
    url, fake = live_server
    assert asyncio.run(bs.get_model_id(url)) == MODEL
    reqs = _requests(12)
    res = asyncio.run(bs.run_benchmark(url, MODEL, reqs, max_concurrency=3, progress=False))
    assert res["completed"] == 12 and res["failed"] == 0 and res["errors"] == {}
    # usage counts (the emoji's 4 bytes are 4 tokens but 1 content chunk)
    assert res["output_lens"] == [r.output_len for r in reqs]
    assert res["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert res["input_lens"] == [len(r.prompt.encode()) for r in reqs]
    assert 1 <= fake.max_running <= 3 and 2 <= res["max_concurrent_requests"] <= 3
    assert res["server_counters"]["num_steps"] > 0 and res["compilations_during_run"] == 0
    assert res["kv_utilization"] is None and res["host_overhead"] is None
    assert res["mean_ttft_ms"] > 0 and res["mean_tpot_ms"] > 0 and res["p99_itl_ms"] > 0
    assert all(len(itl) >= 1 for itl in res["itls"])
    json.dumps(res, allow_nan=False)  # strict JSON
    assert fake.pages_in_use == 0


def test_end_to_end_poisson_chat(live_server):
    url, fake = live_server
    reqs = _requests(10)
    rate = 10.0
    res = asyncio.run(bs.run_benchmark(url, None, reqs, request_rate=rate, seed=5,
                                       endpoint="chat", progress=False))
    assert res["completed"] == 10
    assert res["output_lens"] == [r.output_len for r in reqs]
    schedule = bs.arrival_times(10, rate, seed=5)
    assert res["scheduled_times"] == schedule and schedule[-1] > 0.3
    # never before its time (so not all at once); how late a send may be depends on the
    # machine's load (a busy CI box delayed one by 0.2 s), so that bound is loose
    for sent, due in zip(res["send_times"], schedule):
        assert due - 1e-3 <= sent <= due + 1.0
    assert res["duration"] >= schedule[-1]
    assert res["request_rate"] == rate


def test_unreachable_server_counts_failures():
    url = f"http://127.0.0.1:{bs.free_port()}/v1"
    res = asyncio.run(bs.run_benchmark(url, "m", _requests(3), progress=False))
    assert res["completed"] == 0 and res["failed"] == 3
    (msg, n), = res["errors"].items()
    assert n == 3 and "Connect" in msg
    with pytest.raises(bs.BenchmarkError, match="cannot reach"):
        asyncio.run(bs.get_model_id(url))


def test_error_status_is_summarised(live_server):
    url, _ = live_server
    too_long = bs.BenchRequest("x" * 600, 4)  # over max_model_len: HTTP 400
    res = asyncio.run(bs.run_benchmark(url, MODEL, [too_long, *_requests(2)], progress=False))
    assert res["completed"] == 2 and res["failed"] == 1
    (msg, n), = res["errors"].items()
    assert msg.startswith("HTTP 400") and "context length" in msg
    with pytest.raises(bs.BenchmarkError, match="HTTP 400"):
        asyncio.run(bs.check_server(url, MODEL, too_long))


def test_cli_against_running_server(live_server, tmp_path, capsys):
    url, _ = live_server
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"Tell me about number {i}.", "output_len": 6})
                          + "\n" for i in range(5)))
    out = tmp_path / "r.json"
    assert bs.main(["--url", url, "--dataset", str(ds), "--num-prompts", "4", "--no-progress",
                    "--result-json", str(out), "--max-concurrency", "2"]) == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms):" in text
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["model_id"] == MODEL
    assert res["config"]["dataset"] == str(ds) and res["request_rate"] == "inf"
    bad = f"http://127.0.0.1:{bs.free_port()}/v1"
    assert bs.main(["--url", bad, "--dataset", str(ds), "--num-prompts", "1", "--no-progress"]) == 1
    assert "error: cannot reach" in capsys.readouterr().err
