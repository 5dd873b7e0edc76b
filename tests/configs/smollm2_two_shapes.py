"""The small test engine (tests/configs/smollm2_small.py: the real model, f32 matmuls,
max_model_len 512, the same 80-page pool) with two step shapes instead of twelve: up to 4
sequences and 128 tokens a step (one mixed shape, one decode shape). For the tests that
run the real model in subprocesses (several processes, the batch CLI, the wheel): each
process traces, compiles and warms up every shape of its engine, ~1 s a shape on two
cores. f32 matmuls keep greedy outputs equal to smollm2_small's in any batch, which the
tests compare them with."""

import dataclasses

from jaxserve.config import CompilationConfig, SchedulerConfig, load_config

_SMALL = load_config(__file__.replace("smollm2_two_shapes.py", "smollm2_small.py"))

CONFIG = dataclasses.replace(
    _SMALL,
    name="smollm2_135m_two_shapes",
    engine=dataclasses.replace(
        _SMALL.engine,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
        compilation=CompilationConfig(seq_buckets=(4,), token_buckets=(128,),
                                      page_buckets=(32,)),
    ),
)
