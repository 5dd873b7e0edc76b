"""Llama 3.1 70B Instruct, bf16, tensor parallel over 8 devices (one 8-GPU host).

Weights: as in llama3_8b.py, convert a local HF directory and set `source`. Plans on
any machine without devices: `jaxserve plan-memory --config configs/llama70b.py`.
"""

from jaxserve.config import (CacheConfig, Config, EngineConfig, ModelConfig, ParallelConfig,
                             RopeScaling, SchedulerConfig)

MODEL = ModelConfig(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
    num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), dtype="bfloat16")

CONFIG = Config(
    name="llama70b",
    model=MODEL,
    served_model_name="Meta-Llama-3.1-70B-Instruct",
    parallel=ParallelConfig(tensor_parallel_size=8),
    engine=EngineConfig(
        max_model_len=8192,
        # the pool sized from each device's memory (gpu_memory_utilization on GPU; on CPU
        # what the host has left, jaxserve.worker.memory_plan), not a fixed size that only
        # fits an 80 GB GPU
        cache=CacheConfig(page_size=16, kv_cache_memory_bytes=None),
        # decode_steps None: chosen for the platform (8 on a GPU)
        scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192,
                                  decode_steps=None)),
)
