"""GGUF weights served in their own blocks (Config.quantization "gguf",
ModelConfig.weight_formats): the param tree's GGMLWeight leaves, the model over them
(projections, embedding lookup, tied and untied heads) against the same model over their
dequantised floats, conversion of the real model's file keeping its blocks, the engine on
them, and the errors of what cannot be served that way."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model.ggml_weight import GGMLWeight, dequantize
from jaxserve.model.params import PROJECTIONS, abstract_params, init_params, param_count
from model_utils import PagedDriver, dense_reference_logits, tiny_config
from served_formats import (NEXT_TOKEN_PROMPTS, ONE_ROUNDING_KL, XLA_F32, accuracy_window,
                             assert_close_distributions, assert_same_next_tokens)
from tools import quant_accuracy

# every format, per-layer overrides, dims multiples of the 32-wide blocks
FORMATS = (("embed", "q8_0"), ("wq", "q4_1"), ("wk", "q4_0"), ("wv", "q8_0"), ("wo", "q4_1"),
           ("w_gate", "q4_0"), ("w_up", "q4_1"), ("w_down", "q4_1"), ("layers.1.w_down", "q8_0"),
           ("layers.0.wq", "q8_0"))


def _cfg(**kw) -> ModelConfig:
    return tiny_config(hidden_size=64, intermediate_size=96, head_dim=16, **kw)


def dequantised(params, cfg: ModelConfig):
    """The float params (our layouts, f32) the GGMLWeight leaves of `params` stand for."""
    def floats(w, n_in=None):
        if not isinstance(w, GGMLWeight):
            return w
        x = dequantize(w)  # [out, in]
        return x if n_in is None else x.T.reshape(w.logical_shape)

    layers = tuple(dataclasses.replace(lp, **{n: floats(getattr(lp, n), k)
                                              for n, k in PROJECTIONS.items()})
                   for lp in params.layers)
    head = params.lm_head
    return dataclasses.replace(params, embed=floats(params.embed), layers=layers,
                               lm_head=floats(head).T if isinstance(head, GGMLWeight) else head)


@pytest.mark.parametrize("tied", [True, False])
def test_block_weights_run_as_their_dequantised_floats(tied):
    """Prefill then decode over a paged pool with GGMLWeight projections (each format, a
    layer's own over the common one), embedding and LM head, against the plain dense
    model over the dequantised floats: the blocks' layouts ([out, in] rows standing for
    [*in, *out]; vocab-major tables) are the float weights'."""
    formats = FORMATS + ((("lm_head", "q4_0"),) if not tied else ())
    cfg = _cfg(tie_word_embeddings=tied, weight_formats=formats)
    params = init_params(cfg, jax.random.key(3), scale=0.2)
    assert isinstance(params.layers[0].wq, GGMLWeight) and params.layers[0].wq.fmt == "q8_0"
    assert params.layers[1].wq.fmt == "q4_1" and params.layers[1].w_down.fmt == "q8_0"
    assert isinstance(params.embed, GGMLWeight) and (params.lm_head is None) == tied
    floats = dequantised(params, cfg)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 19).tolist()
    ref = dense_reference_logits(floats, cfg.replace(weight_formats=()), ids)
    assert np.abs(ref).max() > 0.5  # the random blocks give logits that tell tokens apart
    drv = PagedDriver(params, cfg, page_size=4)
    got = [drv.step({"s": ids[:10]}, T=16, P=8)["s"]]
    for t in ids[10:]:
        got.append(drv.step({"s": [t]}, T=1, P=8)["s"])
    np.testing.assert_allclose(np.concatenate(got), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("formats", [
    (("embed", "q8_0"), *((n, "q4_1") for n in PROJECTIONS)),  # SmolLM2's: all fused
    FORMATS,  # wq | wk | wv and w_gate | w_up of mixed formats: kept apart
])
def test_cpp_kernel_fuses_the_projections_of_one_input_and_sums_the_same(cpu_kernels_library,
                                                                        formats):
    """pack_ggml_params with `fuse`: a layer's wq | wk | wv and w_gate | w_up in one
    format become one FusedWeight of their panels (one x quantisation, one kernel call),
    giving the unfused C++ path's logits exactly (the same x blocks, integer dots and
    scales per output column); parts of different formats stay apart."""
    from jaxserve.model.weight_layouts import FusedWeight, pack_ggml_params
    from jaxserve.model.transformer import Kernels
    cfg = _cfg(weight_formats=formats)
    params = init_params(cfg, jax.random.key(5), scale=0.2)
    fused, apart = pack_ggml_params(params), pack_ggml_params(params, fuse=False)
    mixed = formats is FORMATS
    for lp in fused.layers:
        assert isinstance(lp.wq, FusedWeight) != mixed and (lp.wk is None) != mixed
        assert isinstance(lp.w_gate, FusedWeight) != mixed and (lp.w_up is None) != mixed
        assert isinstance(lp.wo, GGMLWeight) and lp.wo.packed
    assert isinstance(apart.layers[0].wq, GGMLWeight) and apart.layers[0].wq.packed
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 13).tolist()

    def run(p):
        drv = PagedDriver(p, cfg, page_size=4, kernels=Kernels(matmul="cpu"))
        out = [drv.step({"s": ids[:9]}, T=16, P=8)["s"]]
        return np.concatenate(out + [drv.step({"s": [t]}, T=1, P=8)["s"] for t in ids[9:]])
    got, want = run(fused), run(apart)
    np.testing.assert_array_equal(got, want)  # the unfused C++ path: test_cpu_kernel_ggml_matmul


def test_fused_panels_are_grouped_per_shard():
    """Under tensor parallelism (shards devices splitting the output rows) a fused GGML
    weight holds shard 0's panels of every part, then shard 1's, ...: a contiguous split
    gives each device its own parts, in order, as `fused_weight` groups float columns.
    Parts whose panels do not split over the shards, or of different formats, are not
    fused."""
    from jaxserve.model.ggml_weight import pack_for_cpu
    from jaxserve.model.weight_layouts import fused_ggml_weight
    cfg = _cfg(weight_formats=tuple((n, "q4_1") for n in PROJECTIONS))
    lp = init_params(cfg, jax.random.key(6), scale=0.2).layers[0]
    q, k, v = (pack_for_cpu(w) for w in (lp.wq, lp.wk, lp.wv))
    assert [w.qs.shape[0] for w in (q, k, v)] == [4, 2, 2]  # panels of 16 rows
    f = fused_ggml_weight([q, k, v], shards=2)
    assert f.shards == 2
    assert f.out_shapes == tuple((w.shape[1] // 2, *w.shape[2:]) for w in (q, k, v))
    assert f.w.logical_shape == (64, sum(int(np.prod(w.shape[1:])) for w in (q, k, v)))
    halves = np.split(np.asarray(f.w.qs), 2)
    for i, half in enumerate(halves):
        want = np.concatenate([np.split(np.asarray(w.qs), 2)[i] for w in (q, k, v)])
        np.testing.assert_array_equal(half, want)
    assert fused_ggml_weight([q, k, v], shards=4) is None  # k's 2 panels over 4 devices
    q8 = pack_for_cpu(init_params(_cfg(weight_formats=(("wq", "q8_0"),)), jax.random.key(6),
                                  scale=0.2).layers[0].wq)
    assert fused_ggml_weight([q8, k, v]) is None
    assert fused_ggml_weight([lp.wq, lp.wk, lp.wv]) is None  # not packed


def test_abstract_tree_holds_the_blocks_bytes():
    """abstract_params: a q4_1 [out, in] matrix is 20 bytes per 32 weights (u8 quants, f16
    scale and minimum), q8_0 34; norms stay f32; param_count counts the weights the blocks
    stand for."""
    cfg = _cfg(tie_word_embeddings=True, weight_formats=(("embed", "q8_0"), ("wq", "q4_1")))
    tree = abstract_params(cfg)
    wq = tree.layers[0].wq
    assert (wq.qs.shape, wq.qs.dtype, wq.d.dtype, wq.m.shape) == (
        (64, 2, 16), jnp.uint8, jnp.float16, (64, 2))
    assert wq.logical_shape == (64, 4, 16)
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    assert nbytes(wq) == 64 * 64 // 32 * 20
    assert nbytes(tree.embed) == cfg.vocab_size * 64 // 32 * 34
    assert tree.layers[0].attn_norm.dtype == jnp.float32
    assert param_count(cfg) == param_count(cfg.replace(weight_formats=()))


def test_weight_formats_are_validated_and_round_trip():
    cfg = _cfg(weight_formats=FORMATS)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.weight_format("w_down", 1) == "q8_0" and cfg.weight_format("w_down", 0) == "q4_1"
    assert cfg.weight_format("embed") == "q8_0" and cfg.weight_format("lm_head") is None
    with pytest.raises(ConfigError, match="weight_formats: wq has format 'q5_0'"):
        _cfg(weight_formats=(("wq", "q5_0"),))
    with pytest.raises(ConfigError, match="no weight 'attn_norm'"):
        _cfg(weight_formats=(("attn_norm", "q8_0"),))
    with pytest.raises(ConfigError, match="no weight 'lm_head'"):  # tied: no head of its own
        _cfg(tie_word_embeddings=True, weight_formats=(("lm_head", "q8_0"),))


def test_deployments_that_cannot_serve_blocks_are_refused():
    from jaxserve.config import EngineConfig, KernelConfig, ParallelConfig, check_deployment
    cfg = _cfg(weight_formats=FORMATS)
    with pytest.raises(ConfigError, match="weight_quant='int8' re-quantises float weights"):
        check_deployment(EngineConfig(kernels=KernelConfig(weight_quant="int8")), cfg,
                         ParallelConfig())
    with pytest.raises(ConfigError, match="stacks the layers of a stage.*layers.1.w_down"):
        check_deployment(EngineConfig(), cfg, ParallelConfig(pipeline_parallel_size=2))
    # 4 heads x 16 over 4 devices: 16 columns of wo each, half a block
    with pytest.raises(ConfigError, match="16 input columns of wo are not whole 32-wide"):
        check_deployment(EngineConfig(), cfg.replace(num_kv_heads=4),
                         ParallelConfig(tensor_parallel_size=4))


# --- the real model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_checkpoint(smollm2_config, cache_dir):
    """The SmolLM2 GGUF converted keeping its blocks (as --quantization gguf does)."""
    from jaxserve.checkpoint.sources import resolve_checkpoint
    return resolve_checkpoint(smollm2_config.source, cache_dir, "gguf")


def test_real_model_converts_keeping_its_blocks(gguf_checkpoint, smollm2_checkpoint):
    """Every Q4_1 projection and the Q8_0 embedding kept as stored, dequantising bit for
    bit to the float checkpoint's weights in our layout (q / k rows un-permuted as whole
    rows), holding the file's bytes of them."""
    from jaxserve.checkpoint import load_model_config, load_params
    cfg = load_model_config(gguf_checkpoint)
    assert dict(cfg.weight_formats) == {"embed": "q8_0", **{n: "q4_1" for n in PROJECTIONS}}
    assert cfg.tie_word_embeddings and cfg.dtype == "float32"
    blocks = load_params(gguf_checkpoint, cfg)
    floats = load_params(smollm2_checkpoint, load_model_config(smollm2_checkpoint))
    got = dequantised(blocks, cfg)
    for i in (0, 17, 29):
        for name in PROJECTIONS:
            np.testing.assert_array_equal(np.asarray(getattr(got.layers[i], name)),
                                          np.asarray(getattr(floats.layers[i], name)),
                                          err_msg=f"layers[{i}].{name}")
    np.testing.assert_array_equal(np.asarray(got.embed), np.asarray(floats.embed))
    # loaded as stored: 20 bytes per 32 weights of Q4_1, 34 of Q8_0, norms f32 (~86 MB,
    # the f32 tree 540 MB)
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    proj = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * D
    want = L * ((proj + 3 * D * F) * 20 // 32 + 2 * D * 4) + V * D * 34 // 32 + D * 4
    assert nbytes(blocks) == want


@pytest.mark.full  # fast tier: the tiny model over blocks (XLA) and the real model's C++ path
def test_real_model_engine_on_blocks_gives_the_float_models_distributions(smollm2_gguf, cache_dir,
                                                                          float_outputs):
    """`LLM(model=the .gguf, quantization="gguf")` with XLA's matmuls against the same file
    dequantised to f32 (both XLA attention, f32 K/V): the same weights, so teacher-forced
    log-probabilities over the accuracy window equal up to f32 summation order (the
    blocks' matmul dequantises, then multiplies at HIGHEST precision; the float one is
    XLA's dot: measured equal here, and up to 2.3e-5 apart in engine decode steps; the
    bound 1e-3 is 40x that); a wrong block or row moves them by O(1)."""
    import jaxserve
    blocks = jaxserve.LLM("smollm2_135m", model=smollm2_gguf, quantization="gguf",
                          cache_dir=cache_dir, **XLA_F32)
    assert isinstance(blocks.engine.runner.params.layers[0].wq, GGMLWeight)
    logp, targets = quant_accuracy.next_token_logprobs(blocks, [accuracy_window(blocks)])
    ref_logp, ref_targets = float_outputs[1]
    np.testing.assert_array_equal(targets, ref_targets)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-3)


def test_quantization_gguf_needs_a_gguf_source(tmp_path, cache_dir, smollm2_checkpoint):
    from jaxserve.checkpoint import CheckpointError
    from jaxserve.checkpoint.sources import resolve_checkpoint
    from jaxserve.config import ModelSource
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(CheckpointError, match="gguf serves a GGUF file's own blocks; .*Hugging Face"):
        resolve_checkpoint(ModelSource(hf_dir=str(hf)), cache_dir, "gguf")
    with pytest.raises(CheckpointError, match="holds no quantised blocks"):
        resolve_checkpoint(ModelSource(checkpoint=str(smollm2_checkpoint)), cache_dir, "gguf")




def test_real_model_cpp_kernel_on_blocks_keeps_the_float_models_distributions(
        smollm2_gguf, cache_dir, float_outputs):
    """The default CPU engine with quantization="gguf": every matrix packed into the C++
    kernel's panels (x quantised per block to int8, as llama.cpp does; qkv and gate|up
    fused), against the same file dequantised to f32 in XLA: the same most likely next
    token of 8 prompts where the f32 model's is confident (its runner-up at a near-tie),
    and teacher-forced distributions over 383 positions of the accuracy text within
    ONE_ROUNDING_KL, confident positions unflipped (the f32 model's weights exactly: only
    x's rounding and bf16 K/V differ)."""
    import jaxserve
    from jaxserve import SamplingParams
    from jaxserve.model.layer_loop import StackedLayers
    from jaxserve.model.weight_layouts import FusedWeight
    llm = jaxserve.LLM("smollm2_135m", model=smollm2_gguf, quantization="gguf", warmup=False,
                       cache_dir=cache_dir, max_num_seqs=8)
    params = llm.engine.runner.params
    assert isinstance(params.layers, StackedLayers)  # the 30 layers run as a loop
    lp = params.layers.layers  # each leaf [30, ...]
    assert isinstance(lp.wq, FusedWeight) and lp.wk is None
    assert all(isinstance(w, GGMLWeight) and w.packed
               for w in (params.embed, lp.wq.w, lp.w_gate.w, lp.w_down))
    got = [c.token_ids[0] for c in llm.generate(NEXT_TOKEN_PROMPTS,
                                                SamplingParams(max_tokens=1, temperature=0.0))]
    assert_same_next_tokens(got, float_outputs)
    assert_close_distributions(llm, float_outputs, ONE_ROUNDING_KL)


@pytest.mark.full  # fast tier: Q8_0 blocks in the tiny model and the kernel's tests; Q4_1 here
def test_real_model_q8_0_file_served_in_its_blocks_stays_close(smollm2_gguf, cache_dir,
                                                               float_outputs):
    """A Q8_0 GGUF requantized from the Q4_1 file with gguf-py (whose quantiser matches
    llama.cpp's) served with quantization="gguf": every matrix a Q8_0 block weight in the
    C++ kernel, within twice ONE_ROUNDING_KL of the f32 model (two 8-bit roundings: the
    weights' and x's), confident positions unflipped."""
    import jaxserve
    llm = jaxserve.LLM("smollm2_135m", model=quant_accuracy.q8_0_gguf(smollm2_gguf, cache_dir),
                       quantization="gguf", warmup=False, cache_dir=cache_dir, max_num_seqs=8)
    assert dict(llm.engine.runner.model_cfg.weight_formats) == {
        "embed": "q8_0", **{n: "q8_0" for n in PROJECTIONS}}
    assert_close_distributions(llm, float_outputs, 2 * ONE_ROUNDING_KL)
