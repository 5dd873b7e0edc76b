"""Quantised matmuls against the memory bound, per shape: achieved GB/s and the fraction of
the device's read bandwidth, and each kernel's time against XLA's bf16 dot in the same run.

    python -m tools.bench_quantized_matmul [--shapes 4096x4096 4096x1024 4096x14336 14336x4096]
        [--m 1 64 256] [--impls xla_bf16 xla reference pallas pallas_mosaic]
        [--formats int8 fp8_e4m3] [--group G] [--repeats 20] [--sweep] [--json OUT]

For each weight shape [in_features, out_features] (default: Llama-3-8B's projections), each
row count M (1: single-stream decode, 64: a batch of decodes, 256+: prefill chunks) and each
implementation it times one call as the difference between a program of 16 calls (each on
its own copy of the weights: no call reads another's from L2) and a program of one, over 15, each
program the median of `repeats` runs after a compile and a warm run: a call's fixed cost
(dispatch, launch, the wait for the result) cancels, which on a GPU is as long as the
matmul itself:

- `xla_bf16`: the baseline, XLA's dot of bf16 x and a bf16 weight (what an unquantised model
  runs); bytes = the bf16 weight + x + out.
- `xla`: what KernelConfig.matmul_impl "xla" runs (`quantized_matmul_xla`: the widened
  weight as an operand of XLA's dot, which XLA:GPU fuses into its GEMM).
- `reference`: the plain-jnp reference (dequantise the whole weight, f32 dot).
- `pallas`: the Triton kernel (`quantized_matmul`, any GPU).
- `pallas_mosaic`: the Hopper kernel (`quantized_matmul_mosaic`, sm_90 only).

With --sweep each Pallas kernel is also timed with the tiles of SWEEP (the Triton kernel's
block_n / block_k / num_warps / num_stages / splits, the Mosaic one's tile_n /
max_concurrent_steps / splits; M <= 64 only, where split-K applies), each row named
`impl[option=value,...]`: which tiles reach the bound, to set the defaults by.

bytes = the stored weight (1 byte per element) + its f32 scales + x + out, read or written
once: the least any implementation must move. GB/s = bytes / time; "of peak" divides it by
the device's read bandwidth, measured in the same run as an XLA reduction over a 1 GiB array
(jaxserve.bench.bandwidth; the nominal HBM figure of an H100 SXM is 3.35 TB/s, an H200's
4.8 TB/s, and a streaming read reaches ~90% of it). "vs bf16" is the bf16 baseline's time
over this one's: the issue-29 target is >= 1.6x at M = 1 (the bytes ratio is ~2x per matmul)
and >= 1.0x at M = 64. Kernels that do not run here (no GPU, not Hopper) are reported as
skipped with the reason. A benchmark, not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

LLAMA3_8B_SHAPES = ("4096x4096", "4096x1024", "4096x14336", "14336x4096")
IMPLS = ("xla_bf16", "xla", "reference", "pallas", "pallas_mosaic")
# --sweep: the tile options each kernel is also timed with at M <= 64 (the defaults: Triton
# block_n 128, block_k 128, 4 warps, 3 stages at M <= 16, block_n 64 and 2 stages above;
# Mosaic tile_n 128, 4 steps in flight). More bytes in flight per program is the lever a
# GEMV has (PERFORMANCE.md, "The GPU run of session 24": the kernels read at 30-43% of
# the bandwidth; session 27's sweep chose the Triton GEMV tiles).
SWEEP = {
    "pallas": [dict(block_n=64, block_k=128, num_warps=4, num_stages=2),
               dict(block_n=128, block_k=128, num_warps=4, num_stages=3),
               dict(block_n=64, block_k=256, num_warps=4, num_stages=3),
               dict(block_n=128, block_k=256, num_warps=8, num_stages=3),
               dict(block_n=256, block_k=128, num_warps=8, num_stages=4),
               dict(block_n=64, block_k=512, num_warps=8, num_stages=2),
               # more programs than split-K's default (2 per SM, TARGET_PROGRAMS): more
               # bytes in flight in all, as Little's law asks of a latency-bound GEMV
               dict(block_n=128, block_k=128, num_warps=4, num_stages=3, splits=4),
               dict(block_n=128, block_k=128, num_warps=4, num_stages=3, splits=8),
               dict(block_n=128, block_k=128, num_warps=4, num_stages=4, splits=8),
               # the CUDA-core GEMV variants (M <= 4; quantized_matmul's `gemv`): f32
               # multiply-and-reduce, ~3-4 instructions a weight element in the loop
               # against the dot's ~6 (tools/compile_triton, sm_90), loads not pipelined
               # through shared memory, so many programs (REDUCE_TARGET_PROGRAMS)
               dict(gemv="reduce"), dict(gemv="reduce_magic"),
               dict(gemv="reduce_magic", block_k=64),
               dict(gemv="reduce_magic", block_n=256),
               dict(gemv="reduce_magic", splits=32),
               dict(gemv="reduce_magic", num_warps=8),
               dict(gemv="reduce", block_k=64, splits=16)],
    # (tile_n 256 with 8 steps in flight needs 296 KB of SMEM, over the 227 KB a CTA has)
    "pallas_mosaic": [dict(max_concurrent_steps=8), dict(tile_n=256),
                      dict(tile_n=256, max_concurrent_steps=5),
                      dict(tile_n=256, max_concurrent_steps=5, splits=8)],
}


# Distinct weight copies one timed program multiplies by: more bytes than an H100's 50 MB L2
# for every default shape (the smallest, 4096 x 1024 in int8, is 4 MB a copy), and enough
# calls that the program's own cost is measured.
COPIES = 16


def _median_seconds(fn, args, repeats: int) -> float:
    """Median seconds of `repeats` calls of the compiled fn (after one warm call)."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time(fn, x, weights, repeats: int) -> float:
    """Seconds of one `fn(x, *weights)`: the difference between one program of COPIES calls,
    each on its own copy of the weights (so none is read from the L2 cache of another), and
    one of a single call, over COPIES - 1. A call's fixed cost (dispatch, launch, waiting
    for the result: ~0.15 ms on an H100 machine, where a 4096 x 14336 bf16 weight reads in
    ~0.04 ms) is in both and cancels; timing single calls measured it instead (session 22:
    every implementation 140-400 us)."""
    import jax
    import jax.numpy as jnp
    copies = [weights] + [tuple(jnp.copy(w) for w in weights) for _ in range(COPIES - 1)]
    one = jax.jit(lambda x, ws: fn(x, *ws[0]))
    many = jax.jit(lambda x, ws: [fn(x, *w) for w in ws])
    return (_median_seconds(many, (x, copies), repeats)
            - _median_seconds(one, (x, copies), repeats)) / (COPIES - 1)


def _runnable(impl: str, platform: str, capability: str | None) -> str | None:
    """None if `impl` runs on this device, else why not."""
    from jaxserve.config import is_hopper
    if impl in ("pallas", "pallas_mosaic") and platform != "gpu":
        return "needs a GPU"
    if impl == "pallas_mosaic" and not is_hopper(capability):
        return f"needs Hopper (sm_90), this device is {capability}"
    return None


def bench(shapes, ms, impls, formats, group, repeats, on_row=None, sweep=False) -> dict:
    """{"device", "read_gb_s", "rows": [...]} for every (shape, M, format, impl), and with
    `sweep` every SWEEP variant of the Pallas impls at M <= 64.
    on_row(row, read_gb_s), if given, is called as each row is measured (a run cut short
    by a time cap still reports what it measured)."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxserve.bench.bandwidth import read_bandwidth_gb_s
    from jaxserve.kernels.pallas.quantized_matmul import (quantize_weights, quantized_matmul,
                                                          quantized_matmul_reference,
                                                          quantized_matmul_xla)
    from jaxserve.kernels.pallas.quantized_matmul_mosaic import (mosaic_supports,
                                                                 quantized_matmul_mosaic)

    dev = jax.devices()[0]
    capability = getattr(dev, "compute_capability", None)
    read_gb_s = statistics.median(read_bandwidth_gb_s(1.0, 7))
    rows = []

    def add(r):
        rows.append(r)
        if on_row is not None:
            on_row(r, read_gb_s)

    for shape in shapes:
        k, n = (int(v) for v in shape.split("x"))
        w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) / k ** 0.5
        w_bf16 = w.astype(jnp.bfloat16)
        for m in ms:
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            io = (m * k + m * n) * 2  # x in, out
            base = None

            def row(fmt, impl, seconds, nbytes):
                if seconds <= 0:
                    return dict(shape=shape, m=m, format=fmt, impl=impl, bytes=nbytes,
                                skipped=f"too noisy: {COPIES} calls took "
                                        f"{-seconds * (COPIES - 1) * 1e6:.1f} us less than 1")
                gb_s = nbytes / seconds / 1e9
                r = dict(shape=shape, m=m, format=fmt, impl=impl, seconds=seconds,
                         bytes=nbytes, gb_s=gb_s, of_peak=gb_s / read_gb_s)
                if base is not None and base > 0:
                    r["vs_bf16"] = base / seconds
                return r

            if "xla_bf16" in impls:
                base = _time(lambda x, w: x @ w, x, (w_bf16,), repeats)
                add(row("bf16", "xla_bf16", base, k * n * 2 + io))
            for fmt in formats:
                g = group if fmt == "int8" else None
                w_q, scales = quantize_weights(w, fmt, g)
                nbytes = k * n + scales.size * 4 + io
                for impl in impls:
                    if impl == "xla_bf16":
                        continue
                    why = _runnable(impl, dev.platform, capability)
                    if impl == "pallas_mosaic" and why is None and not mosaic_supports(
                            x.dtype, w_q.dtype, k, n, g):
                        why = "shape not supported by the Mosaic kernel (mosaic_supports)"
                    if why is not None:
                        add(dict(shape=shape, m=m, format=fmt, impl=impl, skipped=why))
                        continue
                    fn = {"xla": quantized_matmul_xla, "reference": quantized_matmul_reference,
                          "pallas": functools.partial(quantized_matmul, impl="pallas"),
                          "pallas_mosaic": functools.partial(quantized_matmul_mosaic,
                                                             impl="pallas_mosaic")}[impl]
                    add(row(fmt, impl, _time(fn, x, (w_q, scales), repeats), nbytes))
                    for opts in (SWEEP.get(impl, []) if sweep and m <= 64 else []):
                        name = f"{impl}[{','.join(f'{o}={v}' for o, v in opts.items())}]"
                        try:
                            seconds = _time(functools.partial(fn, **opts), x, (w_q, scales),
                                            repeats)
                        except Exception as e:  # a tile the kernel refuses or cannot compile
                            add(dict(shape=shape, m=m, format=fmt, impl=name,
                                     skipped=f"{type(e).__name__}: {str(e)[:120]}"))
                            continue
                        add(row(fmt, name, seconds, nbytes))
    return {"device": dev.device_kind, "platform": dev.platform, "compute_capability": capability,
            "read_gb_s": read_gb_s, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(LLAMA3_8B_SHAPES),
                    help="weight shapes in_featuresxout_features")
    ap.add_argument("--m", nargs="+", type=int, default=[1, 64, 256], help="activation rows")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--formats", nargs="+", default=["int8", "fp8_e4m3"],
                    choices=["int8", "fp8_e4m3"])
    ap.add_argument("--group", type=int, default=None, help="int8 group size (default per channel)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the Pallas kernels with the tiles of SWEEP at M <= 64")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    for s in args.shapes:
        parts = s.split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            ap.error(f"--shapes: expected IN_FEATURESxOUT_FEATURES like 4096x1024, got {s!r}")
    if args.repeats < 1 or any(m < 1 for m in args.m):
        ap.error("--repeats and --m must be >= 1")
    header = []

    def print_row(r, read_gb_s):
        if not header:
            header.append(True)
            print(f"read bandwidth {read_gb_s:.1f} GB/s (XLA reduction, this run)")
            print(f"{'shape':>12} {'M':>5} {'format':>9} {'impl':>14} {'us':>9} {'GB/s':>8} "
                  f"{'of peak':>8} {'vs bf16':>8}")
        head = f"{r['shape']:>12} {r['m']:>5} {r['format']:>9} {r['impl']:>14}"
        if "skipped" in r:
            print(f"{head}   skipped: {r['skipped']}", flush=True)
            return
        vs = f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-"
        print(f"{head} {r['seconds'] * 1e6:>9.1f} {r['gb_s']:>8.1f} {r['of_peak']:>8.0%} {vs:>8}",
              flush=True)

    res = bench(args.shapes, args.m, args.impls, args.formats, args.group, args.repeats,
                print_row, args.sweep)
    print(f"{res['device']} ({res['platform']}, compute capability {res['compute_capability']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
