"""The engine's kernel choice (KernelConfig.attention_impl / matmul_impl / weight_quant).

- the model with the Pallas kernels in interpret mode gives the XLA path's logits
  (ragged prefill with padding, a continuation over cached pages, decode; quantised
  projections through the kernel vs through its reference); so does the C++ CPU
  attention kernel on a head-major pool, f32 or bf16; a bf16 pool stored as uint16 bits
  gives the Pallas kernels exactly what the same pool held as bfloat16 arrays does;
- "auto" picks the C++ kernel on one CPU device and falls back to XLA without a compiler;
- the real model: the engine with Pallas attention (interpret mode) produces the XLA
  engine's greedy tokens;
- every kernel call the engine can make (each warm-up shape of a config's buckets, f32
  and bf16, each quantised weight format) lowers for CUDA on this CPU machine, and so
  does a whole decode / prefill step with every kernel in use.
"""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import (ConfigError, EngineConfig, KernelConfig, load_config,
                             resolve_attention_impl, resolve_impl)
from jaxserve.worker.compilation import StepShapes
from jaxserve.model.kv_cache import abstract_kv_cache, num_pages_for_budget
from jaxserve.model.attention import PallasAttention
from jaxserve.model.params import abstract_params, init_params
from jaxserve.model.params import PROJECTIONS
from jaxserve.model.weight_layouts import QuantizedWeight, quantize_params
from jaxserve.model.transformer import Kernels
from model_utils import PagedDriver, tiny_config
from lowered_text import count_executed

TESTS = Path(__file__).resolve().parent

# GQA 3 like SmolLM2 (9 q / 3 kv heads there), head_dim 64, page_size 16.
CFG = tiny_config(hidden_size=64, intermediate_size=96, num_heads=6, num_kv_heads=2, head_dim=64)
F32_ATOL = 2e-5
# An f32 model of several layers: two correct attention kernels each put an output within the
# kernel tests' 2e-5 (relative to its unit-scale values) of the exact one, and the layers
# after it carry such an error on at about its relative size, so the logits agree to that
# fraction of the largest logit (~2e-4 here). Measured on an AVX2-only CPU (Zen 3, 2026-11-29)
# the C++ kernels (its portable loop and its AVX2 path alike) and XLA differed by 1.5-2.7e-5,
# 2-3e-6 of the largest logit: an absolute 2e-5 was the noise's own size there. A wrong
# mask, page or split merge is off by far more.
F32_LOGIT_RTOL_OF_MAX = 2e-5
QUANT_ATOL = 1e-4  # kernel vs reference on the same quantised weights: f32 sums in another order
# f32 activations over a bf16 pool: an f32 rounding difference in one layer's output (another
# summation order) can move the next layer's K/V to the neighbouring bf16 value, so two
# correct implementations agree only to bf16 precision: half a bf16 ulp (2^-9) of the
# largest logit. A wrong mask or page is off by far more.
BF16_KV_RTOL_OF_MAX = 2.0 ** -9
# Two attention kernels of a bf16 model (each output within 2 bf16 ulps of the exact one,
# their kernel tests) agree to 2 bf16 ulps (2 x 2^-7 relative) of the largest logit; a wrong
# page, mask or split merge is off by far more.
BF16_LOGIT_RTOL_OF_MAX = 2 * 2.0 ** -7


def _drive(params, kernels, steps, layout="token_major", kv_dtype=None, cfg=CFG,
           bf16_arrays=False):
    """Logits of `steps` on a fresh pool; bf16_arrays: a bf16 pool held as bfloat16 arrays
    instead of the uint16 bits jaxserve stores."""
    drv = PagedDriver(params, cfg, num_pages=24, page_size=16, seed=7, kernels=kernels,
                      layout=layout, kv_dtype=kv_dtype)
    if bf16_arrays:
        drv.cache = jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, jnp.bfloat16), drv.cache)
    return [drv.step(chunks, T=T, P=P) for chunks, T, P in steps]


def _steps(rng):
    ids = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()  # noqa: E731
    return [
        # packed prefill: 1, 20 and 33 tokens in T=64 rows (10 padding rows) with 3 pages
        # (48 slots) per block table
        ({"a": ids(1), "b": ids(20), "c": ids(33)}, 64, 3),
        # a continuation over cached pages (b: 20 -> 36 crosses a page boundary)
        ({"c": ids(5), "b": ids(16)}, 32, 4),
        # decode steps
        ({"a": ids(1), "b": ids(1), "c": ids(1)}, 3, 4),
        ({"a": ids(1), "b": ids(1), "c": ids(1)}, 3, 4),
    ]


def _assert_same(got, want, atol):
    for g_step, w_step in zip(got, want, strict=True):
        for name in w_step:
            assert np.isfinite(g_step[name]).all()
            np.testing.assert_allclose(g_step[name], w_step[name], atol=atol, rtol=1e-5, err_msg=name)


def test_pallas_attention_in_the_model_matches_xla():
    params = init_params(CFG, jax.random.key(0), scale=0.3)
    steps = _steps(np.random.default_rng(1234))
    want = _drive(params, Kernels("xla", "xla"), steps)
    got = _drive(params, Kernels("pallas_interpret", "xla"), steps)
    _assert_same(got, want, F32_LOGIT_RTOL_OF_MAX * max(np.abs(w[n]).max() for w in want for n in w))


@pytest.mark.full  # fast tier: each Mosaic kernel against its reference, and the engine
def test_mosaic_attention_in_the_model_matches_triton():  # step with them lowered for CUDA
    """A bf16 model with "pallas_mosaic_interpret" attention (the Mosaic GPU prefill and
    decode kernels) gives the Triton kernels' logits to bf16 precision in every step: packed
    prefill with padding rows, a continuation over cached pages, decode (the two round p
    and their outputs to bf16 at different points: an attention output one bf16 ulp apart,
    carried through the bf16 layers)."""
    cfg = CFG.replace(dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    steps = _steps(np.random.default_rng(99))
    want = _drive(params, Kernels("pallas_interpret", "xla"), steps, cfg=cfg)
    got = _drive(params, Kernels("pallas_mosaic_interpret", "xla"), steps, cfg=cfg)
    for g_step, w_step in zip(got, want, strict=True):
        for name in w_step:
            assert np.isfinite(g_step[name]).all()
            np.testing.assert_allclose(g_step[name], w_step[name], rtol=0,
                                       atol=BF16_LOGIT_RTOL_OF_MAX * np.abs(w_step[name]).max(),
                                       err_msg=name)


def test_pallas_attention_reads_a_bf16_bits_pool_as_bf16():
    """A bf16 model over a bf16 pool stored as uint16 bits (the kernels get the bf16 view)
    gives exactly the logits of the same pool held as bfloat16 arrays."""
    cfg = CFG.replace(dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    steps = _steps(np.random.default_rng(4321))
    kernels = Kernels("pallas_interpret", "xla")
    got = _drive(params, kernels, steps, cfg=cfg)
    want = _drive(params, kernels, steps, cfg=cfg, bf16_arrays=True)
    for g_step, w_step in zip(got, want, strict=True):
        for name in w_step:
            assert np.isfinite(g_step[name]).all()
            np.testing.assert_array_equal(g_step[name], w_step[name], err_msg=name)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_cpu_attention_in_the_model_matches_xla(kv_dtype, cpu_kernels_library):
    """The C++ kernel behind the model (head-major pool, f32 or bf16 bits): ragged prefill
    with padding rows and padding queries, a continuation, decode; the same logits as the
    XLA path."""
    params = init_params(CFG, jax.random.key(0), scale=0.3)
    steps = _steps(np.random.default_rng(99))
    want = _drive(params, Kernels("xla", "xla"), steps, layout="head_major", kv_dtype=kv_dtype)
    got = _drive(params, Kernels("cpu", "xla"), steps, layout="head_major", kv_dtype=kv_dtype)
    largest = max(np.abs(w[n]).max() for w in want for n in w)
    _assert_same(got, want, (F32_LOGIT_RTOL_OF_MAX if kv_dtype == "float32"
                             else BF16_KV_RTOL_OF_MAX) * largest)
    with pytest.raises(ValueError, match="reads only the head_major KV layout"):
        _drive(params, Kernels("cpu", "xla"), steps[:1])


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "int8"])
def test_kernels_read_the_narrow_pools_as_xla_does(kv_dtype, cpu_kernels_library):
    """An fp8 pool (uint8 bits, scale 1) and an int8 pool (rows carrying their scales)
    behind the model: the Pallas kernels (token-major pool) and the C++ kernel (head-major)
    give the XLA path's logits on the same pool within f32 summation order. One layer: its
    K/V come from the embeddings alone, so every implementation writes the same pool bits
    (with more layers an attention output one f32 ulp apart may round the next layer's
    K/V to the neighbouring 8-bit value). Ragged prefill with padding, a continuation over
    cached pages, decode."""
    cfg = CFG.replace(num_layers=1)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    steps = _steps(np.random.default_rng(77))
    for layout, impl in (("token_major", "pallas_interpret"), ("head_major", "cpu")):
        want = _drive(params, Kernels("xla", "xla"), steps, layout=layout, kv_dtype=kv_dtype,
                      cfg=cfg)
        got = _drive(params, Kernels(impl, "xla"), steps, layout=layout, kv_dtype=kv_dtype,
                     cfg=cfg)
        _assert_same(got, want, F32_ATOL)
        f32 = _drive(params, Kernels("xla", "xla"), steps, layout=layout, cfg=cfg)
        assert max(np.abs(g[n] - w[n]).max() for g, w in zip(got, f32) for n in w) > F32_ATOL


def test_select_kernels_auto_and_fallback(monkeypatch, tmp_path, cpu_kernels_library):
    from jaxserve.kernels.cpu import build
    from jaxserve.worker.kernel_selection import select_kernels

    auto = KernelConfig()
    assert select_kernels(auto, "cpu", 1, "float32", tmp_path) == Kernels("cpu", "xla", "cpu")
    # a TP mesh: each device runs the C++ attention on its heads; logits are split over
    # the vocabulary there, so the sampler's reductions are XLA's
    assert select_kernels(auto, "cpu", 2, "float32", tmp_path) == Kernels("cpu", "xla", "xla")
    assert select_kernels(auto, "cpu", 1, "bfloat16", tmp_path) == Kernels("cpu", "xla", "cpu")
    assert select_kernels(auto, "cpu", 1, "float16", tmp_path) == Kernels("xla", "xla", "cpu")
    # (on a GPU the host decides the sampler's branches: test_branches_are_decided_...)
    gpu = functools.partial(Kernels, host_branches=True)
    assert select_kernels(auto, "gpu", 1, "float32", tmp_path) == gpu("pallas", "pallas")
    # Hopper's quantised matmul and decode attention are the Mosaic GPU kernels; Ampere's
    # and Blackwell's Triton
    assert (select_kernels(auto, "gpu", 1, "float32", tmp_path, "9.0")
            == gpu("pallas_mosaic", "pallas_mosaic"))
    for other in ("8.0", "10.0"):
        assert select_kernels(auto, "gpu", 1, "float32", tmp_path, other) == gpu("pallas", "pallas")
    # weight_quant's per-channel int8 / fp8 weights: XLA's dot of the widened weight (faster
    # on an H200 than either kernel); group scales, an explicit impl and CPUs keep theirs
    for fmt in ("int8", "fp8_e4m3"):
        quant = KernelConfig(weight_quant=fmt)
        for cc in ("9.0", "8.0"):
            assert select_kernels(quant, "gpu", 1, "bfloat16", tmp_path, cc).matmul.name == "xla"
    grouped = KernelConfig(weight_quant="int8", weight_quant_group_size=128)
    assert (select_kernels(grouped, "gpu", 1, "bfloat16", tmp_path, "9.0").matmul.name
            == "pallas_mosaic")
    named = KernelConfig(weight_quant="int8", matmul_impl="pallas")
    assert select_kernels(named, "gpu", 1, "bfloat16", tmp_path, "9.0").matmul.name == "pallas"
    bf16 = KernelConfig(bf16_matmul_min_rows=1)  # the bf16 weight copies go to the C++ kernel
    assert select_kernels(bf16, "cpu", 1, "float32", tmp_path) == Kernels("cpu", "cpu", "cpu")
    assert select_kernels(bf16, "cpu", 2, "float32", tmp_path) == Kernels("cpu", "cpu", "xla")
    xla_sampler = KernelConfig(sampling_impl="xla")
    assert select_kernels(xla_sampler, "cpu", 1, "float32", tmp_path) == Kernels("cpu", "xla")
    with pytest.raises(ConfigError, match="sampling_impl='cpu' reads whole logits rows on one "
                                          "device; the mesh has 2"):
        select_kernels(KernelConfig(sampling_impl="cpu"), "cpu", 2, "float32", tmp_path)
    explicit = KernelConfig(attention_impl="cpu")
    assert select_kernels(explicit, "cpu", 2, "float32", tmp_path) == Kernels("cpu", "xla", "xla")
    with pytest.raises(ConfigError, match="'cpu' reads a KV pool of float32 or bfloat16 or "
                                          "float8_e4m3fn or int8, kv_dtype is float16"):
        select_kernels(explicit, "cpu", 1, "float16", tmp_path)
    # fp8 and int8 pools (int8 rows with their scales): the C++ and the Pallas (Triton)
    # kernels read them
    for narrow in ("float8_e4m3fn", "int8"):
        assert select_kernels(auto, "cpu", 1, narrow, tmp_path).attention.name == "cpu"
        assert select_kernels(auto, "gpu", 1, narrow, tmp_path).attention.name == "pallas"
        assert select_kernels(KernelConfig(attention_impl="pallas"), "gpu", 1, narrow,
                              tmp_path).attention.name == "pallas"

    def no_compiler(build_dir, compiler=None):
        raise build.KernelBuildError("no C++ compiler found")

    monkeypatch.setattr(build, "load_library", no_compiler)
    assert select_kernels(auto, "cpu", 1, "float32", tmp_path) == Kernels("xla", "xla")
    assert select_kernels(bf16, "cpu", 1, "float32", tmp_path) == Kernels("xla", "xla")
    with pytest.raises(ConfigError, match="sampling_impl='cpu': no C"):
        select_kernels(KernelConfig(sampling_impl="cpu"), "cpu", 1, "float32", tmp_path)
    with pytest.raises(ConfigError, match="matmul_impl='cpu': no C"):
        select_kernels(KernelConfig(bf16_matmul_min_rows=1, matmul_impl="cpu"), "cpu", 1,
                       "float32", tmp_path)
    with pytest.raises(ConfigError, match="attention_impl='cpu': no C\\+\\+ compiler found"):
        select_kernels(explicit, "cpu", 1, "float32", tmp_path)


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int8", 32), ("fp8_e4m3", None)])
def test_quantized_projections_kernel_matches_reference_in_the_model(fmt, group, monkeypatch):
    params = init_params(CFG, jax.random.key(1), scale=0.3)
    qparams = quantize_params(params, fmt, group)
    w = qparams.layers[0].wo
    assert isinstance(w, QuantizedWeight) and w.shape == params.layers[0].wo.shape
    assert all(isinstance(getattr(l, n), QuantizedWeight) for l in qparams.layers for n in PROJECTIONS)
    steps = _steps(np.random.default_rng(fmt == "int8"))[:3]
    want = _drive(qparams, Kernels("xla", "xla"), steps)
    got = _drive(qparams, Kernels("xla", "pallas_interpret"), steps)
    _assert_same(got, want, QUANT_ATOL)
    # the CUDA-core GEMV for steps of at most 4 rows (matmul_impl "pallas_gemv": the
    # 3-row decode step), the tiled dot for the rest (the prompts' 64 and 32 rows)
    import jaxserve.kernels.pallas.quantized_matmul as qmm
    seen, kernel = set(), qmm.quantized_matmul

    def spy(x, *args, gemv="dot", **kw):
        seen.add((x.shape[0], gemv))
        return kernel(x, *args, gemv=gemv, **kw)

    monkeypatch.setattr(qmm, "quantized_matmul", spy)
    got = _drive(qparams, Kernels("xla", "pallas_gemv_interpret"), steps)
    _assert_same(got, want, QUANT_ATOL)
    assert seen == {(64, "dot"), (32, "dot"), (3, "reduce_magic")}, seen
    # and the quantised model differs from the float one, but only by quantisation noise:
    # relative RMS error of all logits, measured 0.04-0.06 for int8 and 0.17-0.22 for fp8
    # e4m3 (3 mantissa bits) over seeds on this random model
    dense = _drive(params, Kernels("xla", "xla"), steps)
    diff = np.concatenate([(w_[n] - d[n]).ravel() for w_, d in zip(want, dense) for n in d])
    ref = np.concatenate([d[n].ravel() for d in dense for n in d])
    rel_rms = np.sqrt(np.mean(diff ** 2) / np.mean(ref ** 2))
    assert 0 < rel_rms < (0.1 if fmt == "int8" else 0.35), rel_rms


def test_impl_config_validation_and_auto():
    assert resolve_impl("auto", "cpu") == "xla" and resolve_impl("auto", "gpu") == "pallas"
    assert resolve_impl("auto", "gpu", "9.0") == "pallas_mosaic"
    assert resolve_impl("auto", "cpu", "9.0") == "xla" and resolve_impl("pallas", "gpu", "9.0") == "pallas"
    assert KernelConfig(matmul_impl="pallas_mosaic").matmul_impl == "pallas_mosaic"
    assert resolve_impl("pallas_interpret", "cpu") == "pallas_interpret"
    assert resolve_attention_impl("auto", "cpu") == "cpu"
    assert resolve_attention_impl("auto", "gpu") == "pallas"
    assert resolve_attention_impl("auto", "gpu", "8.0") == "pallas"
    assert resolve_attention_impl("auto", "gpu", "9.0") == "pallas_mosaic"
    assert resolve_attention_impl("auto", "gpu", "10.0") == "pallas"  # Blackwell: no wgmma
    assert resolve_attention_impl("auto", "cpu", "9.0") == "cpu"
    assert KernelConfig(attention_impl="pallas_mosaic").attention_impl == "pallas_mosaic"
    assert resolve_attention_impl("xla", "cpu") == "xla"
    for kw, match in [({"attention_impl": "triton"}, "attention_impl must be one of"),
                      ({"matmul_impl": "cuda"}, "matmul_impl must be one of"),
                      ({"weight_quant": "int4"}, "weight_quant must be None or one of"),
                      ({"weight_quant": "fp8_e4m3", "weight_quant_group_size": 128}, "needs weight_quant='int8'"),
                      ({"weight_quant": "int8", "weight_quant_group_size": 48}, "power of two >= 16")]:
        with pytest.raises(ConfigError, match=match):
            KernelConfig(**kw)


# --- the real model ------------------------------------------------------------------------

def test_real_model_pallas_attention_gives_the_xla_greedy_tokens(small_llm, smollm2_checkpoint, cache_dir):
    from jaxserve.api import LLM
    from jaxserve.engine.builder import build_engine
    from jaxserve.sampling_params import SamplingParams

    base = load_config(TESTS / "configs" / "smollm2_small.py")
    # Only the two shapes this prompt needs (prefill B=1 Q=32, decode B=1), compiled on use.
    # decode_steps None (auto): the builder chooses for the platform, 1 on CPU
    cfg = dataclasses.replace(base, engine=base.engine.override(attention_impl="pallas_interpret",
                                                                decode_steps=None))
    llm = LLM(engine=build_engine(cfg, cache_dir, warmup=False))
    assert llm.engine.runner.kernels == Kernels("pallas_interpret", "cpu", "cpu")  # f32 panels
    assert llm.engine.engine_config.scheduler.decode_steps == 1
    sp = SamplingParams(temperature=0, max_tokens=5)
    prompt = "The capital of France is"
    want = small_llm.generate([prompt], sp)[0]
    got = llm.generate([prompt], sp)[0]
    assert got.token_ids == want.token_ids, (got.text, want.text)
    assert len(got.token_ids) == 5


# --- CUDA lowering of every kernel call the engine can make ----------------------------------

def _lower(fn, *specs, call: str = "xla.gpu.triton") -> str:
    text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert call in text
    return text


def _kernel_calls(model_cfg, ecfg: EngineConfig, dtype):
    """{key: (fn, specs, custom call)} for every distinct kernel call the engine's warm-up
    shapes make: Triton's, and on Hopper the Mosaic GPU kernels where they take them.

    Mosaic prefill: the kernel's body depends on block_kv (with dtype, head_dim, GQA group
    and page size, fixed per model), not on the step's tokens, batch or table width (grid
    and operand shapes; the tile gather around it is XLA's): it is lowered at the smallest
    and the largest mixed step of each block_kv (a lowering takes ~0.5 s, and a model has
    ~50 mixed shapes)."""
    from jaxserve.kernels.pallas.flash_attention import flash_attention
    from jaxserve.kernels.pallas.paged_attention import paged_attention
    from jaxserve.kernels.pallas.attention_mosaic import default_block_kv, mosaic_attention_supports
    from jaxserve.kernels.pallas.flash_attention_mosaic import flash_attention_mosaic
    from jaxserve.kernels.pallas.paged_attention_mosaic import paged_attention_mosaic

    S = jax.ShapeDtypeStruct
    H, K, Dh, ps = model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, ecfg.cache.page_size
    n = num_pages_for_budget(model_cfg, ps, dtype, ecfg.cache.kv_cache_memory_bytes)
    pages = S((n, ps, K, Dh), dtype)
    i32 = jnp.int32
    calls = {}
    shapes = StepShapes(ecfg, bucket_pages=PallasAttention().pads_pages).warmup()
    mosaic = mosaic_attention_supports(dtype, dtype, Dh, ps, H // K)
    mixed = sorted((T, B, P) for kind, T, B, P, *_ in shapes if kind not in ("sample", "decode"))
    by_block = {}
    for T, B, P in mixed:
        by_block.setdefault(default_block_kv(P * ps, ps), []).append((T, B, P))
    mosaic_mixed = {s for group in by_block.values() for s in (group[0], group[-1])}
    for kind, T, B, P, *_ in shapes:
        if kind == "sample":  # the sampler program calls no kernel
            continue
        if kind == "decode":
            specs = (S((B, H, Dh), dtype), pages, pages, S((B, P), i32), S((B,), i32))
            calls[("decode", B, P)] = (functools.partial(paged_attention, impl="pallas"), specs,
                                       "xla.gpu.triton")
            if mosaic:
                calls[("decode-mosaic", B, P)] = (
                    functools.partial(paged_attention_mosaic, impl="pallas_mosaic"), specs,
                    "mosaic_gpu")
        else:
            specs = (S((T, H, Dh), dtype), pages, pages, S((B, P), i32), S((B + 1,), i32),
                     S((B,), i32))
            calls[("mixed", T, B, P)] = (functools.partial(flash_attention, impl="pallas"),
                                         specs, "xla.gpu.triton")
            if mosaic and (T, B, P) in mosaic_mixed:
                calls[("mixed-mosaic", T, B, P)] = (
                    functools.partial(flash_attention_mosaic, impl="pallas_mosaic"), specs,
                    "mosaic_gpu")
    return calls


def _matmul_calls(model_cfg, ecfg: EngineConfig, dtype):
    from jaxserve.kernels.pallas.quantized_matmul import quantized_matmul

    S = jax.ShapeDtypeStruct
    layer = abstract_params(model_cfg).layers[0]
    ms = sorted({T for kind, T, *_ in StepShapes(ecfg).warmup() if kind != "sample"})
    calls = {}
    for fmt, group in (("int8", None), ("int8", 128), ("fp8_e4m3", None)):
        wdt = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
        for name, n_in in PROJECTIONS.items():
            shape = getattr(layer, name).shape
            k, nout = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
            g = None if group is None else (group if k % group == 0 else 64)  # SmolLM2: K = 576
            scales = S((nout,), jnp.float32) if g is None else S((k // g, nout), jnp.float32)
            for m in ms:
                calls[(fmt, group, k, nout, m)] = (functools.partial(quantized_matmul, impl="pallas"),
                                                   (S((m, k), dtype), S((k, nout), wdt), scales))
    return calls


def _configs(smollm2_checkpoint):
    from jaxserve.checkpoint import load_model_config
    default = load_config(TESTS.parent / "configs" / "smollm2_135m.py")
    llama = load_config(TESTS.parent / "configs" / "llama3_8b.py")
    # the step shapes a GPU engine warms up (decode_steps None chosen for the GPU, as the
    # engine builder does)
    gpu = dataclasses.replace(llama.engine, scheduler=llama.engine.scheduler.resolve("gpu"))
    return {"smollm2_135m": (load_model_config(smollm2_checkpoint), default.engine),
            "llama3_8b": (llama.model, gpu)}


# fast tier: each kernel's own lowering at engine shapes (tests/test_kernel_*), the whole step's
@pytest.mark.full
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_engine_attention_call_lowers_for_cuda(smollm2_checkpoint, dtype, cuda_lowering):
    total = mosaic = 0
    for name, (model_cfg, ecfg) in _configs(smollm2_checkpoint).items():
        for key, (fn, specs, call) in _kernel_calls(model_cfg, ecfg, jnp.dtype(dtype)).items():
            _lower(fn, *specs, call=call)
            total += 1
            mosaic += call == "mosaic_gpu"
    assert total > 40 and (mosaic > 10) == (dtype == "bfloat16")


def test_every_engine_quantized_matmul_call_lowers_for_cuda(smollm2_checkpoint, cuda_lowering):
    model_cfg, ecfg = _configs(smollm2_checkpoint)["smollm2_135m"]
    calls = _matmul_calls(model_cfg, ecfg, jnp.bfloat16)
    for key, (fn, specs) in calls.items():
        _lower(fn, *specs)
    assert len(calls) >= 3 * len(PROJECTIONS)


@pytest.mark.parametrize("kind", ["decode", "mixed", "verify"])
def test_whole_engine_step_with_every_kernel_lowers_for_cuda(kind, cuda_lowering):
    """The jitted engine step of a SmolLM2-shaped model with Pallas attention and int8
    Pallas matmuls, bf16, lowered for CUDA: a one-token step's two programs (forward to
    the logits; sampling), a multi-step decode, a verify step (logits at every row,
    rejection sampling) of one round and of three."""
    from jaxserve.worker.compilation import StepKey, abstract_inputs, abstract_sample_inputs
    from jaxserve.worker.step import forward_step, model_step, sample_step, verify_step

    cfg = tiny_config(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                      num_layers=2, vocab_size=4096, dtype="bfloat16")
    params = jax.eval_shape(lambda p: quantize_params(p, "int8", 64), abstract_params(cfg))
    cache = abstract_kv_cache(cfg, 64, 16, jnp.bfloat16)
    key = {"decode": StepKey("decode", 8, 8, 16), "mixed": StepKey("mixed", 128, 2, 8),
           "verify": StepKey("verify", 10, 2, 8, 5)}[kind]
    batch, sampling, prev_index = abstract_inputs(key, None, 300, cfg.vocab_size)
    static = dict(cfg=cfg, drafter=None, rules=None, kernels=Kernels("pallas", "pallas"),
                  num_top=20)
    pool = jax.ShapeDtypeStruct((64 * 16,), jnp.int32)
    prev_tokens = jax.ShapeDtypeStruct((32,), jnp.int32)
    if kind == "verify":  # with the n-gram lookup of a step planned ahead of the last read
        text = _lower(functools.partial(verify_step, ngram=(1, 4), **static), params, cache,
                      batch, sampling, prev_tokens, prev_tokens, prev_index, None, None, pool)
        # verify_steps 3: the rounds in one loop, its kernels lowered once
        rounds = _lower(functools.partial(verify_step, ngram=(1, 4), rounds=3, **static),
                        params, cache, batch, sampling, prev_tokens, prev_tokens, prev_index,
                        None, None, pool)
        assert rounds.count("xla.gpu.triton") == 1 + 4
    else:
        text = _lower(functools.partial(forward_step, **static), params, cache, batch,
                      sampling.prompt_targets, prev_tokens, prev_index, None, None, pool)
        if kind == "decode":  # multi-step decode: forward and sampler in one loop
            multi = _lower(functools.partial(model_step, **static, num_steps=4), params,
                           cache, batch, sampling, prev_tokens, prev_index, None, None, pool)
            assert multi.count("xla.gpu.triton") == 1 + 4
        logits, smp, block_tables, num_context = abstract_sample_inputs(
            key.S, 16, None, None, 300, cfg.vocab_size)
        sampler = jax.jit(functools.partial(
            sample_step, page_size=16, max_rows=32, rules=None, kernels=static["kernels"],
            num_top=20)).trace(logits, smp, pool, block_tables, num_context)
        sampler.lower(lowering_platforms=("cuda",))
    # identical kernel calls are lowered once and shared: attention + the 4 distinct
    # projection shapes (576x576, 576x192, 576x1536, 1536x576)
    assert text.count("xla.gpu.triton") == 1 + 4


def test_gpu_step_programs_branch_only_on_the_host(cuda_lowering):
    """With host branches (KernelConfig.branches "auto" on a GPU) the programs of a decode
    step lower for CUDA without a conditional (`stablehlo.case`: XLA:GPU runs one as a
    host-side thunk that waits for the device; jaxserve.sample.plan): the decode
    forward, the sampler of every static plan, multi-step decode and the n-gram verify
    step of each of FUSED_PLANS; nor a mixed step's forward, its prompt logprobs a program
    of their own. With the device deciding, every one of them has one (what this check
    catches)."""
    from jaxserve.sample.plan import FUSED_PLANS, ON_DEVICE, sampler_plans
    from jaxserve.worker.compilation import StepKey, abstract_inputs, abstract_sample_inputs
    from jaxserve.worker.step import (forward_step, model_step, prompt_logprobs_step,
                                      sample_step, verify_step)

    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                      head_dim=32, num_layers=2, vocab_size=1024, dtype="bfloat16")
    params = abstract_params(cfg)
    cache = abstract_kv_cache(cfg, 64, 16, jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64 * 16,), jnp.int32)
    prev = jax.ShapeDtypeStruct((32,), jnp.int32)
    for host in (True, False):
        static = dict(cfg=cfg, drafter=None, rules=None, num_top=4,
                      kernels=Kernels("pallas", "xla", host_branches=host))
        texts = {}
        for kind, key in (("decode", StepKey("decode", 8, 8, 16)),
                          ("mixed", StepKey("mixed", 64, 2, 16))):
            batch, sampling, prev_index = abstract_inputs(key, None, 8, cfg.vocab_size)
            own = host and kind == "mixed"  # as Runner._own_prompt_logprobs
            texts[kind] = _lower(functools.partial(forward_step, keep_hidden=own, **static),
                                 params, cache, batch, None if own else sampling.prompt_targets,
                                 prev, prev_index, None, None, pool)
        if host:
            hidden = jax.ShapeDtypeStruct((64, cfg.hidden_size), jnp.bfloat16)
            texts["prompt logprobs"] = jax.jit(functools.partial(
                prompt_logprobs_step, rules=None, kernels=static["kernels"], num_top=4)).trace(
                params, hidden, jax.ShapeDtypeStruct((64,), jnp.int32)).lower(
                lowering_platforms=("cuda",)).as_text()
        batch, sampling, prev_index = abstract_inputs(StepKey("decode", 8, 8, 16), None, 8,
                                                      cfg.vocab_size)
        logits, smp, tables, num_context = abstract_sample_inputs(8, 16, None, None, 8,
                                                                  cfg.vocab_size)
        for plan in sampler_plans(4) if host else (ON_DEVICE,):
            texts[f"sample {plan}"] = jax.jit(functools.partial(
                sample_step, page_size=16, max_rows=32, rules=None, kernels=static["kernels"],
                num_top=4, plan=plan)).trace(logits, smp, pool, tables, num_context).lower(
                lowering_platforms=("cuda",)).as_text()
        vbatch, vsampling, vprev = abstract_inputs(StepKey("verify", 16, 4, 16, 4), None, 8,
                                                   cfg.vocab_size)
        for plan in FUSED_PLANS if host else (ON_DEVICE,):
            texts[f"multi-step {plan}"] = _lower(
                functools.partial(model_step, **static, num_steps=4, plan=plan), params,
                cache, batch, sampling, prev, prev_index, None, None, pool)
            texts[f"verify {plan}"] = _lower(
                functools.partial(verify_step, ngram=(1, 3), plan=plan, **static), params,
                cache, vbatch, vsampling, prev, prev, vprev, None, None, pool)
        for name, text in texts.items():
            assert min(text.count("stablehlo.case"), 1) == (not host), (host, name)
        if not host:  # prompt logprobs' and RoPE's
            assert texts["mixed"].count("stablehlo.case") == 2


def test_gpu_weights_run_each_layer_in_four_matmuls(cuda_lowering):
    """On a GPU (KernelConfig.fuse_projections "auto") a bf16 model's projections that
    share an input are stored fused: a decode step lowered for CUDA has four dots a layer
    (q | k | v, o, gate | up, down) and the LM head's, where unfused it has seven a layer:
    XLA:GPU would run the K and V products of one row as a multiply and a reduction at a
    fraction of a GEMM's bandwidth (jaxserve.model.weight_layouts.fuse_projections)."""
    from jaxserve.worker.compilation import StepKey, abstract_inputs
    from jaxserve.worker.kernel_selection import prepare_params, resolve_kernel_config
    from jaxserve.worker.step import forward_step

    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                      head_dim=32, num_layers=3, vocab_size=1024, dtype="bfloat16")
    kernels = Kernels("pallas", "xla", host_branches=True)
    cache = abstract_kv_cache(cfg, 64, 16, jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((64 * 16,), jnp.int32)
    prev = jax.ShapeDtypeStruct((32,), jnp.int32)
    batch, sampling, prev_index = abstract_inputs(StepKey("decode", 8, 8, 16), None, 8,
                                                  cfg.vocab_size)
    dots = {}
    for name, kcfg in (("auto", KernelConfig()), ("off", KernelConfig(fuse_projections=False))):
        kcfg = resolve_kernel_config(kcfg, "gpu", cfg.dtype)
        params = jax.eval_shape(lambda p: prepare_params(p, kcfg, kernels), abstract_params(cfg))
        text = _lower(functools.partial(forward_step, cfg=cfg, drafter=None, rules=None,
                                        num_top=4, kernels=kernels),
                      params, cache, batch, sampling.prompt_targets, prev, prev_index, None,
                      None, pool)
        dots[name] = count_executed(text, "stablehlo.dot_general")
    assert dots == {"auto": 4 * cfg.num_layers + 1, "off": 7 * cfg.num_layers + 1}, dots
    # int8 weights are fused before they are quantised: the Pallas matmul reads one
    # [128, 256] q | k | v and one [128, 512] gate | up matrix, no [128, 64] K or V one
    kcfg = resolve_kernel_config(KernelConfig(weight_quant="int8"), "gpu", cfg.dtype)
    kernels = Kernels("pallas", "pallas", host_branches=True)
    params = jax.eval_shape(lambda p: prepare_params(p, kcfg, kernels), abstract_params(cfg))
    text = _lower(functools.partial(forward_step, cfg=cfg, drafter=None, rules=None, num_top=4,
                                    kernels=kernels),
                  params, cache, batch, sampling.prompt_targets, prev, prev_index, None, None,
                  pool)
    assert "tensor<128x256xi8>" in text and "tensor<128x512xi8>" in text
    assert "tensor<128x64xi8>" not in text


@pytest.mark.parametrize("attention,kv_dtype", [("pallas", "bfloat16"), ("pallas_mosaic", "bfloat16"),
                                               ("pallas_mosaic", "int8")])
def test_engine_decode_step_with_mosaic_kernels_lowers_for_cuda(attention, kv_dtype, cuda_lowering):
    """The bf16 decode step of a SmolLM2-shaped int8 model with the Hopper matmul
    ("pallas_mosaic"): each of the 4 distinct projection shapes is one Mosaic GPU call;
    attention is one Triton call, or with "pallas_mosaic" attention (what "auto" picks on
    Hopper) a fifth Mosaic GPU call and no Triton at all (prefill steps alike: the
    engine-shape lowering test); over an int8 KV pool (rows with their scales, which the
    Mosaic attention does not read) the Triton decode kernel again."""
    from jaxserve.worker.compilation import StepKey, abstract_inputs
    from jaxserve.worker.step import forward_step

    cfg = tiny_config(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                      num_layers=2, vocab_size=4096, dtype="bfloat16")
    params = jax.eval_shape(lambda p: quantize_params(p, "int8", None), abstract_params(cfg))
    cache = abstract_kv_cache(cfg, 64, 16, kv_dtype)
    batch, sampling, prev_index = abstract_inputs(StepKey("decode", 8, 8, 16), None, 300, cfg.vocab_size)
    pool = jax.ShapeDtypeStruct((64 * 16,), jnp.int32)
    prev_tokens = jax.ShapeDtypeStruct((32,), jnp.int32)
    step = functools.partial(forward_step, cfg=cfg, drafter=None, rules=None,
                             kernels=Kernels(attention, "pallas_mosaic"), num_top=20)
    text = jax.jit(step).trace(params, cache, batch, sampling.prompt_targets, prev_tokens,
                               prev_index, None, None, pool).lower(
        lowering_platforms=("cuda",)).as_text()
    mosaic = attention == "pallas_mosaic" and kv_dtype == "bfloat16"
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 4 + mosaic
    assert text.count("xla.gpu.triton") == (0 if mosaic else 1)


@pytest.mark.parametrize("platform,branches,host", [
    ("gpu", "auto", True), ("cuda", "auto", True), ("cpu", "auto", False),
    ("cpu", "host", True), ("gpu", "device", False)])
def test_branches_are_decided_on_the_host_on_gpus(platform, branches, host, tmp_path):
    """KernelConfig.branches "auto": the host decides the sampler's branches on a GPU
    (XLA:GPU waits on the host at a conditional: jaxserve.sample.plan), the device
    elsewhere; an explicit choice wins; anything else is refused by name."""
    from jaxserve.worker.kernel_selection import select_kernels
    kcfg = KernelConfig(attention_impl="xla", matmul_impl="xla", sampling_impl="xla",
                        branches=branches)
    assert select_kernels(kcfg, platform, 1, "bfloat16", tmp_path).host_branches == host
    with pytest.raises(ConfigError, match="KernelConfig.branches"):
        KernelConfig(branches="gpu")


def test_bf16_models_on_cpu_resolve_to_the_packed_cpp_matmul():
    from jaxserve.worker.kernel_selection import resolve_kernel_config
    auto = KernelConfig()
    assert resolve_kernel_config(auto, "cpu", "bfloat16").bf16_matmul_min_rows == 1
    assert resolve_kernel_config(auto, "cpu", "float32") == auto
    # on a GPU only the projections' fusion resolves (XLA:GPU's small matrix-vector products)
    assert resolve_kernel_config(auto, "gpu", "bfloat16") == KernelConfig(fuse_projections=True)
    unfused = KernelConfig(fuse_projections=False)
    assert resolve_kernel_config(unfused, "gpu", "bfloat16") == unfused
    for kept in (KernelConfig(matmul_impl="xla"), KernelConfig(weight_quant="int8"),
                 KernelConfig(bf16_matmul_min_rows=4)):
        assert resolve_kernel_config(kept, "cpu", "bfloat16") == kept


def test_bf16_weights_pack_losslessly_and_panels_split_over_shards(cpu_kernels_library):
    from jaxserve.kernels.cpu.bf16_matmul import unpack_weight
    from jaxserve.model.weight_layouts import dual_precision

    w = jax.random.normal(jax.random.key(0), (64, 96)).astype(jnp.bfloat16)
    d = dual_precision(w, 1, packed=True)
    assert d.packed and d.w is None
    np.testing.assert_array_equal(np.asarray(unpack_weight(d.w_copy)), np.asarray(w))
    with pytest.raises(ValueError, match="needs f32 weights"):
        dual_precision(w, 8, packed=True)
    # N = 96: panels of 64 do not tile it, 16 does; over 2 shards 48 columns each -> 16
    assert dual_precision(w, 1, packed=True, split=(1, 2)).w_copy.shape == (6, 32, 16, 2)
    # 3 shards of 32 columns: panels of 16 (2 per shard)
    assert dual_precision(w, 1, packed=True, split=(1, 3)).w_copy.shape == (6, 32, 16, 2)
    w128 = jnp.zeros((64, 128), jnp.bfloat16)
    assert dual_precision(w128, 1, packed=True, split=(1, 2)).w_copy.shape[2] == 64
    assert dual_precision(w128, 1, packed=True, split=(1, 4)).w_copy.shape[2] == 16


def test_quant_groups_must_fit_each_devices_rows():
    """Under TP a row-split weight's groups must lie within one device's rows: wo's 64
    input rows over 4 devices are 16 each, which a group of 32 would straddle."""
    from jaxserve.config import ParallelConfig
    from jaxserve.model.params import abstract_params
    from jaxserve.model.weight_layouts import quantize_params
    from jaxserve.distributed.sharding import ShardingRules, make_abstract_mesh
    from model_utils import tiny_config

    cfg = tiny_config(num_heads=4, num_kv_heads=4, head_dim=16, hidden_size=64,
                      intermediate_size=128)
    rules = ShardingRules(make_abstract_mesh(ParallelConfig(tensor_parallel_size=4)))
    with pytest.raises(ConfigError, match="weight_quant_group_size=32 does not divide the 16 "
                                          "input rows of wo each of 4 devices holds"):
        jax.eval_shape(lambda p: quantize_params(p, "int8", 32, rules), abstract_params(cfg))
    jax.eval_shape(lambda p: quantize_params(p, "int8", 16, rules), abstract_params(cfg))
