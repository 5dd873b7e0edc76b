"""Prefix caching through the engine: a request whose prompt starts with pages another
request computed skips them (the counters say how many tokens) and gives exactly the
outputs it gets without the cache, greedy and seeded; the pool is whole afterwards; a
failed device step forgets the cache. Tiny random model for the engine logic, the real
model (SmolLM2-135M, f32 matmuls) for the outputs."""

import numpy as np
import pytest

from engine_utils import TINY_PAGE, outputs, tiny_engine, tiny_params
from jaxserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def shared_prefix_requests(seed=0, n=6):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 21).tolist()  # 5 full pages of 4 and one token
    requests = []
    for i in range(n):
        sp = (SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=8, temperature=0.9, seed=i, ignore_eos=True))
        requests.append((f"r{i}", system + rng.integers(0, 256, 2 + i).tolist(), sp))
    return system, requests


def test_hits_skip_the_shared_pages_and_change_no_output(params):
    system, requests = shared_prefix_requests()
    arrivals = [0, 4, 5, 9, 9, 14]
    want = outputs(tiny_engine(params, enable_prefix_caching=False), requests, arrivals)
    engine = tiny_engine(params)
    got = outputs(engine, requests, arrivals)
    assert got == want
    stats = engine.stats()
    shared = len(system) // TINY_PAGE * TINY_PAGE
    # every request after the first finds the shared pages (r1 arrives after r0's prefill)
    assert stats.scheduler.prefix_cache_hits >= shared * (len(requests) - 1)
    assert stats.scheduler.prefix_cache_queries == sum(len(p) for _, p, _ in requests)
    assert stats.scheduler.free_pages == stats.scheduler.total_pages and stats.scheduler.cached_pages > 0


def test_a_failed_step_forgets_the_cache(params):
    system, requests = shared_prefix_requests(seed=1, n=2)
    engine = tiny_engine(params)
    outputs(engine, requests[:1], [0])
    assert engine.stats().scheduler.cached_pages > 0
    engine.runner.reset_cache()  # what a failed step leads to (Engine._reset_kv)
    engine._reset_kv()
    assert engine.stats().scheduler.cached_pages == 0
    want = outputs(tiny_engine(params, enable_prefix_caching=False), requests[1:], [0])
    hits = engine.stats().scheduler.prefix_cache_hits
    assert outputs(engine, requests[1:], [0]) == want
    assert engine.stats().scheduler.prefix_cache_hits == hits, "nothing left to hit"


def test_real_model_prefix_hit_gives_the_miss_outputs(small_llm, cache_dir):
    """A ~300-token shared system prompt: questions asked after another request cached it
    (hits) get the tokens an engine without the cache gives them (greedy and seeded)."""
    import dataclasses

    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.engine.builder import build_engine
    from jaxserve.config import load_config

    cfg = load_config(SMALL_CONFIG)
    cfg = dataclasses.replace(cfg, engine=cfg.engine.override(enable_prefix_caching=False))
    uncached = LLM(engine=build_engine(cfg, cache_dir, warmup=False))
    tok = small_llm.tokenizer
    system = tok.encode("You are a careful assistant. " * 50)
    questions = [tok.encode(q, add_special_tokens=False) for q in
                 (" What is a river?", " Name a planet.", " Why is the sky blue?")]
    sps = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
           SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=3, ignore_eos=True),
           SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    engine = small_llm.engine
    small_llm.generate([system + questions[0]], sps[0])  # caches the system prompt's pages
    before = engine.stats()
    got = small_llm.generate([system + q for q in questions], sps)
    after = engine.stats()
    want = uncached.generate([system + q for q in questions], sps)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    page = engine.engine_config.cache.page_size
    assert after.scheduler.prefix_cache_hits - before.scheduler.prefix_cache_hits >= 3 * (len(system) // page * page)
    assert after.scheduler.free_pages == after.scheduler.total_pages


def test_real_model_n_choices_fork_from_one_prefill(small_llm):
    """n = 4 with a seed through the server: 4 choices whose tokens are those of 4 single
    requests with seeds s .. s+3 (vLLM's seed + i), and the 3 later choices take the
    prompt's full pages from the first one's prefill instead of computing them."""
    from starlette.testclient import TestClient

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.api_server import build_app

    engine = small_llm.engine
    bridge = AsyncEngine(engine)
    app = build_app(bridge, small_llm.tokenizer, "smollm2", engine.engine_config.max_model_len)
    prompt = "A lantern, a harbor and a glacier met one evening. " * 8
    n_prompt = len(small_llm.tokenizer.encode(prompt))
    body = {"prompt": prompt, "temperature": 0.9, "max_tokens": 12, "ignore_eos": True}
    try:
        with TestClient(app) as client:
            before = engine.stats().scheduler.prefix_cache_hits
            forked = client.post("/v1/completions", json={**body, "n": 4, "seed": 11}).json()
            hits = engine.stats().scheduler.prefix_cache_hits - before
            singles = [client.post("/v1/completions", json={**body, "seed": 11 + i}).json()
                       for i in range(4)]
    finally:
        bridge.shutdown()
    texts = [c["text"] for c in forked["choices"]]
    assert [c["index"] for c in forked["choices"]] == [0, 1, 2, 3]
    assert texts == [s["choices"][0]["text"] for s in singles]
    assert len(set(texts)) > 1, "seeds s .. s+3 sample different texts"
    page = engine.engine_config.cache.page_size
    assert hits >= 3 * ((n_prompt - 1) // page * page)
    assert forked["usage"]["prompt_tokens"] == n_prompt
