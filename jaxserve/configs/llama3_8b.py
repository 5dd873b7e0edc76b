"""Llama 3.1 8B Instruct, bf16, one device.

No weights ship with this repository and nothing here can reach a model hub: to serve,
convert a local HF directory (`jaxserve convert DIR OUT`) and set
`source=ModelSource(checkpoint=OUT)` (or `hf_dir=DIR`, converted once and cached).
Without a source the config still plans: `jaxserve plan-memory --config configs/llama3_8b.py`.
"""

from jaxserve.config import (CacheConfig, Config, EngineConfig, ModelConfig, RopeScaling,
                             SchedulerConfig)

MODEL = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), dtype="bfloat16")

CONFIG = Config(
    name="llama3_8b",
    model=MODEL,
    served_model_name="Meta-Llama-3.1-8B-Instruct",
    engine=EngineConfig(
        max_model_len=8192,
        cache=CacheConfig(page_size=16, kv_cache_memory_bytes=40 * 2**30),
        # decode_steps None: chosen for the platform (8 on a GPU: PERFORMANCE.md, "The GPU
        # run of session 24")
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192,
                                  decode_steps=None)),
)
