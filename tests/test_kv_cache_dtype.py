"""--kv-cache-dtype fp8 on the real model: K/V stored as float8_e4m3fn (uint8 bits), read
by the C++ attention kernel, against the f32 model (the kernel's fp8 widening is
test_cpu_kernel_paged_attention's, the pool's writes test_model's)."""

from __future__ import annotations

import pytest

from served_formats import ONE_ROUNDING_KL, assert_close_distributions


@pytest.mark.full  # fast tier: the kernel's exact fp8 widening, the model's fp8 pool writes
def test_real_model_fp8_kv_cache_keeps_the_float_models_distributions(smollm2_gguf, cache_dir,
                                                                      float_outputs):
    """The bf16 preset with cache_dtype="fp8": a uint8 pool, the C++ attention kernel,
    and teacher-forced next-token distributions (K/V written to and read back from the
    fp8 pool) within ONE_ROUNDING_KL of the f32 model's, confident positions unflipped:
    e4m3fn's rounding (3 mantissa bits, <= 2^-4 relative) is an 8-bit rounding of each
    K/V element, the issue's bound for an 8-bit KV cache (KL <= 0.01 nats). Measured
    5.4e-3 against the bf16 pool (tools/quant_accuracy.py, PERFORMANCE.md)."""
    import jaxserve
    llm = jaxserve.LLM("smollm2_135m_bf16", model=smollm2_gguf, cache_dtype="fp8",
                       warmup=False, cache_dir=cache_dir, max_num_seqs=8)
    runner = llm.engine.runner
    assert str(runner.cache.dtype) == "float8_e4m3fn" and str(runner.cache.k[0].dtype) == "uint8"
    assert runner.kernels.attention.name == "cpu"
    assert_close_distributions(llm, float_outputs, ONE_ROUNDING_KL)
