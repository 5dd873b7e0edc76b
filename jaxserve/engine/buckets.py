"""Shape buckets: the fixed set of padded shapes the jitted step is compiled for."""

from __future__ import annotations

from jaxserve.config import EngineConfig


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Raises ValueError if n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def prefill_shape(lengths: list[int], cfg: EngineConfig) -> tuple[int, int, int]:
    """(T, S, P) of a prefill step packing prompts of `lengths` tokens: T the token bucket
    of their sum, S the sequence bucket of their count, P the page bucket of T tokens
    (no prompt is longer than T). Raises ValueError past the largest buckets."""
    T = bucket_for(sum(lengths), cfg.prefill_lengths)
    return T, bucket_for(len(lengths), cfg.prefill_batch_sizes), _prefill_pages(T, cfg)


def _prefill_pages(T: int, cfg: EngineConfig) -> int:
    """The page bucket of a prefill step of T token rows (no prompt is longer than T)."""
    return bucket_for(-(-T // cfg.cache.page_size), cfg.page_counts)


def warmup_shapes(cfg: EngineConfig) -> list[tuple[str, int, int, int, int]]:
    """Every (kind, T, S, P, n) the engine can run (T token rows, S sequences, P pages per
    block table, n tokens per sequence: 1, or decode_steps for multi-step decode): what
    warm-up compiles. Several prompts share a prefill step only within max_prefill_tokens
    token rows."""
    shapes = []
    for T in cfg.prefill_lengths:
        P = _prefill_pages(T, cfg)
        for S in cfg.prefill_batch_sizes:
            if S == 1 or T <= cfg.scheduler.max_prefill_tokens:
                shapes.append(("prefill", T, S, P, 1))
    steps = sorted({1, cfg.scheduler.decode_steps})
    for S in cfg.decode_batch_sizes:
        for P in cfg.page_counts:
            shapes.extend(("decode", S, S, P, n) for n in steps)
    return shapes
