"""SmolLM2-135M-Instruct (the real model) with a small engine for tests: a short
max_model_len and few shape buckets (12 compilations), and a pool of 80 pages (1280
tokens) that 16 short requests fit in together but 8 long ones do not (preemption).
Built on configs/smollm2_135m_bf16.py (f32 weights; the default serves the GGUF's Q4_1
blocks, tests/test_gguf_serving.py), with matmuls in f32 (bf16 matmuls are not
batch-invariant: the exact "same output in any batch" tests need f32;
tests/test_real_model_parity.py checks the bf16 config's precision against HF): the f32
weights in the C++ kernel's f32 panels (matmul_impl "cpu": one path of f32 FMAs at every
row count, so a row's logits never depend on the rows beside it), a 16-row decode step
~1.6x as fast as XLA's f32 dot on an AMD Zen 3 VM, whose LM head of a few rows is slow
(PERFORMANCE.md, "The tests' engine in f32 panels"). No huge-page advice
(KernelConfig.cpu_huge_pages): it is a speed hint that leaves every value as it was, and
collapsing these 0.6 GiB of f32 weights took 1.3 s of a 3.6 s engine build, paid by every
test that builds one (tests/test_huge_pages.py tests the advice; the shipped configs keep
it in the real-model tests that build them)."""

import dataclasses

from jaxserve.config import (CacheConfig, CompilationConfig, EngineConfig, KernelConfig,
                             SchedulerConfig, load_config)

_DEFAULT = load_config("smollm2_135m_bf16")  # shipped, by name: f32 weights, not blocks

PAGE_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K+V, 30 layers, 16 tokens, 3 kv heads x 64, f32

CONFIG = dataclasses.replace(
    _DEFAULT,
    name="smollm2_135m_small",
    engine=EngineConfig(
        max_model_len=512,
        cache=CacheConfig(page_size=16,
                          kv_cache_memory_bytes=81 * PAGE_BYTES),  # 80 usable pages + the null page
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        compilation=CompilationConfig(seq_buckets=(1, 4, 16), token_buckets=(32, 128, 512),
                                      page_buckets=(8, 32)),
        kernels=KernelConfig(matmul_impl="cpu", cpu_huge_pages=False),
    ),
)
