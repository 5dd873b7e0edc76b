"""jaxserve.model.attention.XlaAttention: the online softmax over chunks of each row's own
pages against an independent float64 numpy softmax (ragged batches with prefix hits,
empty and padding sequences, padding rows, decode; both pool layouts; blocks and chunks
forced small so the loops run many times), slots no row sees poisoned with NaN, and the
temporaries of a Llama-3-8B-shaped step bounded (issue 29 item 5: the dense formulation
built scores over every page of the table for every row, 193 GiB for the step below)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve.model.attention as attention
from jaxserve.config import load_config
from jaxserve.model.attention import make_metadata, paged_attention
from kernel_utils import shuffled_pool

GiB = 2**30
# Against float64: the f32 path rounds products and sums (f32, O(1) values); bf16 pools
# and queries: inputs rounded to bf16 before both, p rounded to bf16 for p @ v (<= 2^-9
# relative) and the output once.
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}

# (new tokens, context length) per sequence: a prompt, a prefix-cache hit (5 new of 37),
# decode rows, a sequence without new rows, a padding sequence (0, 0)
RAGGED = [(9, 9), (1, 20), (5, 37), (1, 1), (0, 11), (12, 30), (0, 0)]


def _dense_numpy(q, k, v, tables, seqs, positions):
    """float64 causal softmax, one row and head at a time (token-major k, v)."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    _, _, kv_heads, head_dim = k.shape
    group = q.shape[1] // kv_heads
    out = np.zeros_like(q)
    row = 0
    for b, (new, ctx) in enumerate(seqs):
        keys = k[tables[b]].reshape(-1, kv_heads, head_dim)
        vals = v[tables[b]].reshape(-1, kv_heads, head_dim)
        for t in range(row, row + new):
            n = positions[t] + 1
            for h in range(q.shape[1]):
                s = keys[:n, h // group] @ q[t, h] / np.sqrt(head_dim)
                w = np.exp(s - s.max())
                out[t, h] = (w / w.sum()) @ vals[:n, h // group]
        row += new
    return out


def _case(rng, seqs, *, q_heads=4, kv_heads=2, head_dim=16, page_size=4, pages_per_seq=10,
          pad_rows=3, dtype=jnp.float32):
    ctx = [c for _, c in seqs]
    k, v, tables, live = shuffled_pool(rng, ctx, kv_heads=kv_heads, head_dim=head_dim,
                                       page_size=page_size, pages_per_seq=pages_per_seq)
    k[~live], v[~live] = np.nan, np.nan  # no row may read a slot outside its context
    new = [n for n, _ in seqs]
    query_start = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    T = int(query_start[-1]) + pad_rows
    positions = np.zeros(T, np.int32)
    for b, (n, c) in enumerate(seqs):
        positions[query_start[b]:query_start[b + 1]] = np.arange(c - n, c)
    q = rng.standard_normal((T, q_heads, head_dim)).astype(np.float32)
    return (jnp.asarray(q, dtype), k.astype(dtype), v.astype(dtype), tables,
            np.asarray(ctx, np.int32), query_start, positions)


def _attend(q, k, v, tables, seq_lens, query_start, positions, layout, decode=False):
    meta = make_metadata(jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(query_start),
                         jnp.asarray(positions), k.shape[1], "xla", decode=decode)
    if layout == "head_major":  # [N, ps, K, Dh] -> [K, N, ps, Dh]
        k, v = k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)
    fn = jax.jit(lambda q, k, v, m: paged_attention(q, k, v, m, "xla", layout))
    return np.asarray(fn(q, jnp.asarray(k), jnp.asarray(v), meta).astype(jnp.float32))


@pytest.fixture(params=["defaults", "small-blocks"])
def blocking(request, monkeypatch):
    """Default blocking (one block, one chunk here) or 3-page chunks and 5-row blocks."""
    if request.param == "small-blocks":
        monkeypatch.setattr(attention, "XLA_KV_CHUNK", 12)
        monkeypatch.setattr(attention, "XLA_BLOCK_BYTES", 5 * 12 * 2 * 16 * 4)
    return request.param


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_batch_matches_float64_softmax(layout, dtype, blocking):
    rng = np.random.default_rng(0)
    q, k, v, tables, seq_lens, query_start, positions = _case(rng, RAGGED, dtype=dtype)
    if blocking == "small-blocks":
        R, C = attention._xla_blocking(q.shape[0], tables.shape[1], 4, 2 * 16 * 4)
        assert (R, C) == (5, 3)  # 31 rows: 7 blocks; contexts up to 37: 4 chunks
    out = _attend(q, k, v, tables, seq_lens, query_start, positions, layout)
    ref = _dense_numpy(q, k, v, tables, RAGGED, positions)
    rows = query_start[-1]
    np.testing.assert_allclose(out[:rows], ref[:rows], **TOL[dtype])
    assert np.isfinite(out).all()


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_decode_batch_matches_float64_softmax(layout, blocking):
    rng = np.random.default_rng(1)
    seqs = [(1, 1), (1, 17), (1, 40), (1, 8), (0, 0)]  # the last a padding sequence
    # T == S: row b is sequence b's, the padding sequence's row is outside every sequence
    q, k, v, tables, seq_lens, query_start, positions = _case(rng, seqs, pad_rows=1)
    out = _attend(q, k, v, tables, seq_lens, query_start, positions, layout, decode=True)
    ref = _dense_numpy(q, k, v, tables, seqs, positions)
    np.testing.assert_allclose(out[:4], ref[:4], **TOL[jnp.float32])
    assert np.isfinite(out).all()


def test_a_wrong_block_table_changes_the_output():
    """The comparison can fail: two sequences' first pages swapped give another answer."""
    rng = np.random.default_rng(2)
    q, k, v, tables, seq_lens, query_start, positions = _case(rng, [(6, 30), (4, 20)],
                                                              pad_rows=0)
    good = _attend(q, k, v, tables, seq_lens, query_start, positions, "token_major")
    swapped = tables.copy()
    swapped[[0, 1], 0] = swapped[[1, 0], 0]
    bad = _attend(q, k, v, swapped, seq_lens, query_start, positions, "token_major")
    assert np.abs(good - bad).max() > 0.1


def _llama3_8b_step_temp_bytes(T, S, P):
    """memory_analysis().temp_size_in_bytes of the whole forward (32 layers, XLA attention,
    head-major pool, abstract weights) of configs/llama3_8b.py in float32 (XLA:CPU runs
    bf16 matmuls on f32 copies of the weights, which would count here and not on a GPU)."""
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.kv_cache import abstract_kv_cache
    from jaxserve.model.params import abstract_params
    from jaxserve.model.transformer import forward
    config = load_config("configs/llama3_8b.py")
    cfg = dataclasses.replace(config.model, dtype="float32")
    page_size = config.engine.cache.page_size
    cache = abstract_kv_cache(cfg, S * P + 1, page_size, cfg.dtype, layout="head_major")
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    batch = StepBatch(tokens=i32(T), positions=i32(T), slot_mapping=i32(T),
                      block_tables=i32(S, P), seq_lens=i32(S), query_start=i32(S + 1),
                      logits_indices=i32(S), decode=T == S)
    step = jax.jit(lambda p, c, b: forward(p, c, b, cfg), donate_argnums=1)
    exe = step.lower(abstract_params(cfg), cache, batch).compile()
    return exe.memory_analysis().temp_size_in_bytes


def test_llama3_8b_steps_keep_attention_temporaries_bounded():
    """The step of issue 29's GPU run (64 prompts of 512 -> 256, a mixed step of the
    config's whole token budget over 64 sequences with 1,024-token tables; the dense
    formulation built f32 [8, 65536, 32768] scores there, 193 GiB of temporaries here) and a
    decode step of max_num_seqs sequences over max_model_len tables: under 2 GiB, the
    residual stream, q / k / v and the MLP's f32 [8192, 14336] buffers included."""
    config = load_config("configs/llama3_8b.py")
    sched, ps = config.engine.scheduler, config.engine.cache.page_size
    mixed = _llama3_8b_step_temp_bytes(sched.max_num_batched_tokens, 64, 1024 // ps)
    assert mixed < 2 * GiB, mixed / GiB
    decode = _llama3_8b_step_temp_bytes(sched.max_num_seqs, sched.max_num_seqs,
                                           config.engine.max_model_len // ps)
    assert decode < 2 * GiB, decode / GiB
