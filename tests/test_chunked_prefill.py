"""Chunked prefill and the mixed step: a prompt split across steps by the token budget
(chunks ending mid-page, decode tokens of other requests in the same step) gives exactly
the outputs of a whole-prompt prefill, greedy and seeded; only its last chunk samples;
nothing compiles after warm-up under a mixed workload.

Tiny random model (XLA kernels) for the engine logic; the real model (SmolLM2-135M, C++
kernels, f32 matmuls) for prompts of 1 to 3 chunks."""

import numpy as np
import pytest

from engine_utils import outputs, tiny_engine, tiny_params
from jaxserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def params():
    return tiny_params()


@pytest.mark.parametrize("keys", [None, 8])
def test_chunked_prefill_equals_whole_prompt_prefill(params, keys):
    """Budget 16 (page size 4): prompts of 5 to 50 tokens arrive while others decode, so
    their chunks are 16 - (decodes) rows, ending mid-page; outputs equal a budget-64
    engine that prefills each prompt whole. With dynamic chunking (keys 8: a row's 8
    earlier tokens cost as much as its matmuls) later chunks beside decodes are cut short
    of the rows left, with the same outputs."""
    rng = np.random.default_rng(3)
    lengths = (5, 23, 50, 31, 12, 44)
    requests = []
    for i, n in enumerate(lengths):
        sp = (SamplingParams(max_tokens=9, temperature=0, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=11, temperature=0.9, top_p=0.95, seed=40 + i,
                             ignore_eos=True))
        requests.append((f"r{i}", rng.integers(0, 256, n).tolist(), sp))
    arrivals = [0, 0, 2, 3, 7, 9]
    whole = tiny_engine(params, max_num_batched_tokens=64, enable_chunked_prefill=False)
    chunked = tiny_engine(params, max_num_batched_tokens=16, dynamic_chunking_keys=keys)
    chunk_rows = []
    step_rows = []  # rows of the steps that cut a prompt
    schedule = chunked.scheduler.schedule

    def recording(*a, **kw):
        plan = schedule(*a, **kw)
        if plan is not None:
            assert plan.num_tokens <= 16
            cut = [n for n, s in zip(plan.num_new, plan.samples) if not s]
            chunk_rows.extend(cut)
            if cut:
                step_rows.append(plan.num_tokens)
        return plan

    chunked.scheduler.schedule = recording
    want = outputs(whole, requests, arrivals)
    got = outputs(chunked, requests, arrivals)
    assert got == want
    assert len(chunk_rows) >= 6, "prompts were split"
    assert any(n % 4 for n in chunk_rows), "a chunk ended mid-page"
    if keys is None:
        assert set(step_rows) == {16}, "a cut prompt takes every row left"
    else:
        assert min(step_rows) < 16, "no chunk was cut by its attention's cost"
    for engine in (whole, chunked):
        assert engine.pool.num_free == engine.pool.capacity
    assert {k.kind for k in chunked.runner._compiled} == {"mixed", "decode", "sample"}


@pytest.mark.full  # fast tier: tests/test_engine_real.py's no compilation after warm-up
def test_no_compilation_after_warmup_under_a_mixed_workload(params):
    engine = tiny_engine(params, max_num_batched_tokens=16, decode_steps=3)
    engine.runner.warmup()
    compiled = engine.num_compilations
    assert compiled == len(engine.runner.shapes.warmup())
    rng = np.random.default_rng(5)
    requests = [(f"r{i}", rng.integers(0, 256, int(n)).tolist(),
                 SamplingParams(max_tokens=int(m), temperature=0.5, seed=i, ignore_eos=True))
                for i, (n, m) in enumerate(zip(rng.integers(1, 60, 10),
                                               rng.integers(1, 30, 10)))]
    outputs(engine, requests, [0, 0, 1, 1, 2, 4, 6, 9, 9, 12])
    assert engine.num_compilations == compiled


@pytest.mark.full  # fast tier: the tiny model's chunks (above) and the real model's prefill
# over cached pages (tests/test_prefix_caching.py: the C++ kernel's path of a later chunk)
def test_real_model_chunked_prefill_gives_the_unchunked_outputs(small_llm, cache_dir):
    """Prompts of 1, 2 and 3 chunks of 120 tokens (7.5 pages: chunks end mid-page), each
    alone, greedy and seeded: the same tokens as the small config's whole-prompt prefill."""
    import dataclasses

    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.engine.builder import build_engine
    from jaxserve.config import load_config

    cfg = load_config(SMALL_CONFIG)
    # no prefix cache: the seeded run of a prompt must compute all its chunks again
    cfg = dataclasses.replace(cfg, engine=cfg.engine.override(max_num_batched_tokens=120,
                                                              enable_prefix_caching=False))
    chunked = LLM(engine=build_engine(cfg, cache_dir, warmup=False))
    tok = small_llm.tokenizer
    words = "river mountain quantum bread violin galaxy ledger orchid tensor harbor".split()
    rng = np.random.default_rng(9)
    for n_tokens in (100, 230, 350):
        ids = tok.encode(" ".join(rng.choice(words, n_tokens)))[:n_tokens]
        for sp in (SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=n_tokens,
                                  ignore_eos=True)):
            steps = chunked.engine.num_steps
            got = chunked.generate([ids], sp)[0]
            want = small_llm.generate([ids], sp)[0]
            assert got.token_ids == want.token_ids, (n_tokens, sp.temperature)
            # its chunks, then one step per token after the first
            assert chunked.engine.num_steps - steps >= -(-n_tokens // 120) + 11
