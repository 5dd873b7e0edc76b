"""Pipeline parallelism's parts that run without a mesh: the microbatch split of a step,
the zero layers that pad a short last stage, the staged KV pool's shapes, the config's
checks and the memory plan of stages. The pipelined forward and engine on simulated
devices are in tests/test_tensor_parallel.py (tp_check / tp_engine_check meshes "TPxPP")
and tests/test_distributed.py (2 processes, TP 2 x PP 2)."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import (ConfigError, EngineConfig, ModelConfig, ParallelConfig,
                             SpeculativeConfig, check_deployment, load_config)
from jaxserve.model.kv_cache import abstract_kv_cache
from jaxserve.worker.memory_plan import plan_memory
from jaxserve.model.params import init_params
from jaxserve.model.pipeline import microbatches_for, split_microbatches
from jaxserve.model.inputs import StepBatch
from jaxserve.model.transformer import (Kernels, _decoder_layers)
from jaxserve.distributed.sharding import ShardingRules, make_abstract_mesh

ROOT = Path(__file__).resolve().parent.parent


def ragged_batch(q_lens, cached, T, P=4, page_size=4):
    """A prefill / mixed StepBatch: sequence b brings q_lens[b] rows after cached[b] tokens
    already in the pool; rows past sum(q_lens) are padding."""
    S = len(q_lens)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.zeros(T, np.int32)
    for b in range(S):
        pos[qs[b]:qs[b + 1]] = np.arange(cached[b], cached[b] + q_lens[b])
    tables = np.arange(1, 1 + S * P, dtype=np.int32).reshape(S, P)
    return StepBatch(tokens=np.arange(T, dtype=np.int32), positions=pos,
                     slot_mapping=np.arange(T, dtype=np.int32), block_tables=tables,
                     seq_lens=(np.asarray(cached) + np.asarray(q_lens)).astype(np.int32),
                     query_start=qs, logits_indices=(qs[1:] - 1).astype(np.int32))


def test_ragged_split_cuts_a_prompt_between_microbatches():
    """Rows 0-11 in 3 microbatches of 4: sequence 0 (rows 0-4, 4 tokens cached) spans
    microbatches 0 and 1, sequence 2 (rows 7-9) spans 1 and 2. A sequence's seq_len in a
    microbatch is its context after that microbatch's rows; one with no rows there is
    padding (0)."""
    mb = jax.tree.map(np.asarray, split_microbatches(ragged_batch([5, 2, 3], [4, 0, 4], 12), 3))
    np.testing.assert_array_equal(mb.query_start, [[0, 4, 4, 4], [0, 1, 3, 4], [0, 0, 0, 2]])
    np.testing.assert_array_equal(mb.seq_lens, [[8, 0, 0], [9, 2, 5], [0, 0, 7]])
    np.testing.assert_array_equal(mb.tokens, np.arange(12).reshape(3, 4))
    assert mb.block_tables.shape == (3, 3, 4) and not mb.decode


@pytest.mark.parametrize("seed", range(5))
def test_ragged_split_keeps_every_row_with_its_sequence(seed):
    """For random ragged batches and every M dividing T: each row lands in exactly one
    microbatch, owned by the same sequence as before, and each sequence's seq_len there
    is one past its last row's position (what attention masks by)."""
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 6))
    q_lens = rng.integers(1, 9, S)
    cached = rng.integers(0, 10, S)
    T = int(q_lens.sum() + rng.integers(0, 4))
    T += (-T) % 12
    b = ragged_batch(q_lens, cached, T)
    for M in (1, 2, 3, 4, 6, 12):
        mb = jax.tree.map(np.asarray, split_microbatches(b, M))
        tm = T // M
        for m in range(M):
            for s in range(S):
                lo, hi = mb.query_start[m, s], mb.query_start[m, s + 1]
                rows = np.arange(m * tm + lo, m * tm + hi)
                assert all(b.query_start[s] <= r < b.query_start[s + 1] for r in rows)
                if hi > lo:
                    assert mb.seq_lens[m, s] == b.positions[rows[-1]] + 1
                else:
                    assert mb.seq_lens[m, s] == 0
        owned = sum(int(mb.query_start[m, s + 1] - mb.query_start[m, s])
                    for m in range(M) for s in range(S))
        assert owned == q_lens.sum()


def test_decode_split_is_by_sequences():
    S = 8
    b = StepBatch(tokens=np.arange(S, dtype=np.int32), positions=np.arange(S, dtype=np.int32) + 3,
                  slot_mapping=np.arange(S, dtype=np.int32), block_tables=np.arange(S * 2).reshape(S, 2),
                  seq_lens=np.arange(S, dtype=np.int32) + 4, query_start=np.arange(S + 1, dtype=np.int32),
                  logits_indices=np.arange(S, dtype=np.int32), decode=True)
    mb = jax.tree.map(np.asarray, split_microbatches(b, 4))
    assert mb.decode
    np.testing.assert_array_equal(mb.seq_lens, (np.arange(S) + 4).reshape(4, 2))
    np.testing.assert_array_equal(mb.block_tables, np.arange(S * 2).reshape(4, 2, 2))
    np.testing.assert_array_equal(mb.query_start, [[0, 1, 2]] * 4)


def test_microbatches_divide_the_step():
    dec = lambda S: StepBatch(tokens=np.zeros(S), positions=0, slot_mapping=0, block_tables=0,  # noqa: E731
                              seq_lens=np.zeros(S), query_start=0, logits_indices=0, decode=True)
    assert [microbatches_for(dec(S), 4) for S in (1, 2, 3, 4, 6, 16)] == [1, 2, 3, 4, 3, 4]
    mixed = ragged_batch([5], [0], 12)
    assert microbatches_for(mixed, 8) == 6 and microbatches_for(mixed, 1) == 1
    with pytest.raises(ValueError, match="do not divide"):
        split_microbatches(mixed, 5)


def test_a_zero_layer_is_the_identity():
    """The slots a short last stage pads with: all-zero weights add exactly 0 to the
    residual stream (attention and MLP outputs 0), also with q/k/v biases."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
    layer = jax.tree.map(jnp.zeros_like, init_params(cfg, jax.random.key(0)).layers[0])
    from jaxserve.model.kv_cache import init_kv_cache
    cache = init_kv_cache(cfg, 4, 4, "float32")
    b = ragged_batch([3, 2], [0, 1], 6, P=1)
    b = dataclasses.replace(b, block_tables=np.array([[1], [2]], np.int32),
                            slot_mapping=np.array([4, 5, 6, 9, 10, 0], np.int32))
    x = jax.random.normal(jax.random.key(1), (6, 32))
    y, _, _ = _decoder_layers(x, (layer,), cache, jax.tree.map(jnp.asarray, b), cfg, None, Kernels())
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_staged_kv_pool_holds_each_stage_its_layer_slots():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=5,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    rules = ShardingRules(make_abstract_mesh(ParallelConfig(tensor_parallel_size=2,
                                                            pipeline_parallel_size=2)))
    pool = abstract_kv_cache(cfg, 9, 4, "float32", rules, "token_major")
    assert len(pool.k) == 3 and pool.staged and pool.num_pages == 9 and pool.page_size == 4
    assert pool.k[0].shape == (2, 9, 4, 2, 8)
    assert tuple(pool.k[0].sharding.spec) == ("stage", None, None, "model", None)
    flat = abstract_kv_cache(cfg, 9, 4, "float32", None, "head_major")
    assert len(flat.k) == 5 and not flat.staged and flat.num_pages == 9


def test_deployment_checks_name_the_field():
    model = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=4 exceeds the model's 3 layers"):
        check_deployment(EngineConfig(), model, ParallelConfig(pipeline_parallel_size=4))
    spec = EngineConfig().override(speculative_config=SpeculativeConfig(
        method="ngram", num_speculative_tokens=2))
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        check_deployment(spec, model, ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="ParallelConfig.pipeline_parallel_size must be > 0"):
        ParallelConfig(pipeline_parallel_size=0)
    with pytest.raises(ConfigError, match="ParallelConfig.pipeline_microbatches must be > 0"):
        ParallelConfig(pipeline_microbatches=0)
    with pytest.raises(ConfigError, match="pipeline_decode_microbatches must be > 0"):
        ParallelConfig(pipeline_decode_microbatches=0)
    p = ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2)
    assert p.num_devices == 16 and p.microbatches == 4 and p.pipeline_decode_microbatches == 1
    assert dict(make_abstract_mesh(p).shape) == {"stage": 2, "model": 8}


def test_llama70b_plan_over_two_stages_halves_layers_and_pool():
    """TP 8 x PP 2 (2 hosts x 8 GPUs): each device holds 40 of the 80 layers and their
    pool; the embedding, LM head and final norm stay on every stage. PP 3 rounds the
    stage up to 27 layer slots."""
    cfg = load_config(ROOT / "configs/llama70b.py").override(kv_cache_memory_bytes=8 * 40 * 2**30)
    one = plan_memory(cfg.override(tensor_parallel_size=8))
    two = plan_memory(cfg.override(tensor_parallel_size=8, pipeline_parallel_size=2))
    three = plan_memory(cfg.override(tensor_parallel_size=8, pipeline_parallel_size=3))
    m = cfg.model
    ends = 2 * (m.vocab_size * m.hidden_size // 8) * 2 + m.hidden_size * 2  # embed, head, norm
    layer = (one.weights - ends) // 80
    assert two.weights == ends + 40 * layer and three.weights == ends + 27 * layer
    assert two.kv_pool == one.kv_pool // 2 and two.kv_pages == one.kv_pages
    assert two.layers_per_device == 40 and two.num_devices == 16
    assert "pipeline stages 2" in two.table()


def test_plan_memory_tool_prints_both_llama70b_deployments():
    tool = [sys.executable, "-m", "jaxserve", "plan-memory", "--config",
            str(ROOT / "configs/llama70b.py")]
    tp8 = subprocess.run(tool + ["-tp", "8"], capture_output=True, text=True, check=True).stdout
    pp2 = subprocess.run(tool + ["-tp", "8", "-pp", "2"], capture_output=True, text=True,
                         check=True).stdout
    assert "16 (tensor parallel 8 x pipeline stages 2)" in pp2 and "layers / device           40" in pp2
    assert "8 (tensor parallel 8 x pipeline stages 1)" in tp8
