"""jaxserve.model.layer_loop: the decoder layers as a loop over stacked weights and a stacked
KV pool give the unrolled model's logits (XLA and the C++ kernels, both pool layouts), the
compiled step holds one layer's kernels instead of num_layers', the stacked pool is written
at the loop's layer, and the engine picks the loop where it runs (and says why not)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError
from jaxserve.model.kv_cache import init_kv_cache, write_kv
from jaxserve.model.layer_loop import StackedLayers, layer_view, stack_layers, why_not_loop
from jaxserve.model.params import init_params
from jaxserve.model.transformer import Kernels
from jaxserve.model.weight_layouts import dual_precision_params
from model_utils import PagedDriver, tiny_config

CFG = tiny_config(hidden_size=64, intermediate_size=96, num_heads=6, num_kv_heads=2,
                  head_dim=64, num_layers=4)


def _logits(params, kernels, layout, stacked, steps=4, kv_dtype=None):
    ids = np.random.default_rng(11).integers(0, CFG.vocab_size, 9 + steps).tolist()
    drv = PagedDriver(params, CFG, num_pages=24, page_size=16, kernels=kernels, layout=layout,
                      kv_dtype=kv_dtype)
    if stacked:
        drv.cache = init_kv_cache(CFG, 24, 16, kv_dtype or CFG.dtype, layout=layout, stacked=True)
    out = [drv.step({"a": ids[:9], "b": ids[3:8]}, T=16, P=2)]
    out += [drv.step({"a": [t], "b": [t]}, T=2, P=2) for t in ids[9:]]
    return [np.concatenate([np.atleast_2d(o["a"]), np.atleast_2d(o["b"])]) for o in out]


def _looped(params):
    return dataclasses.replace(params, layers=stack_layers(params.layers))


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_loop_gives_the_unrolled_logits_on_xla(layout):
    """f32 XLA attention and matmuls: the loop's logits equal the unrolled model's bit for
    bit (the same ops per layer, in the same order), prefill then decode."""
    params = init_params(CFG, jax.random.key(0), scale=0.3)
    kernels = Kernels("xla", "xla")
    want = _logits(params, kernels, layout, stacked=False)
    got = _logits(_looped(params), kernels, layout, stacked=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8"])
def test_loop_gives_the_unrolled_logits_with_the_cpp_kernels(kv_dtype, cpu_kernels_library):
    """The C++ attention over the stacked head-major pool (f32, bf16 / fp8 bits, int8 rows
    with their scales: the layer's offset in bytes of each) and the C++ bf16 matmul over
    packed copies stacked [L, ...], both read at the loop's layer in place: the unrolled
    model's logits bit for bit (each kernel's bits depend only on the layer it reads)."""
    params = init_params(CFG, jax.random.key(1), scale=0.3)
    packed = dual_precision_params(params, 1, packed=True)
    kernels = Kernels("cpu", "cpu")
    want = _logits(packed, kernels, "head_major", stacked=False, kv_dtype=kv_dtype)
    got = _logits(_looped(packed), kernels, "head_major", stacked=True, kv_dtype=kv_dtype)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _kernels_in_decode_step(params, cfg, stacked: bool) -> int:
    """Fusions and custom calls in the optimised HLO of one compiled decode step."""
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.transformer import forward
    from jaxserve.model.kv_cache import abstract_kv_cache
    S, P = 4, 4
    batch = StepBatch(tokens=np.zeros(S, np.int32), positions=np.zeros(S, np.int32),
                      slot_mapping=np.arange(S, dtype=np.int32),
                      block_tables=np.zeros((S, P), np.int32), seq_lens=np.ones(S, np.int32),
                      query_start=np.arange(S + 1, dtype=np.int32),
                      logits_indices=np.arange(S, dtype=np.int32), decode=True)
    cache = abstract_kv_cache(cfg, 64, 16, jnp.float32, stacked=stacked)
    text = jax.jit(lambda p, c, b: forward(p, c, b, cfg)).lower(params, cache, batch) \
        .compile().as_text()
    return len(re.findall(r" fusion\(| custom-call\(", text))


def test_forward_features_are_the_residual_streams_entering_the_layers():
    """transformer.forward_features (what an EAGLE-3-style head reads): the stream entering
    layer i is the embedding run through layers 0 .. i - 1, in the unrolled model and in
    the loop (split at the feature layers), and the hidden states are forward's."""
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.transformer import decoder_layers, forward, forward_features
    params = init_params(CFG, jax.random.key(3), scale=0.3)
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, 9).astype(np.int32)
    pos = np.arange(9, dtype=np.int32)
    batch = jax.tree.map(jnp.asarray, StepBatch(
        tokens=ids, positions=pos, slot_mapping=16 + pos, block_tables=np.array([[1, 2]], np.int32),
        seq_lens=np.array([9], np.int32), query_start=np.array([0, 9], np.int32),
        logits_indices=np.array([8], np.int32)))
    kernels = Kernels("xla", "xla")
    x0 = params.embed[ids]
    def first_layers(i):
        cache = init_kv_cache(CFG.replace(num_layers=i), 4, 16, CFG.dtype)
        return decoder_layers(x0, params.layers[:i], cache, batch, CFG)[0]

    want = [x0] + [first_layers(i) for i in (2, 3)]
    for stacked in (False, True):
        p = _looped(params) if stacked else params
        cache = init_kv_cache(CFG, 4, 16, CFG.dtype, stacked=stacked)
        hidden, feats, _ = forward_features(p, cache, batch, CFG, None, kernels, (0, 2, 3))
        assert len(feats) == 3
        for f, w in zip(feats, want):  # eager ops against the loop's compiled layers:
            # f32 sums in another order (XLA fuses and orders them by CPU: 1e-6 held on
            # Zen 4, one element reached 1.003e-6 on a Xeon): the f32 bound of the other
            # model tests, 1e-5 of the stream's largest value; a wrong layer's stream
            # differs by a whole layer's update
            np.testing.assert_allclose(np.asarray(f), np.asarray(w), rtol=0,
                                       atol=1e-5 * float(np.abs(w).max()))
        np.testing.assert_array_equal(np.asarray(hidden),
                                      np.asarray(forward(p, cache, batch, CFG, None, kernels)[0]))
        for bad in ((2, 1), (4,), (-1,)):
            with pytest.raises(ValueError, match="feature_layers"):
                forward_features(p, cache, batch, CFG, None, kernels, bad)


def test_a_compiled_step_holds_one_layers_kernels():
    """What the loop is for: XLA:CPU keeps one compiled kernel per fusion, and the unrolled
    model has every layer's, so its step grows with the layers; the loop's step holds one
    layer's, the same for 2 layers as for 6."""
    counts = {}
    for n in (2, 6):
        cfg = CFG.replace(num_layers=n)
        params = init_params(cfg, jax.random.key(2), scale=0.3)
        counts[n] = (_kernels_in_decode_step(params, cfg, stacked=False),
                     _kernels_in_decode_step(_looped(params), cfg, stacked=True))
    (unrolled2, looped2), (unrolled6, looped6) = counts[2], counts[6]
    assert looped6 == looped2, counts
    per_layer = (unrolled6 - unrolled2) / 4
    assert per_layer >= 10 and unrolled6 > looped6 + 4 * per_layer, counts


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_write_kv_at_a_layer_of_the_stacked_pool(layout):
    """write_kv(layer=i) into a stacked pool changes layer i exactly as write_kv into that
    layer's own pool does, and no other layer; dropped slots (past the pool) are dropped."""
    stacked = init_kv_cache(CFG, 8, 4, jnp.float32, layout=layout, stacked=True).k[0]
    new = jax.random.normal(jax.random.key(3), (5, CFG.num_kv_heads, CFG.head_dim))
    slots = jnp.asarray([4, 5, 13, 31, 1000], jnp.int32)  # 1000: past the pool
    got = write_kv(stacked, new, slots, layout, layer=jnp.int32(2))
    want = write_kv(stacked[2], new, slots, layout)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want))
    for i in (0, 1, 3):
        assert not np.asarray(got[i]).any()


def test_layer_view_keeps_packed_kernel_weights_stacked(cpu_kernels_library):
    """Inside the loop, packed bf16 copies stay [L, ...] and carry the layer index (the C++
    kernel reads them in place); norms are sliced."""
    params = dual_precision_params(init_params(CFG, jax.random.key(4), scale=0.3), 1, packed=True)
    stacked = stack_layers(params.layers)
    lp = layer_view(stacked, jnp.int32(1))
    assert lp.w_down.w_copy.shape[0] == CFG.num_layers and int(lp.w_down.layer) == 1
    np.testing.assert_array_equal(np.asarray(lp.mlp_norm), np.asarray(params.layers[1].mlp_norm))


def test_stacking_with_donate_frees_the_packed_per_layer_arrays(cpu_kernels_library):
    """donate (the engine's build): each packed weight's per-layer arrays are deleted once
    stacked, so the weights are not held twice; the other leaves are left alone; the stack
    holds each layer's values."""
    params = dual_precision_params(init_params(CFG, jax.random.key(8), scale=0.3), 1, packed=True)
    want = np.asarray(params.layers[2].w_down.w_copy)
    stacked = stack_layers(params.layers, donate=True)
    assert all(lp.w_down.w_copy.is_deleted() for lp in params.layers)
    assert not any(lp.mlp_norm.is_deleted() for lp in params.layers)
    np.testing.assert_array_equal(np.asarray(stacked.layers.w_down.w_copy[2]), want)


def test_why_not_loop_names_the_reason():
    params = init_params(CFG, jax.random.key(5), scale=0.3)
    assert why_not_loop(params.layers) is None
    odd = list(params.layers)
    odd[2] = dataclasses.replace(odd[2], mlp_norm=odd[2].mlp_norm.astype(jnp.bfloat16))
    assert "layer 2 has other weight shapes or dtypes" in why_not_loop(tuple(odd))
    dual = dual_precision_params(params, 4)  # f32 weights kept beside their bf16 copies
    assert "bf16 weight copies are kept beside f32 ones" in why_not_loop(dual.layers)
    with pytest.raises(ValueError, match="cannot run as a loop: layer 2"):
        stack_layers(tuple(odd))


def test_loop_layers_is_auto_true_or_false(cpu_kernels_library, tmp_path):
    """CompilationConfig.layer_loop: None stacks where it runs and reads every projection
    in place (the C++ attention on one device, packed kernel weights), and leaves the
    layers unrolled elsewhere (f32 weights in XLA's matmuls would be copied out of the
    stack every step); True stacks wherever it can run and raises ConfigError naming why
    not; False never stacks."""
    from jaxserve.worker.kernel_selection import loop_layers
    params = init_params(CFG, jax.random.key(6), scale=0.3)
    packed = dual_precision_params(params, 1, packed=True)
    cpu, xla = Kernels("cpu", "cpu"), Kernels("xla", "xla")
    looped, on = loop_layers(packed, None, cpu, 1)
    assert on and isinstance(looped.layers, StackedLayers) and looped.layers.num_layers == 4
    assert loop_layers(params, None, cpu, 1) == (params, False)  # XLA's f32 matmuls
    looped, on = loop_layers(params, True, cpu, 1)
    assert on and isinstance(looped.layers, StackedLayers)
    assert loop_layers(packed, None, xla, 1) == (packed, False)
    assert loop_layers(packed, None, cpu, 2) == (packed, False)
    assert loop_layers(packed, False, cpu, 1) == (packed, False)
    with pytest.raises(ConfigError, match="layer_loop=True: attention 'xla'"):
        loop_layers(params, True, xla, 1)
    with pytest.raises(ConfigError, match="layer_loop=True: 2 devices"):
        loop_layers(params, True, cpu, 2)


def test_stacked_layers_need_a_stacked_pool():
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.transformer import forward
    params = _looped(init_params(CFG, jax.random.key(7), scale=0.3))
    batch = StepBatch(tokens=np.zeros(1, np.int32), positions=np.zeros(1, np.int32),
                      slot_mapping=np.ones(1, np.int32), block_tables=np.ones((1, 1), np.int32),
                      seq_lens=np.ones(1, np.int32), query_start=np.arange(2, dtype=np.int32),
                      logits_indices=np.zeros(1, np.int32), decode=True)
    with pytest.raises(ValueError, match="stacked layers need a stacked KV pool"):
        forward(params, init_kv_cache(CFG, 4, 16, jnp.float32), batch, CFG)


@pytest.mark.full  # fast tier: the tiny model's loop gives the unrolled logits (above), and
# the served default runs its layers as a loop on the real model (tests/test_gguf_serving.py)
def test_real_model_engine_runs_the_loop_with_the_unrolled_tokens(small_llm, smollm2_checkpoint,
                                                                  cache_dir):
    """The tests' small SmolLM2 engine (C++ attention, f32 weights in the C++ matmul's f32
    panels, one device) runs its layers as a loop by default (every projection is read
    at the loop's layer in place), with the greedy tokens and log-probabilities of the
    same engine unrolled (layer_loop=False). (The default config's packed Q4_1 blocks loop
    too: tests/test_gguf_serving.py.)"""
    from pathlib import Path
    from jaxserve.api import LLM
    from jaxserve.config import load_config
    from jaxserve.engine.builder import build_engine
    from jaxserve.sampling_params import SamplingParams

    looped = small_llm
    assert isinstance(looped.engine.runner.params.layers, StackedLayers)
    assert looped.engine.runner.cache.stacked
    base = load_config(Path(__file__).parent / "configs" / "smollm2_small.py")
    unrolled = LLM(engine=build_engine(base.override(layer_loop=False), cache_dir, warmup=False))
    runner = unrolled.engine.runner
    assert isinstance(runner.params.layers, tuple) and not runner.cache.stacked
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    prompts = ["The capital of France is", "def add(a, b):"]
    want = unrolled.generate(prompts, sp)
    got = looped.generate(prompts, sp)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_array_equal([x.logprob for x in g.logprobs],
                                      [x.logprob for x in w.logprobs])
