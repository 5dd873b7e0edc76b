"""Sampling on device: the sampler (greedy, temperature, top-k / top-p / min-p, seeded per
row), the logits processors (bias, penalties, min_tokens), the rejection sampler that
verifies speculative drafts, and `grammar` (structured output's token masks through
llguidance, computed on the host).

May import: kernels, config, the package's root utilities (`pytree`, `sampling_params`);
never the model (a peer: neither imports the other), the worker or the engine.
"""
