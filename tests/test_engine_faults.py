"""Fault containment in the Engine: a request can fail only itself.

- a fault in one request's host work (its detokeniser raising) finishes that request alone
  with finish_reason "error"; the others produce exactly what they produce without it;
- a device step that fails at dispatch or at fetch (its donated KV pool deleted) fails that
  step's requests; the runner makes a fresh pool and every other request is recomputed to
  the same tokens; the pool is whole afterwards and later requests match a fresh engine;
- if no pool can be made again, the engine is dead: healthy False, every request failed,
  step() and add_request raise EngineDeadError;
- edge checks only the engine can make: top_k above the vocabulary; 64-bit seeds.

Tiny random model with the byte-level test tokenizer (vocab 258), XLA kernels.
"""

import jax
import numpy as np
import pytest

from engine_utils import TINY_CFG as CFG, tiny_engine, tiny_params
from jaxserve.config import ConfigError
from jaxserve.engine.engine import EngineDeadError
from jaxserve.sampling_params import InvalidRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, seed=-5, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return tiny_params()


make_engine = tiny_engine


def drain(engine, max_steps=500) -> dict:
    """Step until the engine is idle: {request id: final RequestOutput}."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine made no progress")


def reference(params, requests) -> dict:
    engine = make_engine(params)
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    return {rid: o.token_ids for rid, o in drain(engine).items()}


def assert_whole(engine):
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_free == engine.pool.capacity


REQUESTS = [("a", [5, 6, 7], GREEDY), ("b", [8, 9, 10, 11, 12], SEEDED),
            ("c", [13, 14], GREEDY)]


def test_host_fault_fails_only_its_request(params):
    want = reference(params, REQUESTS)
    engine = make_engine(params)
    for rid, prompt, sp in REQUESTS:
        engine.add_request(rid, prompt, sp)
    engine.step()  # prefill launched

    def broken(_ids):
        raise UnicodeError("injected detokeniser fault")
    engine.scheduler.requests["b"].detokenizer.add = broken
    done = drain(engine)
    assert done["b"].finish_reason == "error" and "injected" in done["b"].error
    assert {r: done[r].token_ids for r in "ac"} == {r: want[r] for r in "ac"}
    assert engine.num_failed_requests == 1 and engine.healthy
    assert_whole(engine)


def _constrained(seed=1):
    from jaxserve.sample.grammar import StructuredOutput
    return SamplingParams(max_tokens=30, temperature=1.0, seed=seed,
                          structured_outputs=StructuredOutput("regex", "[a-c]{20}"))


def test_grammar_fault_fails_only_its_request(params):
    """A structured-output request whose grammar raises while its bitmask is computed
    (after the step's forward is launched, Engine._sample) finishes alone with "error";
    the requests beside it produce what they produce without it."""
    want = reference(params, REQUESTS)
    engine = make_engine(params)
    for rid, prompt, sp in REQUESTS:
        engine.add_request(rid, prompt, sp)
    engine.add_request("g", [5, 6], _constrained())
    for _ in range(3):
        engine.step()

    def broken(_out):
        raise RuntimeError("injected grammar fault")
    engine.scheduler.requests["g"].matcher.fill_bitmask = broken
    done = drain(engine)
    assert done["g"].finish_reason == "error" and "injected grammar fault" in done["g"].error
    assert {r: done[r].token_ids for r in "abc"} == want
    assert engine.num_failed_requests == 1 and engine.healthy
    assert_whole(engine)


def test_failed_sampler_dispatch_fails_its_step_then_recovers(params):
    """The sampler half of a step with a constrained row, dispatched once the previous
    step's tokens are read, fails (its pool gone): the step's requests fail, the engine
    makes a fresh pool, and a later request gets a fresh engine's tokens."""
    want = reference(params, REQUESTS)
    engine = make_engine(params)
    engine.add_request("a", *REQUESTS[0][1:])
    engine.add_request("g", [5, 6], _constrained())
    for _ in range(3):
        engine.step()
    real = engine.runner.dispatch_sample

    def failing(fwd, sampling):
        engine.runner.dispatch_sample = real
        _delete_cache(engine.runner)
        raise RuntimeError("injected sampler failure")
    engine.runner.dispatch_sample = failing
    done = drain(engine)
    assert done["a"].finish_reason == done["g"].finish_reason == "error"
    assert "injected sampler failure" in done["g"].error
    assert engine.num_kv_resets == 1 and engine.healthy
    engine.add_request("c", *REQUESTS[2][1:])
    done.update(drain(engine))
    assert done["c"].token_ids == want["c"]
    assert_whole(engine)


def _delete_cache(runner):
    for leaf in jax.tree.leaves(runner.cache):
        leaf.delete()


def test_failed_dispatch_fails_its_step_then_recovers(params):
    """A step that fails at dispatch (its donated pool gone) fails the requests in it (a's
    decode token and b's prompt share the step); the engine makes a fresh pool and serves
    the next request as if nothing happened."""
    want = reference(params, REQUESTS)
    engine = make_engine(params)
    engine.add_request("a", *REQUESTS[0][1:])
    engine.step()
    engine.step()
    real = engine.runner._executable

    def failing(key):  # the next launch: the pool is donated, then the step raises
        engine.runner._executable = real

        def run(*args):
            _delete_cache(engine.runner)
            raise RuntimeError("injected device failure")
        return run
    engine.runner._executable = failing
    engine.add_request("b", *REQUESTS[1][1:])  # its prefill is in the step that fails
    done = {}
    for out in engine.step():
        done[out.request_id] = out
    assert done["b"].finish_reason == "error" and done["a"].finish_reason == "error"
    assert engine.num_kv_resets == 1 and engine.healthy
    engine.add_request("c", *REQUESTS[2][1:])
    done.update(drain(engine))
    assert done["c"].token_ids == want["c"]
    assert engine.num_failed_requests == 2
    assert_whole(engine)


def test_failed_fetch_fails_its_step_and_recomputes_the_next(params):
    """Step k (decode of a, b) fails when its tokens are read; step k+1, already launched
    over the lost pool (c's prefill), is abandoned and c recomputed to the same tokens."""
    want = reference(params, REQUESTS)
    engine = make_engine(params)
    engine.add_request("a", *REQUESTS[0][1:])
    engine.add_request("b", *REQUESTS[1][1:])
    for _ in range(3):
        engine.step()
    real_fetch = engine.runner.fetch

    def failing(handle, **kw):
        engine.runner.fetch = real_fetch
        _delete_cache(engine.runner)
        raise RuntimeError("injected asynchronous device failure")
    engine.runner.fetch = failing
    engine.add_request("c", *REQUESTS[2][1:])
    done = {o.request_id: o for o in engine.step() if o.finished}
    assert done["a"].finish_reason == done["b"].finish_reason == "error"
    assert engine.num_kv_resets == 1
    done.update(drain(engine))
    assert done["c"].token_ids == want["c"]
    assert engine.scheduler.num_preemptions >= 1
    assert_whole(engine)


def test_engine_dead_when_no_pool_can_be_made(params):
    engine = make_engine(params)
    engine.add_request("a", *REQUESTS[0][1:])
    engine.add_request("b", *REQUESTS[1][1:])
    engine.step()

    def no_memory():
        raise MemoryError("injected: cannot allocate the pool")
    engine.runner.reset_cache = no_memory
    real_fetch = engine.runner.fetch

    def failing(handle, **kw):
        engine.runner.fetch = real_fetch
        raise RuntimeError("injected device failure")
    engine.runner.fetch = failing
    outs = {o.request_id: o for o in engine.step()}
    assert {r: outs[r].finish_reason for r in "ab"} == {"a": "error", "b": "error"}
    assert not engine.healthy and engine.stats().healthy is False
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request("c", [1, 2], GREEDY)


def test_top_k_beyond_the_vocabulary_is_refused(params):
    engine = make_engine(params)
    engine.add_request("ok", [1, 2], SamplingParams(top_k=CFG.vocab_size, max_tokens=2))
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("no", [1, 2], SamplingParams(top_k=CFG.vocab_size + 1))
    assert e.value.field == "top_k" and str(CFG.vocab_size) in str(e.value)
    with pytest.raises(InvalidRequest):
        SamplingParams(top_k=-2)


def test_64_bit_seeds_sample_reproducibly(params):
    """Seeds anywhere in the signed 64-bit range serve; seeds that differ only in their
    high 32 bits draw differently (no truncation collisions); a seed reproduces."""
    seeds = [-5, -2**63, 2**63 - 1, 7, 7 + 2**32]
    sps = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    engine = make_engine(params)
    for i, sp in enumerate(sps):
        engine.add_request(str(i), [3, 4, 5], sp)
    got = {rid: o.token_ids for rid, o in drain(engine).items()}
    assert got["3"] != got["4"], "seed and seed + 2**32 drew the same tokens"
    again = make_engine(params)
    again.add_request("x", [3, 4, 5], sps[0])
    assert drain(again)["x"].token_ids == got["0"]
    for bad in (2**63, -2**63 - 1, 2**64):
        with pytest.raises(InvalidRequest):
            SamplingParams(seed=bad)
    assert np.all([len(t) == 10 for t in got.values()])


def test_xla_compiler_options_reach_xla(params):
    """CompilationConfig.xla_compiler_options are XLA's: one it does not know is refused when
    the engine starts, naming it (so they are passed to XLA); XLA:GPU's command-buffer
    option, meaningless on CPU, compiles and serves the same greedy tokens as none."""
    with pytest.raises(ConfigError, match="xla_compiler_options.*xla_no_such_option"):
        make_engine(params, xla_compiler_options=(("xla_no_such_option", "1"),))
    with pytest.raises(ConfigError, match="xla_compiler_options.*'BOGUS' is not a valid"):
        make_engine(params, xla_compiler_options=(("xla_gpu_enable_command_buffer", "BOGUS"),))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = []
    for opts in ((), (("xla_gpu_enable_command_buffer", ""),)):
        engine = make_engine(params, xla_compiler_options=opts)
        engine.add_request("a", [3, 4, 5], sp)
        got.append(drain(engine)["a"].token_ids)
    assert got[0] == got[1] and len(got[0]) == 8
