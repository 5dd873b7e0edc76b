"""Sampler branches decided on the host (jaxserve.sample.plan, KernelConfig.branches "host"):

- `plan_of` decides each branch as the device would, so a program compiled for the batch's
  plan samples exactly what the on-device branches sample: the sampler program (tokens,
  logprobs, top logprobs; logits controls present and neutral, or active) and the
  rejection sampler, each against ON_DEVICE on the same inputs; a plan that decides a
  branch the other way does change the tokens (the comparison can fail);
- an engine with host branches returns what one with device branches returns for a mix
  of requests (greedy, seeded sampling with and without filters, penalties and logit
  bias, logprobs, prompt logprobs, structured output; multi-step decode, verify steps),
  compiles nothing after warm-up, and runs each step with its batch's plan.
Tiny random models; the real model's check is in tests/test_engine_real.py.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import run_staggered, tiny_engine, tiny_params
from jaxserve.model.transformer import Kernels
from jaxserve.sample.grammar import StructuredOutput
from jaxserve.sample.logits_processors import LogitsControls
from jaxserve.sample.plan import (FUSED_PLANS, ON_DEVICE, SamplerPlan, plan_of,
                                  sampler_plans)
from jaxserve.sample.rejection_sampler import rejection_sample
from jaxserve.sample.sampler import SamplingBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.step import sample_step

V, S, PAGE, PAGES, TOP = 300, 4, 4, 3, 5
GREEDY = SamplingParams(temperature=0)
GREEDY_TOP_K = SamplingParams(temperature=0, top_k=3)   # its filter is never read
RANDOM = SamplingParams(temperature=0.8)
TOP_P = SamplingParams(temperature=0.9, top_p=0.7)
MIN_P = SamplingParams(temperature=1.1, min_p=0.2)
LOGPROBS = SamplingParams(temperature=0, logprobs=3)


def _batch(params, controls=None):
    sb = SamplingBatch.from_params(params, [11 * i + 1 for i in range(len(params))],
                                   [2 * i for i in range(len(params))], S)
    return dataclasses.replace(sb, controls=controls)


def _controls(**rows):
    """S rows of controls; rows: field -> {row: value}."""
    c = LogitsControls.neutral(S, 2, V)
    for name, values in rows.items():
        for i, v in values.items():
            getattr(c, name)[i] = v
    return c


CASES = {  # name: (params, controls, the plan the host decides)
    "greedy": ([GREEDY, GREEDY_TOP_K], None, SamplerPlan("greedy", False, False)),
    "random": ([GREEDY_TOP_K, RANDOM], None, SamplerPlan("random", False, False)),
    "top_p": ([GREEDY, TOP_P, RANDOM], None, SamplerPlan("filtered", False, False)),
    "min_p": ([MIN_P], None, SamplerPlan("filtered", False, False)),
    "neutral_controls": ([RANDOM, GREEDY], _controls(), SamplerPlan("random", False, False)),
    "penalty": ([RANDOM, GREEDY], _controls(repetition_penalty={1: 1.3}, prompt_len={1: 2}),
                SamplerPlan("random", True, False)),
    "bias": ([GREEDY, TOP_P], _controls(bias_ids={0: [7, -1]}, bias_values={0: [9.0, 0]},
                                        bias_until={0: [2**31 - 1, 0]}),
             SamplerPlan("filtered", True, False)),
    "bitmask": ([GREEDY], _controls(allowed={0: np.r_[[0x0F0F0F0F], np.full(9, -1)]}),
                SamplerPlan("greedy", True, False)),
    "logprobs": ([LOGPROBS, RANDOM], None, SamplerPlan("random", False, True)),
}


@pytest.mark.parametrize("name", CASES)
def test_plan_of_decides_each_branch_as_the_device(name):
    params, controls, expected = CASES[name]
    sb = _batch(params, controls)
    assert plan_of(sb, TOP) == expected
    assert plan_of(sb, 0).top_logprobs is False  # no top logprobs reported: never computed
    assert expected in sampler_plans(TOP) and expected.static


@functools.lru_cache(maxsize=None)
def _sampler(plan):
    return jax.jit(functools.partial(sample_step, page_size=PAGE, max_rows=8, rules=None,
                                     kernels=Kernels(), num_top=TOP, plan=plan))


def _run_sampler(sb, plan):
    logits = jax.random.normal(jax.random.key(3), (S, V)) * 4
    # each row's history: tokens 0..11 at its 3 pages (the penalties read them)
    pool = jnp.arange(S * PAGES * PAGE, dtype=jnp.int32) % 40
    tables = jnp.arange(S * PAGES, dtype=jnp.int32).reshape(S, PAGES)
    if sb.controls is None:
        sb = dataclasses.replace(sb, controls=LogitsControls.neutral(S, 2, V))
    _, tokens, logprobs, extra, _ = _sampler(plan)(logits, sb, pool, tables,
                                                  jnp.full((S,), 10, jnp.int32))
    return jax.tree.map(np.asarray, (tokens, logprobs, extra))


@pytest.mark.parametrize("name", CASES)
def test_sampler_program_of_the_batch_plan_samples_as_on_device(name):
    params, controls, _ = CASES[name]
    sb = _batch(params, controls)
    on_host = _run_sampler(sb, plan_of(sb, TOP))
    on_device = _run_sampler(sb, ON_DEVICE)
    jax.tree.map(np.testing.assert_array_equal, on_host, on_device)


def test_a_plan_deciding_a_branch_the_other_way_changes_the_tokens():
    """The comparison above can fail: skipping the filter, the controls or the noise the
    batch needs samples other tokens (or reports no top logprobs)."""
    sb = _batch([TOP_P, MIN_P, RANDOM, RANDOM])
    right = _run_sampler(sb, plan_of(sb, TOP))
    assert not np.array_equal(right[0], _run_sampler(sb, SamplerPlan("greedy", False, False))[0])
    assert not np.array_equal(right[0], _run_sampler(sb, SamplerPlan("random", False, False))[0])
    sb = _batch([GREEDY], _controls(bias_ids={0: [7, -1]}, bias_values={0: [50.0, 0]},
                                    bias_until={0: [2**31 - 1, 0]}))
    assert _run_sampler(sb, plan_of(sb, TOP))[0][0, 0] == 7
    assert _run_sampler(sb, SamplerPlan("greedy", False, False))[0][0, 0] != 7
    sb = _batch([LOGPROBS])
    assert _run_sampler(sb, plan_of(sb, TOP))[2]["top_logprobs"].any()
    assert not _run_sampler(sb, SamplerPlan("greedy", False, False))[2]["top_logprobs"].any()


@pytest.mark.parametrize("name", ["greedy", "random", "top_p", "min_p"])
@pytest.mark.parametrize("draft", ["logits", "ngram"])
def test_rejection_sampler_with_the_batch_plan_verifies_as_on_device(name, draft):
    params, _, _ = CASES[name]
    sb = _batch(params)
    K = 3
    keys = jax.random.split(jax.random.key(5), 3)
    logits = jax.random.normal(keys[0], (S, K + 1, V)) * 3
    draft_logits = (logits[:, :K] + jax.random.normal(keys[1], (S, K, V))
                    if draft == "logits" else None)
    # drafts: the target's argmax at some positions (accepted by greedy rows), noise elsewhere
    draft_ids = jnp.where(jax.random.bernoulli(keys[2], 0.7, (S, K)),
                          jnp.argmax(logits[:, :K], -1), 5).astype(jnp.int32)
    num_drafts = jnp.array([3, 2, 3, 0], jnp.int32)
    run = jax.jit(rejection_sample, static_argnames=("plan",))
    on_host = run(logits, draft_ids, num_drafts, sb, draft_logits, plan=plan_of(sb, TOP))
    on_device = run(logits, draft_ids, num_drafts, sb, draft_logits, plan=ON_DEVICE)
    jax.tree.map(np.testing.assert_array_equal, on_host, on_device)


@pytest.fixture(scope="module")
def params():
    return tiny_params()


REQUESTS = [  # (prompt, params): every sampler plan a decode batch of them takes
    (list(range(5, 25)), SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)),
    (list(range(30, 41)), SamplingParams(max_tokens=11, temperature=0.8, seed=3,
                                         ignore_eos=True)),
    (list(range(60, 90)), SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=4,
                                         ignore_eos=True)),
    (list(range(7, 19)), SamplingParams(max_tokens=10, temperature=0, logprobs=2,
                                        ignore_eos=True)),
    (list(range(100, 112)), SamplingParams(max_tokens=12, temperature=0.7, seed=9,
                                           presence_penalty=0.8, logit_bias={65: 1.5},
                                           ignore_eos=True)),
    (list(range(40, 52)), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                         prompt_logprobs=2)),
    # structured output: its bitmask is written into the controls after the forward is
    # launched, before the sampler's plan is read
    ([5, 6, 7], SamplingParams(max_tokens=20, temperature=0,
                               structured_outputs=StructuredOutput("regex", "[a-c]{20}"))),
]


def _outputs(engine, arrivals):
    reqs = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(REQUESTS)]
    done, _ = run_staggered(engine, reqs, arrivals)
    return {rid: (o.token_ids, o.text, o.logprobs, o.prompt_logprobs)
            for rid, o in done.items()}


ENGINES = {  # tiny_engine arguments
    "decode_steps 1": {"decode_steps": 1},
    "decode_steps 4": {"decode_steps": 4},
    # verify steps: the draft (the target itself) proposes with the plan's sampling mode
    # (full tier: ~50 s, most of it warming up its verify programs for 4 plans each)
    "draft model": {"speculative_config": {"method": "draft_model", "model": "tiny-draft",
                                           "num_speculative_tokens": 3}},
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full)
                                  if name == "draft model" else name for name in ENGINES])
def test_engine_with_host_branches_returns_the_device_branches_outputs(params, name):
    """Same outputs (tokens, logprobs) with host and device branches, requests arriving
    over time so that batches take every plan; after the host-branch engine's warm-up
    nothing compiles, and its steps ran with static plans (ON_DEVICE only where a verify
    step's batch had controls or top logprobs; such a batch decodes a token a step:
    Scheduler.plain_bursts)."""
    kw = dict(ENGINES[name])
    if "speculative_config" in kw:
        kw["draft_params"] = params
    device = tiny_engine(params, **kw)
    host = tiny_engine(params, kernels=Kernels("xla", "xla", "xla", host_branches=True), **kw)
    host.runner.warmup()
    compiled = host.num_compilations
    assert {k.plan for k in host.runner._compiled if k.kind == "sample"} == set(
        sampler_plans(host.runner.num_top))
    plans = []
    dispatch = host.runner._planned
    host.runner._planned = lambda key, sb: plans.append(dispatch(key, sb)) or plans[-1]
    arrivals = [0, 0, 1, 3, 6, 8, 10]
    try:
        got = _outputs(host, arrivals)
    finally:
        del host.runner._planned
    assert got == _outputs(device, arrivals)
    assert re.fullmatch("[a-c]{20}", got["r6"][1]), got["r6"][1]  # the grammar held
    assert host.num_compilations == compiled, "nothing compiled after warm-up"
    assert {k.kind for k in host.runner._compiled} >= {"prompt_logprobs", "sample", "mixed"}
    assert {k.plan.mode for k in plans} >= {"greedy", "random", "filtered"}
    if "speculative_config" not in kw:  # (with drafts, decode batches verify instead)
        assert any(k.plan.controls and k.plan.top_logprobs for k in plans
                   if k.kind == "sample")
    fused = [k for k in plans if k.kind in ("decode", "verify")]
    assert bool(fused) == (name != "decode_steps 1")
    assert all(k.plan in FUSED_PLANS + ((ON_DEVICE,) if k.kind == "verify" else ())
               for k in fused)
    if fused:
        assert any(k.plan.static for k in fused)


@pytest.mark.parametrize("host_branches", [False, True], ids=["device branches",
                                                            "host branches"])
def test_fused_decode_steps_return_the_split_steps_outputs(params, host_branches):
    """CompilationConfig.fused_decode: a one-token decode step without a grammar row runs
    as one program (forward and sampler, StepKey.whole) and returns what the split steps
    (forward, then sampler) return for the same requests arriving over time; warm-up
    compiles every whole program it runs (nothing after it). With the device deciding
    branches every such step is whole; with host branches only those whose batch plan is
    plain (FUSED_PLANS), the rest split; a step with a grammar row is always split."""
    kernels = Kernels("xla", "xla", "xla", host_branches=host_branches)
    split = tiny_engine(params, kernels=kernels, decode_steps=1, fused_decode=False)
    fused = tiny_engine(params, kernels=kernels, decode_steps=1, fused_decode=True)
    fused.runner.warmup()
    compiled = fused.num_compilations
    whole = {k for k in fused.runner._compiled if k.whole}
    assert whole and {(k.kind, k.n) for k in whole} == {("decode", 1)}
    assert not any(k.whole for k in split.runner._warmup_keys(None))
    runner = fused.runner
    ran = []  # the key of each whole program and split forward the steps ran
    call, forward = runner._call, runner._run_forward
    runner._call = lambda exe, key, *a, **k: ran.append(key) or call(exe, key, *a, **k)
    runner._run_forward = lambda exe, key, *a, **k: ran.append(key) or forward(exe, key, *a,
                                                                               **k)
    arrivals = [0, 0, 1, 3, 6, 8, 10]
    try:
        got = _outputs(fused, arrivals)
    finally:
        del runner._call, runner._run_forward
    assert got == _outputs(split, arrivals)
    assert re.fullmatch("[a-c]{20}", got["r6"][1]), got["r6"][1]  # the grammar held
    assert fused.num_compilations == compiled, "nothing compiled after warm-up"
    decode = [k for k in ran if k.kind == "decode"]
    assert any(k.whole for k in decode) and any(not k.whole for k in decode)
    if host_branches:
        assert all(k.plan in FUSED_PLANS for k in decode if k.whole)
    else:
        assert all(k.plan == ON_DEVICE for k in decode)


def test_prompt_logprobs_survive_a_preemption_with_host_branches(params):
    """A request asking for prompt logprobs, preempted after its prefill, computes its
    prompt again; with host branches that step runs no prompt-logprobs program (no row
    needs any), and the request keeps the ones it has: they equal those of an engine
    with room for everything. (Reading the step's missing arrays failed the request.)"""
    host = Kernels("xla", "xla", "xla", host_branches=True)
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    asks = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2,
                          logprobs=1)  # the step reads logprobs: its prompt ones too
    reqs = [(f"r{i}", [65 + i] * 12, long) for i in range(3)] + [("asks", [70] * 12, asks)]

    def run(num_pages):
        engine = tiny_engine(params, kernels=host, num_pages=num_pages)
        done, _ = run_staggered(engine, reqs, [0, 0, 0, 1])
        return engine, done

    small, got = run(20)
    _, want = run(65)
    assert small.scheduler.num_preemptions > 0
    assert got["asks"].finish_reason == "length", got["asks"]
    assert got["asks"].token_ids == want["asks"].token_ids
    # the same up to f32 rounding: the preempted request's steps batch other rows
    for g, w in [(got["asks"].prompt_logprobs[1:], want["asks"].prompt_logprobs[1:]),
                 (got["asks"].logprobs, want["asks"].logprobs)]:
        assert len(g) == len(w) and all(
            (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
            and abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g, w))
    assert got["asks"].prompt_logprobs[0] is None
