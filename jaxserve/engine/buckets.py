"""Shape buckets: the fixed set of padded shapes the jitted step is compiled for."""

from __future__ import annotations

from jaxserve.config import EngineConfig


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Raises ValueError if n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def warmup_shapes(cfg: EngineConfig) -> list[tuple[str, int, int, int]]:
    """Every (kind, B, Q, P) the engine can run: what warm-up compiles."""
    shapes = []
    for Q in cfg.prefill_lengths:
        P = bucket_for(-(-Q // cfg.page_size), cfg.page_counts)
        for B in cfg.prefill_batch_sizes:
            if B == 1 or B * Q <= cfg.max_prefill_tokens:
                shapes.append(("prefill", B, Q, P))
    for B in cfg.decode_batch_sizes:
        for P in cfg.page_counts:
            shapes.append(("decode", B, 1, P))
    return shapes
