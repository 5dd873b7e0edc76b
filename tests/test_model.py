"""The paged ragged forward against a dense reference, on tiny random configs."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.config import RopeScaling
from jaxserve.model.layers import rope_inv_freq
from jaxserve.model.params import abstract_params, init_params, param_count
from jaxserve.model.transformer import Kernels
from model_utils import PagedDriver, dense_reference_logits, tiny_config

CONFIGS = {
    "gqa2": tiny_config(),
    "mha": tiny_config(num_kv_heads=4),
    "gqa4_tied": tiny_config(num_heads=8, num_kv_heads=2, tie_word_embeddings=True),
    "qwen2_bias": tiny_config(attention_bias=True),
    "llama3_rope": tiny_config(rope_theta=500000.0, rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
}


def _params(cfg, seed):
    params = init_params(cfg, jax.random.key(seed), scale=0.3)
    if cfg.attention_bias:  # non-zero biases so the bias path is exercised
        layers = tuple(dataclasses.replace(l, bq=l.bq + 0.1, bk=l.bk - 0.2, bv=l.bv + 0.3)
                       for l in params.layers)
        params = dataclasses.replace(params, layers=layers)
    return params


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_dense_reference(name, layout):
    cfg = CONFIGS[name]
    params = _params(cfg, seed=list(CONFIGS).index(name))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, 23).tolist()
    ref = dense_reference_logits(params, cfg, ids)
    drv = PagedDriver(params, cfg, page_size=4, layout=layout)
    got = [drv.step({"s": ids[:10]}, T=16, P=8)["s"]]           # prefill across 3 pages
    for t in ids[10:]:                                           # decode one token at a time
        got.append(drv.step({"s": [t]}, T=1, P=8)["s"])
    np.testing.assert_allclose(np.concatenate(got), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_ragged_batch_rows_are_independent(layout):
    cfg = CONFIGS["gqa2"]
    params = _params(cfg, 3)
    rng = np.random.default_rng(2)
    a, b, c = (rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 4, 13))
    drv = PagedDriver(params, cfg, page_size=4, layout=layout)
    out = drv.step({"a": a, "b": b, "c": c}, T=24, P=4, S=4)  # mixed lengths packed, padding
    for name, ids in (("a", a), ("b", b), ("c", c)):
        np.testing.assert_allclose(out[name], dense_reference_logits(params, cfg, ids), atol=2e-5, rtol=1e-5)
    # a chunked continuation attends to context already in the pages
    more = rng.integers(0, cfg.vocab_size, 6).tolist()
    out2 = drv.step({"c": more, "a": more[:2]}, T=12, P=8)
    np.testing.assert_allclose(out2["c"], dense_reference_logits(params, cfg, c + more)[13:], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out2["a"], dense_reference_logits(params, cfg, a + more[:2])[1:], atol=2e-5, rtol=1e-5)


def test_llama3_rope_scaling_matches_transformers():
    import transformers  # a test extra: missing, this fails rather than skips
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    inv_hf, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192))
    np.testing.assert_allclose(ours, inv_hf.numpy(), rtol=1e-6)
    assert not np.allclose(ours, rope_inv_freq(128, 500000.0, None))


def test_abstract_params_allocate_nothing_and_count():
    cfg = tiny_config(num_layers=3)
    abstract = abstract_params(cfg)
    leaves = jax.tree.leaves(abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(np.prod(x.shape) for x in leaves) == param_count(cfg)


def test_head_major_pool_holds_the_same_kv():
    """Both layouts hold each token's K/V at the same (page, offset), null page included."""
    cfg = CONFIGS["gqa2"]
    params = _params(cfg, 4)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, 11).tolist()
    drivers = [PagedDriver(params, cfg, page_size=4, layout=lay) for lay in ("token_major", "head_major")]
    for d in drivers:
        d.step({"s": ids[:7]}, T=8, P=4)
        d.step({"s": ids[7:8]}, T=1, P=4)
    tm, hm = drivers[0].cache, drivers[1].cache
    assert (tm.num_pages, tm.page_size) == (hm.num_pages, hm.page_size) == (64, 4)
    for i in range(cfg.num_layers):
        for got, want in ((hm.k[i], tm.k[i]), (hm.v[i], tm.v[i])):
            got, want = np.asarray(got).transpose(1, 2, 0, 3), np.asarray(want)
            if i == 0:  # the first layer's K/V come from the embeddings alone: exactly equal
                np.testing.assert_array_equal(got, want)
            else:  # later ones went through the two layouts' attention: summation order
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("narrow, bits", [("bfloat16", "uint16"), ("float8_e4m3fn", "uint8")],
                         ids=["bf16", "fp8"])
def test_narrow_pool_stores_bits_of_the_rounded_kv(layout, narrow, bits):
    """A bf16 (fp8 e4m3fn) pool is uint16 (uint8) arrays holding the bits of the K/V an f32
    pool holds rounded to that dtype (fp8: clipped to +-448 first; layer 0, from the
    embeddings alone: exactly); the logits stay close to the f32 pool's: within 5% of the
    largest for bf16 (step 2^-8 relative), 40% for fp8 (step 2^-3: 32x bf16's, so this
    bounds garbage, not precision; the real model's KL is test_engine_real's)."""
    import jax.numpy as jnp
    from jaxserve.kernels.common import kv_values
    cfg = CONFIGS["gqa2"]
    params = _params(cfg, 6)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 12).tolist()
    drivers = {dt: PagedDriver(params, cfg, page_size=4, layout=layout, kv_dtype=dt)
               for dt in ("float32", narrow)}
    logits = {}
    for dt, d in drivers.items():
        logits[dt] = [d.step({"s": ids[:9]}, T=16, P=4)["s"]]
        logits[dt] += [d.step({"s": [t]}, T=1, P=4)["s"] for t in ids[9:]]
    nc, f32 = drivers[narrow].cache, drivers["float32"].cache
    assert nc.k[0].dtype == jnp.dtype(bits) and nc.dtype == jnp.dtype(narrow)
    assert f32.dtype == jnp.float32
    for got, want in ((nc.k[0], f32.k[0]), (nc.v[0], f32.v[0])):
        np.testing.assert_array_equal(np.asarray(kv_values(got)),
                                      np.asarray(jnp.clip(want, -448, 448).astype(narrow)))
    diff = np.abs(np.concatenate(logits[narrow]) - np.concatenate(logits["float32"])).max()
    scale = np.abs(np.concatenate(logits["float32"])).max()
    assert 0 < diff < (0.05 if narrow == "bfloat16" else 0.4) * scale, (diff, scale)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_int8_pool_stores_each_rows_values_and_scale(layout):
    """An int8 pool's arrays are [.., head_dim + 4] int8: each (token, KV head) row holds
    round(x / s) and the f32 bits of s = max|x| / 127 of the K/V an f32 pool holds (layer 0,
    from the embeddings alone: exactly the f32 pool's values quantised); every dequantised
    value within s / 2 of the f32 one; slots never written stay zero; the logits close to
    the f32 pool's (int8's step is 2^-7 of a row's largest value, between bf16's 2^-8
    relative and fp8's 2^-3: the 5% bound of the bf16 pool's test)."""
    import jax.numpy as jnp
    from jaxserve.kernels.common import kv_rows_f32, quantize_kv_int8
    cfg = CONFIGS["gqa2"]
    params = _params(cfg, 6)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 12).tolist()
    drivers = {dt: PagedDriver(params, cfg, page_size=4, layout=layout, kv_dtype=dt)
               for dt in ("float32", "int8")}
    logits = {}
    for dt, d in drivers.items():
        logits[dt] = [d.step({"s": ids[:9]}, T=16, P=4)["s"]]
        logits[dt] += [d.step({"s": [t]}, T=1, P=4)["s"] for t in ids[9:]]
    q8, f32 = drivers["int8"].cache, drivers["float32"].cache
    assert q8.k[0].dtype == jnp.int8 and q8.k[0].shape[-1] == cfg.head_dim + 4
    assert q8.k[0].shape[:-1] == f32.k[0].shape[:-1]
    for got, want in ((q8.k[0], f32.k[0]), (q8.v[0], f32.v[0])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(quantize_kv_int8(want)))
        values, want = np.asarray(kv_rows_f32(got)), np.asarray(want)
        half_step = np.abs(want).max(-1, keepdims=True) / 254
        assert (np.abs(values - want) <= half_step * (1 + 1e-6)).all()
        written = np.abs(want).max(-1) > 0
        assert 0 < written.mean() < 1 and (np.asarray(got)[~written] == 0).all()
    diff = np.abs(np.concatenate(logits["int8"]) - np.concatenate(logits["float32"])).max()
    scale = np.abs(np.concatenate(logits["float32"])).max()
    assert 0 < diff < 0.05 * scale, (diff, scale)


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8"])
def test_kv_write_updates_the_donated_pool_in_place(dtype, layout):
    """A step's temporary buffers stay far below one pool buffer: the K/V write updates the
    donated pool in place. (A pool held as bfloat16 arrays failed this on XLA:CPU: the write
    became convert(pool -> f32), update, convert back, 8x a layer's pool in temporaries.)"""
    from jaxserve.model.kv_cache import abstract_kv_cache
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.transformer import forward
    cfg = CONFIGS["gqa2"]
    params = _params(cfg, 0)
    S, P = 4, 4
    batch = StepBatch(tokens=np.zeros(S, np.int32), positions=np.zeros(S, np.int32),
                      slot_mapping=np.arange(S, dtype=np.int32), block_tables=np.zeros((S, P), np.int32),
                      seq_lens=np.ones(S, np.int32), query_start=np.arange(S + 1, dtype=np.int32),
                      logits_indices=np.arange(S, dtype=np.int32), decode=True)
    cache = abstract_kv_cache(cfg, 4096, 4, dtype, layout=layout)
    step = jax.jit(lambda p, c, b: forward(p, c, b, cfg)[1], donate_argnums=1)
    mem = step.lower(params, cache, batch).compile().memory_analysis()
    pool_buffer = cache.k[0].size * cache.k[0].dtype.itemsize
    assert mem.alias_size_in_bytes == 2 * cfg.num_layers * pool_buffer
    assert mem.temp_size_in_bytes < pool_buffer / 8, (mem.temp_size_in_bytes, pool_buffer)


def test_pallas_attention_refuses_the_head_major_pool():
    import jax.numpy as jnp
    from jaxserve.model.attention import make_metadata, paged_attention
    pages = jnp.zeros((2, 8, 4, 16))  # head-major [K, N, ps, Dh]
    meta = make_metadata(jnp.ones((1, 2), jnp.int32), jnp.array([3]), jnp.array([0, 1]),
                         jnp.array([2]), 4, "pallas_interpret", decode=True)
    with pytest.raises(ValueError, match="token_major"):
        paged_attention(jnp.zeros((1, 4, 16)), pages, pages, meta, "pallas_interpret", "head_major")


def test_dual_precision_weights_pick_by_rows():
    """Steps below min_rows rows compute exactly the f32 model; from min_rows up they use
    the bf16 copy (close to f32, not equal); a 1-row bf16 matmul (padded to 2 rows) gives
    what the same row gives inside a larger batch."""
    import jax.numpy as jnp
    from jaxserve.config import ConfigError, KernelConfig
    from jaxserve.model.linear import dense
    from jaxserve.model.weight_layouts import DualPrecisionWeight, dual_precision_params

    cfg = CONFIGS["gqa4_tied"]
    params = _params(cfg, 6)
    dual = dual_precision_params(params, min_rows=4)
    assert isinstance(dual.lm_head, DualPrecisionWeight) and dual.lm_head.vocab_major
    assert dual.layers[0].wq.w_copy.dtype == jnp.bfloat16 and dual.layers[0].wq.w is params.layers[0].wq
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 9).tolist()
    f32 = PagedDriver(params, cfg, page_size=4)
    mixed = PagedDriver(dual, cfg, page_size=4)
    small_f, small_m = (d.step({"s": ids[:3]}, T=3, P=4)["s"] for d in (f32, mixed))
    np.testing.assert_array_equal(small_m, small_f)                      # 3 rows < 4: f32
    big_f, big_m = (d.step({"s": ids[3:]}, T=8, P=4)["s"] for d in (f32, mixed))  # 8 rows: bf16
    assert 0 < np.abs(big_m - big_f).max() < 0.05 * np.abs(big_f).max()

    w = dual_precision_params(params, min_rows=1).layers[0].w_up
    assert w.w is None, "min_rows 1 keeps only the bf16 copy"
    x = jnp.asarray(np.random.default_rng(8).standard_normal((5, cfg.hidden_size)), jnp.float32)
    # x rounded to bf16 times bf16 weights: exact f32 products, summed in f32 in an order that
    # XLA:CPU may pick by row count (it does on Intel AMX machines): equal up to two f32
    # summation errors, each at most (K - 1) u sum |x_k w_k| (u = 2^-24)
    one, many = np.asarray(dense(x[:1], w, 1)), np.asarray(dense(x, w, 1))[:1]
    xb = np.asarray(x[:1].astype(jnp.bfloat16), np.float64)
    wb = np.asarray(w.w_copy, np.float64)
    bound = 2 * (cfg.hidden_size - 1) * 2.0 ** -24 * (np.abs(xb) @ np.abs(wb))
    assert np.all(np.abs(one - many) <= bound), np.abs(one - many).max()

    # a row window: bf16 from 1 to 4 rows, f32 above
    window = dual_precision_params(params, min_rows=1, max_rows=4)
    assert window.layers[0].w_up.w is params.layers[0].w_up
    f32, win = PagedDriver(params, cfg, page_size=4), PagedDriver(window, cfg, page_size=4)
    small_f, small_w = (d.step({"s": ids[:3]}, T=3, P=4)["s"] for d in (f32, win))
    assert 0 < np.abs(small_w - small_f).max() < 0.05 * np.abs(small_f).max()  # 3 rows: bf16
    f32, win = PagedDriver(params, cfg, page_size=4), PagedDriver(window, cfg, page_size=4)
    big_f, big_w = (d.step({"s": ids[:8]}, T=8, P=4)["s"] for d in (f32, win))
    np.testing.assert_array_equal(big_w, big_f)                           # 8 rows > 4: f32

    with pytest.raises(ConfigError, match="bf16_matmul_min_rows"):
        KernelConfig(bf16_matmul_min_rows=0)
    with pytest.raises(ConfigError, match=r"bf16_matmul_max_rows must be None or >= bf16_matmul_min_rows \(4\), got 2"):
        KernelConfig(bf16_matmul_min_rows=4, bf16_matmul_max_rows=2)
    with pytest.raises(ConfigError, match="bf16_matmul_max_rows needs bf16_matmul_min_rows"):
        KernelConfig(bf16_matmul_max_rows=8)
    with pytest.raises(ConfigError, match="weight_quant's int8 / fp8 weights have no C"):
        KernelConfig(matmul_impl="cpu", weight_quant="fp8_e4m3")
    KernelConfig(matmul_impl="cpu")  # a float32 model's own weights in f32 panels
    with pytest.raises(ConfigError, match="bf16_matmul_min_rows and weight_quant"):
        KernelConfig(bf16_matmul_min_rows=1, weight_quant="int8")


@pytest.mark.parametrize("name", ["gqa4_tied", "qwen2_bias"])
def test_fused_projections_give_the_unfused_logits(name):
    """fuse_projections (wq | wk | wv and w_gate | w_up each one matrix, what GPUs serve):
    the paged prefill and decode give the unfused model's logits up to f32 summation
    order (the same products; XLA may split a wider dot differently), and the LoRA-free,
    bias and tied-head paths are kept. Quantised layers are left as they are; quantising
    fused weights (weight_quant with fuse_projections) gives the parts' own quantised
    columns and scales, and the unfused quantised model's logits."""
    from jaxserve.model.weight_layouts import FusedWeight, fuse_projections, quantize_params

    cfg = CONFIGS[name]
    params = _params(cfg, 11)
    fused = fuse_projections(params)
    lp, raw = fused.layers[0], params.layers[0]
    assert isinstance(lp.wq, FusedWeight) and lp.wk is None and lp.wv is None
    assert isinstance(lp.w_gate, FusedWeight) and lp.w_up is None
    H, K, Dh, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    assert lp.wq.shape == (D, (H + 2 * K) * Dh)
    assert lp.wq.out_shapes == ((H, Dh), (K, Dh), (K, Dh))
    assert lp.w_gate.shape == (D, 2 * cfg.intermediate_size)
    # the columns are the parts' own, in order
    np.testing.assert_array_equal(np.asarray(lp.wq.w[:, H * Dh:(H + K) * Dh]),
                                  np.asarray(raw.wk).reshape(D, -1))
    np.testing.assert_array_equal(np.asarray(lp.w_gate.w[:, cfg.intermediate_size:]),
                                  np.asarray(raw.w_up))
    ids = np.random.default_rng(12).integers(0, cfg.vocab_size, 14).tolist()
    got, want = [], []
    for out, p in ((got, fused), (want, params)):
        drv = PagedDriver(p, cfg, page_size=4)
        out.append(drv.step({"s": ids[:9]}, T=12, P=4)["s"])
        for t in ids[9:]:
            out.append(drv.step({"s": [t]}, T=1, P=4)["s"])
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=2e-5, rtol=1e-5)
    q = quantize_params(params, "int8")
    assert fuse_projections(q).layers[0] is q.layers[0]
    for group in (None, 16):
        q = quantize_params(params, "int8", group)
        fq = quantize_params(fuse_projections(params), "int8", group)
        w, k = fq.layers[0].wq.w, q.layers[0].wk
        cols = slice(H * Dh, (H + K) * Dh)
        np.testing.assert_array_equal(np.asarray(w.w_q[:, cols]), np.asarray(k.w_q).reshape(D, -1))
        np.testing.assert_array_equal(np.asarray(w.scales[..., cols]), np.asarray(k.scales))
        got, want = (PagedDriver(p, cfg, page_size=4).step({"s": ids}, T=16, P=8)["s"]
                     for p in (fq, q))
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_rope_tables_are_computed_once_per_step():
    """XLA:CPU fused the cos / sin of rope_tables into every layer's q and k rotation,
    recomputing them per element; the compiled step must hold a single cosine and sine."""
    from jaxserve.worker.input_batch import empty_batch
    from jaxserve.model.kv_cache import init_kv_cache
    from model_utils import _fwd

    cfg = CONFIGS["gqa2"]
    assert cfg.num_layers >= 2
    params = _params(cfg, 0)
    cache = init_kv_cache(cfg, 8, 4, cfg.dtype)
    text = _fwd.lower(params, cache, empty_batch(16, 2, 4), cfg, Kernels()).compile().as_text()
    assert text.count(" cosine(") == 1 and text.count(" sine(") == 1


def test_dummy_params_shapes_spread_and_determinism():
    from jaxserve.model.params import dummy_params
    cfg = tiny_config(num_layers=2, attention_bias=True)
    a, b = dummy_params(cfg), dummy_params(cfg)
    for want, x, y in zip(jax.tree.leaves(abstract_params(cfg)), jax.tree.leaves(a),
                          jax.tree.leaves(b), strict=True):
        assert (x.shape, x.dtype) == (want.shape, want.dtype)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # deterministic
    wq = np.asarray(a.layers[0].wq, np.float32)
    assert abs(wq.std() - 0.02) < 0.002 and abs(wq.mean()) < 0.002
    assert np.abs(wq).max() <= 0.02 * 3 ** 0.5
    # leaves differ from each other and from another seed; norms are ones, biases zeros
    assert not np.array_equal(np.asarray(a.layers[0].wk), np.asarray(a.layers[1].wk))
    assert not np.array_equal(wq, np.asarray(dummy_params(cfg, seed=1).layers[0].wq))
    assert (np.asarray(a.layers[0].attn_norm) == 1).all() and (np.asarray(a.layers[0].bq) == 0).all()
