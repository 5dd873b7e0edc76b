"""The pure-functional Llama-family model: `params` (the param tree, described once by
shape, dtype, logical axes and initialiser), `layers` (norms, RoPE, MLP), `attention`
(the attention backends over the paged KV pool), `linear` (the matmul backends),
`weight_layouts` (the projections' leaf types: quantised, dual-precision, fused, and the
load-time passes that make them), `ggml_weight` (GGUF blocks), `kv_cache` (the page
pool's arrays), `inputs` (StepBatch), `transformer` (forward, logits), `pooling` (hidden
states pooled per sequence: embeddings), `tensor_parallel` and `pipeline` (the mesh layouts).

May import: kernels, distributed, config and the package's root utilities; never the
sampler, the worker or the engine.
"""
