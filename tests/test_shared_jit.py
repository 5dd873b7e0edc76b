"""Engines of one static configuration share their step programs within a process
(jaxserve.worker.shared_jit): an engine built again compiles nothing and gives the same
outputs; the programs of engines that are gone are freed once KEEP newer jitted functions
have been asked for.

Tiny random model with the byte-level test tokenizer (vocab 258), XLA kernels.
"""

import gc
import weakref

import pytest

from engine_utils import outputs, tiny_engine, tiny_params
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import compile_events, shared_jit

REQUESTS = [("greedy", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=9, logprobs=2)),
            ("seeded", [40, 41, 42], SamplingParams(temperature=0.8, seed=3, max_tokens=7,
                                                     presence_penalty=0.5)),
            ("topk", [70, 71], SamplingParams(temperature=1.0, seed=9, top_k=5, max_tokens=5))]
ARRIVALS = [0, 0, 2]


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def test_an_engine_built_again_compiles_nothing(params):
    first = tiny_engine(params)
    want = outputs(first, REQUESTS, ARRIVALS)
    before = compile_events.snapshot()
    again = tiny_engine(params)
    assert again.runner._jitted is first.runner._jitted
    got = outputs(again, REQUESTS, ARRIVALS)
    made = (compile_events.snapshot() - before).counts
    assert made == dict.fromkeys(compile_events.KINDS, 0), made
    assert got == want
    # another static configuration (max_logprobs: the sampler's top-k width) is its own
    other = tiny_engine(params, max_logprobs=3)
    assert other.runner._jitted is not first.runner._jitted
    before = compile_events.snapshot()
    outputs(other, REQUESTS[:1], [0])
    assert (compile_events.snapshot() - before).counts["lowering"] > 0


def test_programs_of_engines_gone_are_freed_after_keep_newer_ones(params):
    engine = tiny_engine(params, max_logprobs=7)
    outputs(engine, REQUESTS[:1], [0])
    gone = weakref.ref(engine.runner._jitted)
    del engine
    gc.collect()
    assert gone() is not None  # kept for the next engine of this configuration
    live = tiny_engine(params, max_logprobs=8)
    held = weakref.ref(live.runner._jitted)
    for width in range(9, 9 + shared_jit.KEEP // 5 + 1):  # five jitted functions an engine
        tiny_engine(params, max_logprobs=width)
    gc.collect()
    assert gone() is None  # past KEEP newer ones: freed with its programs
    assert held() is live.runner._jitted  # an engine's own stay while it lives
    assert tiny_engine(params, max_logprobs=8).runner._jitted is live.runner._jitted
