"""The paged ragged forward against a dense reference, on tiny random configs."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.config import RopeScaling
from jaxserve.model.layers import rope_inv_freq
from jaxserve.model.params import abstract_params, init_params, param_count
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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_dense_reference(name):
    cfg = CONFIGS[name]
    params = _params(cfg, seed=list(CONFIGS).index(name))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, 23).tolist()
    ref = dense_reference_logits(params, cfg, ids)
    drv = PagedDriver(params, cfg, page_size=4)
    got = [drv.step({"s": ids[:10]}, Q=16, P=8)["s"]]           # prefill across 3 pages
    for t in ids[10:]:                                           # decode one token at a time
        got.append(drv.step({"s": [t]}, Q=1, P=8)["s"])
    np.testing.assert_allclose(np.concatenate(got), ref, atol=2e-5, rtol=1e-5)


def test_ragged_batch_rows_are_independent():
    cfg = CONFIGS["gqa2"]
    params = _params(cfg, 3)
    rng = np.random.default_rng(2)
    a, b, c = (rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 4, 13))
    drv = PagedDriver(params, cfg, page_size=4)
    out = drv.step({"a": a, "b": b, "c": c}, Q=16, P=4)        # mixed lengths, one batch
    for name, ids in (("a", a), ("b", b), ("c", c)):
        np.testing.assert_allclose(out[name], dense_reference_logits(params, cfg, ids), atol=2e-5, rtol=1e-5)
    # a chunked continuation attends to context already in the pages
    more = rng.integers(0, cfg.vocab_size, 6).tolist()
    out2 = drv.step({"c": more, "a": more[:2]}, Q=8, P=8)
    np.testing.assert_allclose(out2["c"], dense_reference_logits(params, cfg, c + more)[13:], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(out2["a"], dense_reference_logits(params, cfg, a + more[:2])[1:], atol=2e-5, rtol=1e-5)


def test_llama3_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
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
