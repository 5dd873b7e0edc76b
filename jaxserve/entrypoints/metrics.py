"""Prometheus metrics of one server (`GET /metrics`, the text exposition format).

Names follow vLLM's (`vllm:` -> `jaxserve:`) where they mean the same thing:

    jaxserve:num_requests_running / _waiting      gauge, from the engine's counters
    jaxserve:kv_cache_usage_perc                  gauge, fraction of KV pages in use (0..1)
    jaxserve:num_preemptions_total                counter, from the engine's counters
    jaxserve:num_compilations_total               counter, step compilations (warm-up too)
    jaxserve:jax_compile_events_total{kind}       counter, every JAX trace, lowering,
                                                  compilation and compilation-cache fetch
                                                  in the process (kind: trace, lowering,
                                                  compilation, cache_fetch); after
                                                  warm-up, serving adds none
    jaxserve:jax_compile_seconds_total{kind}      counter, the seconds they took
    jaxserve:prefix_cache_queries_total           counter, prompt tokens looked up in the
                                                  prefix cache
    jaxserve:prefix_cache_hits_total              counter, those found cached (not computed)
    jaxserve:prefix_cache_evictions_total         counter, cached pages taken for new content
    jaxserve:spec_decode_num_drafts_total         counter, draft proposals verified (one per
                                                  sequence and verify round)
    jaxserve:spec_decode_num_draft_tokens_total   counter, draft tokens verified
    jaxserve:spec_decode_num_accepted_tokens_total    counter, draft tokens accepted
    jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position}  counter, accepted
                                                  drafts at position 0..k-1 of a proposal
    jaxserve:structured_output_forced_tokens_total    counter, output tokens a grammar
                                                  forced, added without sampling them
                                                  (jump-forward)
    jaxserve:prompt_tokens_total                  counter, prompt tokens of accepted requests
    jaxserve:generation_tokens_total              counter, output tokens streamed
    jaxserve:request_success_total{finished_reason}   counter: stop, length, abort (one per
                                                  choice: n per prompt)
    jaxserve:requests_rejected_total{reason}      counter, refused before the engine took them
    jaxserve:requests_failed_total{reason}        counter, taken then failed: engine_error,
                                                  timeout, stream_buffer_full, shutdown
    jaxserve:time_to_first_token_seconds          histogram, arrival -> first output token
    jaxserve:inter_token_latency_seconds          histogram, gap between two outputs of a
                                                  request that carry tokens (a burst of a
                                                  multi-step decode is one output)
    jaxserve:e2e_request_latency_seconds          histogram, arrival -> finished

A `Metrics` owns its own `CollectorRegistry` (no process-global state), so two servers in one
process, or a test's, never share counters. Observations come from the engine thread
(`AsyncEngine`) and the server's handlers; prometheus-client's metrics are thread-safe.
The engine gauges are read when scraped. Source: vLLM's `vllm/v1/metrics/loggers.py`
(PrometheusStatLogger) for the names, buckets and label values.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.stats import EngineStats
from jaxserve.spec_decode.controller import SpecDecodeStats
from jaxserve.worker.compile_events import KINDS

PREFIX = "jaxserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """The engine's own counters, read at scrape time (`stats()`: an EngineStats; its
    attributes are read, so a renamed counter fails here instead of reporting 0)."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        sched = s.scheduler
        spec = s.spec_decode or SpecDecodeStats()
        total = sched.total_pages
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", sched.running),
                ("num_requests_waiting", "Requests waiting to be scheduled.", sched.waiting),
                ("kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).",
                 (total - sched.free_pages) / total if total else 0.0)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        for name, doc, value in (
                ("num_preemptions", "Preemptions (recompute) since start.", sched.num_preemptions),
                ("num_compilations", "Step compilations since start (warm-up included).",
                 s.num_compilations),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 sched.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 sched.prefix_cache_hits),
                ("prefix_cache_evictions", "Cached KV pages evicted for new content.",
                 sched.prefix_cache_evictions),
                ("spec_decode_num_drafts",
                 "Draft proposals verified (per sequence and verify round).",
                 spec.num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 spec.num_accepted_tokens),
                ("structured_output_forced_tokens",
                 "Output tokens a grammar forced, added without sampling them (jump-forward).",
                 s.num_forced_tokens)):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the proposal.",
                                      labels=["position"])
        for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([str(pos)], value)
        yield per_pos
        events = CounterMetricFamily(PREFIX + "jax_compile_events",
                                     "JAX traces, lowerings, compilations and compilation-cache "
                                     "fetches in the process.", labels=["kind"])
        seconds = CounterMetricFamily(PREFIX + "jax_compile_seconds",
                                      "Seconds spent in them.", labels=["kind"])
        for kind in KINDS:
            events.add_metric([kind], s.compile_events.counts[kind])
            seconds.add_metric([kind], s.compile_events.seconds[kind])
        yield events
        yield seconds


class Metrics:
    """The server's metrics over `engine_stats` (a callable returning Engine.stats())."""

    def __init__(self, engine_stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Output tokens generated.",
                                         registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests.",
                                       ["finished_reason"], registry=r)
        self.requests_rejected = Counter(p + "requests_rejected",
                                         "Requests refused before the engine took them.",
                                         ["reason"], registry=r)
        self.requests_failed = Counter(p + "requests_failed",
                                       "Requests taken by the engine that then failed.",
                                       ["reason"], registry=r)
        self.time_to_first_token = Histogram(p + "time_to_first_token_seconds",
                                             "Arrival to first output token (seconds).",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(p + "inter_token_latency_seconds",
                                             "Gap between two outputs carrying tokens (seconds).",
                                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(p + "e2e_request_latency_seconds",
                                             "Arrival to finish (seconds).",
                                             buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(engine_stats))

    def request_added(self, num_prompt_tokens: int) -> None:
        """The engine took a request of `num_prompt_tokens` tokens."""
        self.prompt_tokens.inc(num_prompt_tokens)

    def request_rejected(self, reason: str) -> None:
        """A request was refused at the edge (`reason`: invalid_request, unauthorized,
        not_found, body_too_large, queue_full, shutting_down, not_ready, ...)."""
        self.requests_rejected.labels(reason).inc()

    def request_failed(self, reason: str) -> None:
        """A request the engine took failed (`reason`: engine_error, timeout,
        stream_buffer_full, shutdown)."""
        self.requests_failed.labels(reason).inc()

    def output(self, stream, out, now: float) -> None:
        """Observe one RequestOutput of `stream` (a RequestStream: `arrival`,
        `last_token_time`) delivered at `now` (time.monotonic(), seconds)."""
        if out.new_token_ids:
            self.generation_tokens.inc(len(out.new_token_ids))
            if stream.last_token_time is None:
                self.time_to_first_token.observe(now - stream.arrival)
            else:
                self.inter_token_latency.observe(now - stream.last_token_time)
            stream.last_token_time = now
        if out.finished:
            if out.finish_reason == "error":
                self.request_failed("engine_error")
            else:
                self.request_finished(stream, out.finish_reason, now)

    def request_finished(self, stream, finish_reason: str, now: float) -> None:
        """`stream`'s request finished (`finish_reason`: stop, length, or abort when its
        client went away) at `now` (time.monotonic(), seconds)."""
        self.request_success.labels(finish_reason).inc()
        self.e2e_request_latency.observe(now - stream.arrival)

    def render(self) -> bytes:
        """The registry in the Prometheus text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
