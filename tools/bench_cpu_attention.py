"""Query-key pairs per second of the C++ paged attention kernel (jaxserve/kernels/cpu/),
against XLA attention (`attention_impl="xla"`) on the same inputs in the same run.

    python -m tools.bench_cpu_attention [--repeats 15] [--layers 30]
                                        [--page-order contiguous|extents|random]

Shapes: SmolLM2-135M's heads (9 query, 3 KV, head_dim 64), a bf16 pool of 16-token pages:
a 240-token prompt chunk over 1,900 tokens of context (the chunked-prefill benchmark's
last chunks), a 512-token prompt, and decode steps of 32 sequences over 256 tokens (the
32-stream peers benchmark's contexts) and 512. One layer's attention per call; the
minimum of `--repeats` calls (the VM's noise is +-20%: to compare two versions of the
kernel, alternate their runs). A query-key pair is one query head scoring one visible key
(causal). --layers N (> 1) also times the C++ kernel on a stack of N layers' pools in
one program that calls it for each layer in turn, as the engine's step does: pools read
from DRAM, not from the cache a single small pool stays in, and no dispatch between the
calls (per layer: the median of --repeats programs over N; the K/V bytes read per second
beside it, against `python -m tools.membw`'s read bandwidth; why one program:
PERFORMANCE.md, "Decode attention and the page pool's layout"). --page-order says where
each sequence's pages lie in the pool (jaxserve.bench.pages: `extents` as the engine's
page pool hands them out).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint.sources import default_cache_dir
from jaxserve.bench.pages import PAGE_ORDERS, page_ids
from jaxserve.kernels.cpu.build import load_library
from jaxserve.kernels.cpu.paged_attention import paged_attention
from jaxserve.model.attention import make_metadata, paged_attention as model_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
CASES = (("prefill 240 x 1900", 1900, 240, 1), ("prefill 512 x 512", 512, 512, 1),
         ("decode 32 x 256", 256, 1, 32), ("decode 32 x 512", 512, 1, 32))


def _case(rng, ctx: int, new: int, seqs: int, layers: int = 1, order: str = "contiguous"):
    """The case's inputs (pools [layers, ...] when layers > 1) and its query-key pairs."""
    pages = -(-ctx // PAGE)
    shape = (layers,) * (layers > 1) + (KV_HEADS, seqs * pages + 1, PAGE, HEAD_DIM)
    k, v = (jax.lax.bitcast_convert_type(
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), jnp.uint16) for _ in range(2))
    tables = jnp.asarray(page_ids(rng, seqs * pages, order).reshape(seqs, pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((seqs * new, HEADS, HEAD_DIM)), jnp.float32)
    query_start = jnp.asarray(np.arange(seqs + 1) * new, jnp.int32)
    positions = jnp.asarray(np.tile(np.arange(ctx - new, ctx), seqs), jnp.int32)
    seq_lens = jnp.full((seqs,), ctx, jnp.int32)
    pairs = seqs * HEADS * sum(min(ctx, p + 1) for p in range(ctx - new, ctx))
    return (q, k, v, tables, seq_lens, query_start, positions), pairs


def _times(fn, args, repeats: int) -> list[float]:
    """Seconds of `repeats` calls of `fn(*args)` after one warm-up call."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return times


def _seconds(fn, args, repeats: int) -> float:
    return min(_times(fn, args, repeats))


def _seconds_per_layer(fn, args, layers: int, repeats: int) -> float:
    """Median seconds per layer of `repeats` runs of one program that calls `fn` on each of
    the stacked pools' `layers` layers in turn (the outputs summed, so each call is kept)."""
    def all_layers(*a):
        return jax.lax.fori_loop(0, layers, lambda i, acc: acc + fn(*a, layer=i),
                                 jnp.zeros(a[0].shape, jnp.float32))
    return float(np.median(_times(jax.jit(all_layers), args, repeats))) / layers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=1,
                    help="> 1: also time the C++ kernel on a stack of this many layers' pools")
    ap.add_argument("--page-order", choices=PAGE_ORDERS, default="contiguous",
                    help="where each sequence's pages lie in the pool (jaxserve.bench.pages)")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    load_library(default_cache_dir() / "kernels")
    cpp = jax.jit(paged_attention)
    xla = jax.jit(lambda q, k, v, t, sl, qs, pos: model_attention(
        q, k, v, make_metadata(t, sl, qs, pos, PAGE, "xla"), "xla", "head_major"))
    rng = np.random.default_rng(0)
    dram = f" {'ms/layer':>8} {'M pairs/s':>10} {'K/V GB/s':>9}" if args.layers > 1 else ""
    print(f"{'case':>20} {'C++ ms':>8} {'M pairs/s':>10} {'XLA ms':>8} {'M pairs/s':>10} "
          f"{'C++/XLA time':>13}{dram}")
    for name, ctx, new, seqs in CASES:
        inputs, pairs = _case(rng, ctx, new, seqs, order=args.page_order)
        t_cpp, t_xla = _seconds(cpp, inputs, args.repeats), _seconds(xla, inputs, args.repeats)
        line = (f"{name:>20} {t_cpp * 1e3:8.2f} {pairs / t_cpp / 1e6:10.0f} {t_xla * 1e3:8.2f} "
                f"{pairs / t_xla / 1e6:10.0f} {t_cpp / t_xla:13.2f}")
        if args.layers > 1:
            inputs, _ = _case(rng, ctx, new, seqs, args.layers, args.page_order)
            t = _seconds_per_layer(paged_attention, inputs, args.layers, args.repeats)
            kv_bytes = 2 * seqs * ctx * KV_HEADS * HEAD_DIM * inputs[1].dtype.itemsize
            line += f" {t * 1e3:8.2f} {pairs / t / 1e6:10.0f} {kv_bytes / t / 1e9:9.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
