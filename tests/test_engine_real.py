"""The engine on the real model (SmolLM2-135M, tests/configs/smollm2_small.py: 80-page
pool, max_model_len 512): continuous batching gives each request exactly the tokens it
gets alone, preemption completes everything with the same outputs, no compilation after
warm-up, and the programmatic API's stop handling."""

import numpy as np
import pytest

import engine_utils
from jaxserve import SamplingParams
from jaxserve.worker import compile_events

WORDS = ("river mountain quantum bread violin galaxy ledger orchid tensor harbor lantern "
         "meadow cipher saffron glacier").split()


def make_prompt(tok, rng, n_words):
    return tok.encode(" ".join(rng.choice(WORDS, n_words)))


def run_alone(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.token_ids, out.finish_reason


def run_staggered(engine, requests, arrivals):
    """engine_utils.run_staggered with each output as (token_ids, finish_reason)."""
    done, max_running = engine_utils.run_staggered(engine, requests, arrivals)
    return {rid: (o.token_ids, o.finish_reason) for rid, o in done.items()}, max_running


def assert_pool_empty(engine):
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_free == engine.pool.capacity


def test_continuous_batching_equals_alone(small_llm):
    engine, tok = small_llm.engine, small_llm.tokenizer
    rng = np.random.default_rng(1)
    requests = []
    for i in range(16):
        prompt = make_prompt(tok, rng, int(rng.integers(2, 30)))
        if i % 3 == 0:  # seeded sampling must not depend on the batch either
            params = SamplingParams(max_tokens=int(rng.integers(8, 25)), temperature=0.8,
                                    top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=int(rng.integers(8, 25)), temperature=0,
                                    ignore_eos=True)
        requests.append((f"b{i}", prompt, params))
    arrivals = [0, 0, 0, 1, 1, 2, 3, 5, 5, 6, 8, 9, 12, 13, 15, 18]
    preempted_before = engine.scheduler.num_preemptions

    together, max_running = run_staggered(engine, requests, arrivals)
    assert max_running >= 8, "requests should have shared decode steps"
    assert engine.scheduler.num_preemptions == preempted_before, "this workload fits the pool"
    assert_pool_empty(engine)

    for rid, prompt, params in requests:
        assert len(together[rid][0]) == params.max_tokens and together[rid][1] == "length"
    # every other request alone (each one alone costs a whole generation): 3 seeded and 5
    # greedy, of every arrival group, against what they gave in the batch
    for rid, prompt, params in requests[::2]:
        assert together[rid] == run_alone(engine, rid + "-alone", prompt, params), rid
    assert_pool_empty(engine)


@pytest.mark.full  # fast tier: the real model batched (continuous batching, no compilation after
# warm-up); preemption in tests/test_scheduler.py, and recompute on a device in tests/test_engine_faults.py
def test_preemption_completes_everything_with_same_outputs(small_llm):
    engine, tok = small_llm.engine, small_llm.tokenizer
    rng = np.random.default_rng(2)
    # 6 x (~210 prompt + 24 output tokens) = ~90 pages > the 80-page pool
    requests = [(f"p{i}", make_prompt(tok, rng, 190 + 5 * i),
                 SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for i in range(6)]
    need = sum(engine.pool.pages_for(len(p) + sp.max_tokens) for _, p, sp in requests)
    assert need > engine.pool.capacity, need
    preempted_before = engine.scheduler.num_preemptions

    together, _ = run_staggered(engine, requests, [0] * len(requests))
    assert engine.scheduler.num_preemptions > preempted_before
    assert_pool_empty(engine)
    for rid, prompt, params in requests:
        assert together[rid] == run_alone(engine, rid + "-alone", prompt, params), rid
    assert_pool_empty(engine)


def test_no_compilation_after_warmup(small_llm):
    """Nothing is traced, lowered, compiled or fetched from the compilation cache after
    warm-up (every jax.monitoring compile event of the process, not only the step's
    counter): prompts across every prefill bucket, the sampling controls, logprobs and
    prompt logprobs, an abort, `LLM.generate` twice on the same prompts (the second hits
    the prefix cache: other, shorter prefill shapes)."""
    engine, tok = small_llm.engine, small_llm.tokenizer
    rng = np.random.default_rng(3)
    before = compile_events.snapshot(), engine.num_compilations
    kinds = [SamplingParams(max_tokens=12, temperature=0),
             SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=1),
             SamplingParams(max_tokens=9, temperature=0.7, top_p=0.8, min_p=0.05),
             SamplingParams(max_tokens=30, temperature=0, stop=["the"], ignore_eos=True),
             SamplingParams(max_tokens=15, temperature=0.5, stop_token_ids=[13])]
    requests = []
    for i in range(12):  # prompt lengths across all prefill buckets, up to near max_model_len
        n_words = (1, 10, 40, 120, 300)[3 * i % 5]  # every length at least twice
        requests.append((f"c{i}", make_prompt(tok, rng, n_words)[:480], kinds[i % len(kinds)]))
    arrivals = sorted(int(a) for a in rng.integers(0, 16, len(requests)))
    engine.add_request("to-abort", make_prompt(tok, rng, 20), SamplingParams(max_tokens=100))
    engine.step()
    engine.abort_request("to-abort")
    assert [o.finish_reason for o in engine.step() if o.request_id == "to-abort"] == ["abort"]
    done, max_running = run_staggered(engine, requests, arrivals)
    assert len(done) == len(requests) and max_running > 4
    prompts = [make_prompt(tok, rng, n) for n in (5, 60, 200)]
    controls = [SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2),
                SamplingParams(max_tokens=6, temperature=0.9, seed=4, presence_penalty=0.5,
                               frequency_penalty=0.3, repetition_penalty=1.2,
                               logit_bias={13: 2.0}, min_tokens=3),
                SamplingParams(max_tokens=6, temperature=0)]
    for _ in range(2):
        outs = small_llm.generate(prompts, controls)
        assert all(o.token_ids for o in outs) and outs[0].logprobs
    events = compile_events.snapshot() - before[0]
    assert events.total == 0, events
    assert engine.num_compilations == before[1]
    assert_pool_empty(engine)


def test_generate_stop_strings_and_eos(small_llm):
    tok = small_llm.tokenizer
    chat = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    [free] = small_llm.generate([chat], SamplingParams(max_tokens=64, temperature=0))
    assert free.finish_reason == "stop", "the instruct model ends its answer with EOS"
    assert free.token_ids[-1] in small_llm.engine.eos_token_ids
    assert "Paris" in free.text and "<|im_end|>" not in free.text
    assert free.text == tok.decode(free.token_ids[:-1])

    stop = "Paris"
    [cut] = small_llm.generate([chat], SamplingParams(max_tokens=64, temperature=0, stop=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[:free.text.index(stop)], "stop string never leaks into the output"
    [kept] = small_llm.generate([chat], SamplingParams(max_tokens=64, temperature=0, stop=[stop],
                                                       include_stop_str_in_output=True))
    assert kept.text.endswith(stop) and kept.text == free.text[:free.text.index(stop) + len(stop)]

    [short] = small_llm.generate(["The quick brown fox"], SamplingParams(max_tokens=5, temperature=0))
    assert short.finish_reason == "length" and len(short.token_ids) == 5
    assert short.num_prompt_tokens == len(tok.encode("The quick brown fox"))


def test_same_seed_same_output_in_any_batch(small_llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234)
    [alone] = small_llm.generate(["Once upon a time"], params)
    outs = small_llm.generate(["Once upon a time", "Hello", "Write a poem about the sea"] * 3,
                              [params, SamplingParams(max_tokens=30, temperature=1.0),
                               SamplingParams(max_tokens=10, temperature=0)] * 3)
    for o in outs[::3]:
        assert o.token_ids == alone.token_ids
    other = small_llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, temperature=1.0,
                                                                    seed=4321))[0]
    assert other.token_ids != alone.token_ids


@pytest.mark.full  # fast tier: the tiny model's multi-step decode; the default config's (decode_steps > 1) greedy vs HF
def test_multi_step_decode_gives_the_single_step_outputs(small_llm, cache_dir):
    """decode_steps=4 on the real model: the same tokens, text and finish reasons as the
    single-step engine for greedy and seeded-sampling requests, an EOS-terminated chat
    answer and a stop string, with multi-step steps really run (shapes compiled on
    demand)."""
    import dataclasses

    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.engine.builder import build_engine
    from jaxserve.config import load_config

    config = load_config(SMALL_CONFIG)
    config = dataclasses.replace(config, engine=config.engine.override(decode_steps=4))
    multi = LLM(engine=build_engine(config, cache_dir, warmup=False))
    tok = small_llm.tokenizer
    chat = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    prompts = [chat, "The quick brown fox", "Once upon a time", chat]
    params = [SamplingParams(max_tokens=64, temperature=0),
              SamplingParams(max_tokens=23, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=0.9, top_k=40, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=64, temperature=0, stop=["Paris"])]
    want = small_llm.generate(prompts, params)
    got = multi.generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == \
        [(o.token_ids, o.text, o.finish_reason) for o in want]
    assert want[0].finish_reason == "stop" and "Paris" in want[0].text
    assert want[3].finish_reason == "stop" and "Paris" not in want[3].text
    assert any(k.n == 4 for k in multi.engine.runner._compiled), "multi-step steps ran"
    assert_pool_empty(multi.engine)


@pytest.mark.full  # fast tier: the tiny model's (tests/test_sampler_plan.py)
def test_host_branches_give_the_device_branches_outputs(small_llm, cache_dir):
    """KernelConfig.branches "host" and CompilationConfig.fused_decode (GPUs' defaults:
    the sampler's branches decided on the host, one program per plan, jaxserve.sample.plan;
    a plain one-token decode step in one program) on the real model, with multi-step
    decode: the same tokens, logprobs, prompt logprobs and finish reasons as the
    device-branch, split-step engine for greedy, seeded sampling with top-k / top-p,
    penalties with logit bias and top logprobs, in one batch; nothing compiles after its
    warm-up; its steps took static plans (the batch with the penalties' request one token
    a step, split: Scheduler.plain_bursts; then the others in multi-step bursts, and
    their last tokens in whole one-token steps)."""
    import dataclasses

    from conftest import ROOT
    from jaxserve.api import LLM
    from jaxserve.engine.builder import build_engine
    from jaxserve.config import load_config
    from jaxserve.sample.plan import ON_DEVICE

    config = load_config(ROOT / "tests" / "configs" / "smollm2_two_shapes.py")
    config = dataclasses.replace(config, engine=config.engine.override(
        branches="host", decode_steps=4, fused_decode=True))
    host = LLM(engine=build_engine(config, cache_dir))
    runner = host.engine.runner
    assert runner.kernels.host_branches
    tok = small_llm.tokenizer
    chat = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]), add_special_tokens=False)
    prompts = [chat, "The quick brown fox", "Once upon a time", "A recipe for bread:"]
    params = [SamplingParams(max_tokens=40, temperature=0, prompt_logprobs=2),
              SamplingParams(max_tokens=35, temperature=0.9, top_k=40, top_p=0.9, seed=7,
                             ignore_eos=True),
              SamplingParams(max_tokens=18, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=21, temperature=0.7, seed=5, presence_penalty=0.6,
                             repetition_penalty=1.2, logit_bias={13: 1.0}, logprobs=3,
                             ignore_eos=True)]
    want = small_llm.generate(prompts, params)
    plans, whole = [], []  # the keys planned; the whole steps run
    planned, call = runner._planned, runner._call
    runner._planned = lambda key, sb: plans.append(planned(key, sb)) or plans[-1]
    runner._call = lambda exe, key, *a, **k: whole.append(key) or call(exe, key, *a, **k)
    before = compile_events.snapshot()
    try:
        got = host.generate(prompts, params)
    finally:
        del runner._planned, runner._call
    assert (compile_events.snapshot() - before).total == 0
    assert [(o.token_ids, o.finish_reason) for o in got] == \
        [(o.token_ids, o.finish_reason) for o in want]
    pairs = list(zip(got[3].logprobs, want[3].logprobs))
    # the prompt logprobs: a program of their own after the prefill's forward
    assert got[0].prompt_logprobs[0] is None and want[0].prompt_logprobs[0] is None
    pairs += list(zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]))
    assert len(pairs) == len(want[3].logprobs) + len(chat) - 1
    for g, w in pairs:
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        np.testing.assert_allclose([g.logprob] + [lp for _, lp in g.top],
                                   [w.logprob] + [lp for _, lp in w.top], atol=1e-5)
    samplers = [k.plan for k in plans if k.kind == "sample"]
    assert samplers and ON_DEVICE not in samplers and "filtered" in {p.mode for p in samplers}
    assert any(p.controls and p.top_logprobs for p in samplers)
    fused = {k.plan for k in whole}
    assert fused and all(p.static and not p.controls for p in fused), fused
    assert {k.n for k in whole} == {1, 4}, "multi-step and whole one-token steps ran"
    assert_pool_empty(host.engine)


def test_host_loop_overlaps_device_steps(small_llm):
    """Step n+1 is launched before step n's tokens are read (the device never waits for
    the host between decode steps), outputs are unchanged, and the counters the
    benchmark reports (KV utilisation, host time) are consistent."""
    engine, tok = small_llm.engine, small_llm.tokenizer
    runner = engine.runner
    events = []
    dispatch, fetch = runner.dispatch, runner.fetch

    def traced_dispatch(batch, sampling, num_steps=1, prev_index=None):
        handle = dispatch(batch, sampling, num_steps, prev_index)
        events.append(("dispatch", handle))  # kept alive: ids stay unique
        return handle

    def traced_fetch(handle, **kw):
        events.append(("fetch", handle))
        return fetch(handle, **kw)

    rng = np.random.default_rng(4)
    requests = [(f"o{i}", make_prompt(tok, rng, 5 + 7 * i),
                 SamplingParams(max_tokens=10 + i, temperature=0, ignore_eos=True)) for i in range(4)]
    alone = {rid: run_alone(engine, rid + "-alone", p, sp) for rid, p, sp in requests}
    before = engine.stats()
    runner.dispatch, runner.fetch = traced_dispatch, traced_fetch
    try:
        together, _ = run_staggered(engine, requests, [0, 0, 2, 3])
    finally:
        del runner.dispatch, runner.fetch
    assert together == alone
    assert_pool_empty(engine)
    order = [(kind, id(h)) for kind, h in events]
    launched = [h for kind, h in order if kind == "dispatch"]
    fetched = [h for kind, h in order if kind == "fetch"]
    assert fetched == launched, "every step is read once, in launch order"
    for n in range(len(launched) - 1):  # step n+1 launched before step n is read
        assert order.index(("dispatch", launched[n + 1])) < order.index(("fetch", launched[n]))
    after = engine.stats()
    live = after.kv_live_token_steps - before.kv_live_token_steps
    allocated = after.kv_allocated_token_steps - before.kv_allocated_token_steps
    assert 0.5 < live / allocated <= 1.0
    host = after.host_seconds - before.host_seconds
    total = after.step_seconds - before.step_seconds
    assert 0 < host < total


@pytest.mark.full  # fast tier: the servers warm up in the background
def test_background_warmup_serves_at_once_and_compiles_each_shape_once(smollm2_checkpoint,
                                                                       cache_dir):
    """build_engine(warmup="background") returns after the first three programs (the
    shortest decode, its sampler, the shortest prefill); requests run
    meanwhile (their shapes compile on demand or are waited for), and once the background
    warm-up is over every bucketed shape was compiled exactly once."""
    import time

    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.engine.builder import build_engine
    from jaxserve.config import load_config

    engine = build_engine(load_config(SMALL_CONFIG), cache_dir, warmup="background")
    from jaxserve.worker.compilation import StepKey
    all_shapes = {StepKey(*shape) for shape in engine.runner.shapes.warmup()}
    assert engine.stats().warmup_pending == len(all_shapes) - 3 > 0
    llm = LLM(engine=engine)
    rng = np.random.default_rng(6)
    outs = llm.generate([make_prompt(llm.tokenizer, rng, n) for n in (3, 40, 150)],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    deadline = time.monotonic() + 300
    while engine.stats().warmup_pending and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.stats().warmup_pending == 0
    assert set(engine.runner._compiled) == all_shapes
    assert engine.num_compilations == len(all_shapes), "no shape compiled twice"


def test_background_warmup_stops_on_request(smollm2_checkpoint, cache_dir):
    """stop_warmup() ends the background thread after its current shape (serve.py calls it
    at shutdown: a thread still compiling when the interpreter exits aborts the process)."""
    from conftest import SMALL_CONFIG
    from jaxserve.engine.builder import build_engine
    from jaxserve.config import load_config

    engine = build_engine(load_config(SMALL_CONFIG), cache_dir, warmup="background")
    engine.runner.stop_warmup()
    assert not engine.runner._warmup_thread.is_alive()
    assert engine.stats().warmup_pending > 0, "stopped before the end"
