"""Stress an OpenAI-compatible server the way a crowd of careless and hostile clients would,
and check that no request harmed another (PERFORMANCE.md, "Serving under hostile clients").

    python -m tools.stress_server --launch [--config configs/smollm2_135m.py] [--cache-dir DIR]
    python -m tools.stress_server --url http://127.0.0.1:8000 [--api-key KEY]
        [--streams 256] [--stream-tokens 64] [--fuzz 10000] [--disconnects 256]
        [--seed 0] [--result-json out.json]

While `--streams` long greedy streams run (ignore_eos, `--stream-tokens` tokens each), it
sends the named hostile inputs (`named_bad_inputs`: each must get its expected status),
`--fuzz` request bodies drawn by hypothesis (tools/request_fuzz.py: any JSON, objects of the
known keys with any values, near-valid bodies at every range's edges, structured-output
constraints among them), each to one of the completions, chat, embeddings, /tokenize and
/detokenize endpoints, and `--disconnects` streams whose clients leave after the first
chunk. Then it checks: every long stream ended with all its tokens and no error event; no
response was a 5xx; no connection was reset or closed early; every KV page came back
(`/health`: nothing running, all pages free); the greedy answer to a probe prompt is what
it was before. Prints those figures; exits 1 if any check failed.

Importable: `stress(...)` returns the `StressReport` (tests/test_server_real.py runs a
small one in CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import httpx

from jaxserve.bench.serve import DEFAULT_CONFIG, launch
from tools.request_fuzz import dump_body, request_strategies

PROBE = "The capital of France is"
LONG_PROMPTS = ["Once upon a time, in a small village by the sea,",
                "The history of the printing press begins",
                "Here is a recipe for a simple tomato soup:",
                "Dear diary, today I learned that"]


@dataclasses.dataclass
class StressReport:
    """What `stress` saw. requests: every request sent (streams, named inputs, fuzz,
    disconnects, probes); by_status: their HTTP statuses; server_errors: 5xx responses
    (what was sent, what came back); connection_errors: resets / early closes;
    bad_expectations: named inputs answered other than expected; streams_lost: long
    streams that did not end with all their tokens; pages_returned: the KV pool was whole
    again afterwards; probe_before / probe_after: the greedy answer to PROBE. choices: the
    engine requests of the requests answered 200 (a completion's n per prompt, an
    embedding's inputs; what the server's request_success_total counts). by_path: the
    statuses of the POSTs to each path ({path: {status: count}}), so that refusals can be
    told apart from the engine's (/tokenize and /detokenize never reach it)."""

    requests: int = 0
    choices: int = 0
    by_status: dict = dataclasses.field(default_factory=dict)
    by_path: dict = dataclasses.field(default_factory=dict)
    server_errors: list = dataclasses.field(default_factory=list)
    connection_errors: list = dataclasses.field(default_factory=list)
    bad_expectations: list = dataclasses.field(default_factory=list)
    streams_lost: list = dataclasses.field(default_factory=list)
    fuzz_cases: int = 0
    disconnects: int = 0
    pages_returned: bool = False
    final_health: dict = dataclasses.field(default_factory=dict)
    probe_before: str | None = None
    probe_after: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.server_errors or self.connection_errors or self.bad_expectations
                    or self.streams_lost) and self.pages_returned \
            and self.probe_before == self.probe_after is not None


class _Client:
    """httpx against one server, counting every request into a StressReport (thread-safe)."""

    def __init__(self, base: str, api_key: str | None, report: StressReport):
        self.base = base.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.report = report
        self._lock = threading.Lock()
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=1024))

    def record(self, what: str, status: int | None, error: str | None = None,
               choices: int = 1, path: str = "/v1/completions") -> None:
        with self._lock:
            self.report.requests += 1
            if status == 200:
                self.report.choices += choices
            if status is not None:
                self.report.by_status[status] = self.report.by_status.get(status, 0) + 1
                counts = self.report.by_path.setdefault(path, {})
                counts[status] = counts.get(status, 0) + 1
                if status >= 500:
                    self.report.server_errors.append((what, status, (error or "")[:300]))
            else:
                self.report.connection_errors.append((what, error))

    def post(self, path: str, content: bytes, what: str) -> httpx.Response | None:
        try:
            r = self.http.post(self.base + path, content=content,
                               headers={"content-type": "application/json", **self.headers})
        except httpx.TransportError as e:
            self.record(what, None, repr(e), path=path)
            return None
        self.record(what, r.status_code, r.text if r.status_code >= 500 else None,
                    _num_choices(r) if r.status_code == 200 else 0, path)
        return r

    def get_json(self, path: str) -> dict:
        return self.http.get(self.base + path, headers=self.headers).json()


def _num_choices(r: httpx.Response) -> int:
    """The engine requests of a 200 response: its choices (of the JSON body, or the distinct
    indices of an SSE stream's chunks), an embedding response's vectors; 0 for /tokenize
    and /detokenize."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        indices = set()
        for line in r.text.split("\n"):  # not splitlines(): U+2028 in the JSON is no line end
            if line.startswith("data: {"):
                indices.update(c.get("index") for c in json.loads(line[6:]).get("choices", []))
        return len(indices)
    body = r.json()
    if body.get("object") == "list":  # /v1/embeddings: one engine request per input
        return len(body.get("data", []))
    return len(body.get("choices", []))


def named_bad_inputs(model: str) -> list[tuple[str, str, bytes, int]]:
    """(name, path, body, expected status): the hostile inputs of the robustness tests, and more."""
    def body(**kw) -> bytes:
        return json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 8,
                           **kw}).encode()
    comp, chat = "/v1/completions", "/v1/chat/completions"
    deep = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        ("seed -5 (valid)", comp, body(seed=-5), 200),
        ("seed 2**63 - 1 (valid)", comp, body(seed=2**63 - 1), 200),
        ("seed 2**64", comp, body(seed=2**64), 400),
        ("seed -2**63 - 1", comp, body(seed=-2**63 - 1), 400),
        ("top_k 2**31", comp, body(top_k=2**31), 400),
        ("top_k -1 (valid)", comp, body(top_k=-1, temperature=1.0), 200),
        ("max_tokens 10**30", comp, body(max_tokens=10**30), 400),
        ("n past the choices limit", comp, body(n=129), 400),
        ("lone surrogate prompt", comp, body(prompt="\ud800"), 400),
        ("lone surrogate message", chat, json.dumps(
            {"messages": [{"role": "user", "content": "a\udfffb"}]}).encode(), 400),
        ("lone surrogate stop", comp, body(stop=["\ud801"]), 400),
        ("JSON nested 100k deep", comp, deep, 400),
        ("5001-digit integer", comp, b'{"prompt": "x", "seed": ' + b"7" * 5001 + b"}", 400),
        ("5001-digit extra field", comp, b'{"prompt": "x", "z": ' + b"7" * 5001 + b"}", 400),
        ("invalid UTF-8", comp, b'{"prompt": "\xff\xfe"}', 400),
        ("not an object", comp, b"[1, 2, 3]", 400),
        ("100 stop strings", comp, body(stop=[f"s{i}" for i in range(100)]), 400),
        ("a 5000-character stop string", comp, body(stop=["x" * 5000]), 400),
        ("20 MB body", comp, b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}', 413),
        ("2 MB prompt (tokenised, too long)", comp,
         body(prompt="hello world " * (2 * 2**20 // 12)), 400),
    ]


def _long_stream(client: _Client, model: str, i: int, tokens: int) -> None:
    what = f"long stream {i}"
    payload = {"model": model, "prompt": LONG_PROMPTS[i % len(LONG_PROMPTS)],
               "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    try:
        with client.http.stream("POST", client.base + "/v1/completions", json=payload,
                                headers=client.headers) as r:
            client.record(what, r.status_code)
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.TransportError as e:
        client.record(what, None, repr(e))
        client.report.streams_lost.append((what, repr(e)))
        return
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [c for c in chunks if "error" in c]
    usage = chunks[-1].get("usage") if chunks else None
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    if r.status_code != 200 or errors or events[-1:] != ["[DONE]"] or not usage \
            or usage["completion_tokens"] != tokens or finish[-1:] != ["length"]:
        client.report.streams_lost.append((what, r.status_code, errors[:1], usage))


def _disconnect(client: _Client, model: str, i: int) -> None:
    what = f"disconnect {i}"
    payload = {"model": model, "prompt": LONG_PROMPTS[i % len(LONG_PROMPTS)],
               "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with client.http.stream("POST", client.base + "/v1/completions", json=payload,
                                headers=client.headers) as r:
            client.record(what, r.status_code)
            for _ in r.iter_lines():
                break  # the client leaves after its first chunk
    except httpx.TransportError as e:
        client.record(what, None, repr(e))


def _probe(client: _Client, model: str) -> str | None:
    r = client.post("/v1/completions", json.dumps(
        {"model": model, "prompt": PROBE, "max_tokens": 16, "temperature": 0}).encode(), "probe")
    return r.json()["choices"][0]["text"] if r is not None and r.status_code == 200 else None


# where the fuzzed bodies go: mostly the generating endpoints
FUZZ_PATHS = ("/v1/completions", "/v1/chat/completions") * 3 + ("/v1/embeddings", "/tokenize",
                                                                 "/detokenize")
# the paths whose refusals the server's requests_rejected_total counts
ENGINE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


def _fuzz(client: _Client, model: str, n: int, seed: int, max_tokens: int,
          vocab_size: int) -> None:
    """`n` hypothesis-drawn bodies, each POSTed to one of FUZZ_PATHS."""
    from hypothesis import HealthCheck, given, seed as hyp_seed, settings, strategies as st

    bodies = request_strategies(model, vocab_size, max_tokens=max_tokens).bodies

    @hyp_seed(seed)
    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies, ascii_=st.booleans(), path=st.sampled_from(FUZZ_PATHS))
    def case(body, ascii_, path):
        if isinstance(body, dict) and "max_tokens" not in body \
                and "max_completion_tokens" not in body:
            body = {**body, "max_tokens": max_tokens}  # a valid chat would run to max_model_len
        client.report.fuzz_cases += 1
        client.post(path, dump_body(body, ascii_), f"fuzz {path}: " + repr(body)[:200])

    case()


def _wait_idle(client: _Client, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = client.get_json("/health")
        if health.get("running") == 0 and health.get("waiting") == 0 \
                and health.get("free_pages") == health.get("total_pages"):
            return health
        if time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def stress(url: str, model: str, *, streams: int = 8, stream_tokens: int = 64, fuzz: int = 300,
           disconnects: int = 8, api_key: str | None = None, seed: int = 0,
           fuzz_max_tokens: int = 8, vocab_size: int = 49152,
           idle_timeout_s: float = 60.0) -> StressReport:
    """Run the stress (see the module docstring) against the server at `url` serving
    `model` (over `vocab_size` tokens: where the fuzzed token ids and top_k cluster);
    valid fuzzed bodies ask for at most `fuzz_max_tokens` tokens. Returns the
    StressReport (its `ok` says whether every check held)."""
    report = StressReport()
    client = _Client(url, api_key, report)
    t0 = time.monotonic()
    report.probe_before = _probe(client, model)
    threads = [threading.Thread(target=_long_stream, args=(client, model, i, stream_tokens))
               for i in range(streams)]
    for t in threads:
        t.start()
    for name, path, body, expected in named_bad_inputs(model):
        r = client.post(path, body, name)
        if r is not None and r.status_code != expected:
            report.bad_expectations.append((name, expected, r.status_code, r.text[:300]))
    _fuzz(client, model, fuzz, seed, fuzz_max_tokens, vocab_size)
    leavers = [threading.Thread(target=_disconnect, args=(client, model, i))
               for i in range(disconnects)]
    for t in leavers:
        t.start()
    for t in threads + leavers:
        t.join()
    report.disconnects = disconnects
    report.final_health = _wait_idle(client, idle_timeout_s)
    h = report.final_health
    report.pages_returned = h.get("running") == 0 and h.get("free_pages") == h.get("total_pages")
    report.probe_after = _probe(client, model)
    report.seconds = time.monotonic() - t0
    client.http.close()
    return report


def print_report(report: StressReport) -> None:
    """The figures, one per line."""
    print(f"requests tried:       {report.requests} ({report.fuzz_cases} fuzz cases, "
          f"{report.disconnects} disconnects) in {report.seconds:.0f} s")
    print(f"responses by status:  {dict(sorted(report.by_status.items()))}")
    for path, counts in sorted(report.by_path.items()):
        print(f"  {path:<22}{dict(sorted(counts.items()))}")
    print(f"5xx responses:        {len(report.server_errors)}")
    print(f"connection errors:    {len(report.connection_errors)}")
    print(f"unexpected statuses:  {len(report.bad_expectations)} (named inputs)")
    print(f"streams lost:         {len(report.streams_lost)}")
    print(f"pages returned:       {report.pages_returned} "
          f"({report.final_health.get('free_pages')}/{report.final_health.get('total_pages')} free)")
    print(f"greedy probe same:    {report.probe_before == report.probe_after}")
    for what in (report.server_errors, report.connection_errors, report.bad_expectations,
                 report.streams_lost):
        for item in what[:5]:
            print("  ", item)
    print("OK" if report.ok else "FAILED")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", action="store_true", help="start serve.py first")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="with --launch")
    ap.add_argument("--cache-dir", help="with --launch")
    ap.add_argument("--api-key", help="sent as a Bearer token (and given to serve.py with --launch)")
    ap.add_argument("--model", help="the served model id (default: the first of /v1/models)")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--fuzz", type=int, default=10_000, help="hypothesis cases")
    ap.add_argument("--disconnects", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if args.launch:
        extra = ["--api-key", args.api_key] if args.api_key else []
        proc, url, _ = launch(args.config, args.cache_dir, extra_args=extra)
    try:
        base = url.rstrip("/").removesuffix("/v1")
        deadline = time.monotonic() + 1800
        while True:
            try:
                if httpx.get(base + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc is not None and proc.poll() is not None or time.monotonic() > deadline:
                print("the server did not become ready", file=sys.stderr)
                return 1
            time.sleep(0.5)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or httpx.get(base + "/v1/models", headers=headers).json()["data"][0]["id"]
        report = stress(base, model, streams=args.streams, stream_tokens=args.stream_tokens,
                        fuzz=args.fuzz, disconnects=args.disconnects, api_key=args.api_key,
                        seed=args.seed)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_report(report)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(dataclasses.asdict(report), default=str,
                                                     indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
