"""Time the compiled engine step per shape, for two variants measured in the same run:

  --compare precision (default): f32 weights (the baseline) against bf16 weights with f32
      accumulation, to choose `KernelConfig.bf16_matmul_min_rows` by measurement;
  --compare attention: attention_impl "xla" (the baseline) against the C++ "cpu" kernel,
      both with the config's weights and a head-major KV pool;
  --compare matmul: f32 weights in XLA's dot (the baseline) against bf16 weights in the
      C++ "cpu" bf16 matmul kernel, both with the C++ attention: where the kernel wins
      gives `bf16_matmul_min_rows` / `bf16_matmul_max_rows` with matmul_impl "cpu".
  --compare f32_panels: f32 weights in XLA's dot (the baseline) against the same f32
      weights in the C++ kernel's f32 panels (KernelConfig.matmul_impl "cpu" without bf16
      copies), both with the C++ attention.
  --compare fusion: the C++ bf16 matmul with one call per projection (the baseline)
      against the fused wq | wk | wv and w_gate | w_up calls the engine uses.
  --compare swiglu: the config's engine with w_gate | w_up's product written out and
      silu(gate) * up in XLA (the baseline) against the C++ kernel's SwiGLU epilogue
      (jaxserve.model.linear.Matmul.swiglu), the layout the engine serves without LoRA.
  --compare round_x: the C++ bf16 matmul with f32 activations (the baseline) against
      activations rounded to bf16 and the CPU's bf16 dot-product instruction at every row
      count (KernelConfig.bf16_matmul_round_x_min_rows: where it wins).
  --compare decode_steps: the config's engine, time per decoded token with one token per
      dispatched step (the baseline) against multi-step decode (`--decode-steps`, default
      the config's decode_steps): 64 tokens per row dispatched back to back, as the engine
      does, then waited for. Decode shapes only.
  --compare kv_dtype: the config's engine with a KV pool of the first of --kv-dtypes (the
      baseline; default f32) against one of the second (default bf16; also int8 or fp8:
      --kv-cache-dtype's values), each as many pages as the config's kv_cache_memory_bytes
      holds (the served pool size: a step that copied the pool would show).
  --compare huge_pages: the config's engine with its weights and KV pool in the
      allocator's 4 KiB pages (the baseline) against its own copy of them in transparent
      huge pages (KernelConfig.cpu_huge_pages: jaxserve.worker.huge_pages).

    jaxserve bench step [--config smollm2_135m] [--repeats 7]
        [--compare precision|attention|matmul|f32_panels|fusion|swiglu|round_x|decode_steps|
                   kv_dtype|huge_pages]
        [--decode-steps N] [--kv-dtypes float32,bfloat16]
        [--ragged] [--page-order random|extents|contiguous]
        [--shapes decode:1x16,decode:32x16,prefill:1x512,mixed:31x16x225 ...] [--json out.json]

Each shape `kind:BxL` is one engine step: decode = B sequences of L context pages
(P = L pages of page_size tokens, one new token each; with --ragged row i's context is
drawn uniformly from 1 .. L pages, as in a serving batch); prefill = B prompts of L tokens;
`mixed:BxLxT` = decode:BxL's rows and, in the same step, a T-token prompt (a mixed step of
continuous batching with chunked prefill: B + 1 sequences, B + T token rows; B + 1 at
most max_num_seqs).
Both variants run the same step (forward, logits, greedy sampling) on the same random
batch, each as the engine would compile it: its layers as one loop over stacked weights
and a stacked KV pool where the engine loops them (CompilationConfig.layer_loop; until
2026-11-30 this tool always unrolled them), else unrolled; the tool prints which; their
weights and pools in huge pages where the config puts the engine's there (cpu_huge_pages;
until 2026-12-01 never). The weights: as the config serves them (Config.quantization
applied: a GGUF file's blocks kept) in the comparisons of two served layouts (attention,
swiglu, decode_steps, huge_pages, kv_dtype); the others lay out the checkpoint's weights
dequantised to f32 themselves, and say so for a quantised config (until 2026-12-02 every
comparison did, silently). Prints
per shape the median ms of each and the variant/baseline time ratio (< 1: the variant is
faster); for precision also the smallest row count (B x Q) from which bf16 is faster for
every measured shape: the suggested bf16_matmul_min_rows. A benchmark, not a test: run
it alone on an idle machine. One run's ratio moves by several percent on a VM (two
variants laid out alike: 0.89-1.15x, medians 0.99-1.01x; PERFORMANCE.md, "Session
50"): for effects of a few percent take the median of several runs (`python -m
tools.bench_trees --base REV -- jaxserve bench step ... --json {json}` runs the command
from two trees).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.pages import PAGE_ORDERS, page_ids


DEFAULT_SHAPES = ("decode:1x16,decode:2x16,decode:4x16,decode:8x16,decode:16x16,decode:32x16,"
                  "decode:32x64,prefill:1x64,prefill:1x512,prefill:4x128")


def parse_shape(text: str) -> tuple[str, int, int, int]:
    """"decode:32x16" -> ("decode", 32, 16, 0); "mixed:31x16x225" -> ("mixed", 31, 16,
    225) (the prompt's tokens last). Raises ValueError on a malformed shape."""
    kind, _, dims = text.partition(":")
    parts = dims.split("x")
    want = 3 if kind == "mixed" else 2
    if kind not in ("decode", "prefill", "mixed") or len(parts) != want \
            or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r}: expected decode:BxPAGES, prefill:BxTOKENS or "
                         "mixed:BxPAGESxTOKENS (positive integers)")
    return kind, int(parts[0]), int(parts[1]), int(parts[2]) if kind == "mixed" else 0


def shape_sequences(kind: str, B: int, L: int, T: int, page_size: int,
                    room: int = 3) -> list[tuple[int, int, int]]:
    """A shape's sequences, in make_batch's order, as (query tokens, KV pages, context
    tokens): B prompts of L tokens; or B decode rows of L pages (room slots left free at
    their end) and, for mixed, a T-token prompt after them."""
    if kind == "prefill":
        return [(L, -(-L // page_size), L)] * B
    seqs = [(1, L, L * page_size - room)] * B
    if kind == "mixed":
        seqs.append((T, -(-T // page_size), T))
    return seqs


def shape_pages(kind: str, B: int, L: int, T: int, page_size: int) -> int:
    """KV pages a shape's batch uses (make_batch)."""
    return sum(p for _, p, _ in shape_sequences(kind, B, L, T, page_size))


def make_batch(kind: str, B: int, L: int, page_size: int, num_pages: int, rng,
               ragged: bool = False, room: int = 3, T: int = 0, page_order: str = "random"):
    """A full random batch of the shape (every row real), as the engine would build it:
    (StepBatch, SamplingBatch), every sequence sampled greedily. ragged: decode rows get
    contexts drawn uniformly from 1 .. L pages; room: slots left free at the end of a full decode row's L pages
    (multi-step decode writes there); T: a mixed step's prompt tokens, after the B decode
    rows (its own pages, positions 0 .. T - 1); page_order: where the sequences' pages lie
    in the pool (jaxserve.bench.pages.PAGE_ORDERS). Raises ValueError when the pool's
    num_pages - 1 pages (page 0 is the null page) cannot hold the batch."""
    from jaxserve.worker.input_batch import empty_batch
    from jaxserve.sample.sampler import SamplingBatch
    from jaxserve.sampling_params import SamplingParams

    seqs = shape_sequences(kind, B, L, T, page_size, room)
    S, P = len(seqs), max(p for _, p, _ in seqs)
    b = empty_batch(sum(q for q, _, _ in seqs), S, P, decode=kind == "decode")
    pages = page_ids(rng, num_pages - 1, page_order)
    need = shape_pages(kind, B, L, T, page_size)
    if need > len(pages):
        raise ValueError(f"{kind}:{B}x{L}{f'x{T}' if T else ''} needs {need} pages, the pool "
                         f"has {len(pages)}")
    row = used = 0
    for i, (Q, n_pages, ctx) in enumerate(seqs):
        table = pages[used:used + n_pages]
        used += n_pages
        if ragged and Q == 1:
            ctx = int(rng.integers(1, ctx + 1))  # room stays free in every row
        pos = np.arange(ctx - Q, ctx)
        rows = slice(row, row + Q)
        b.tokens[rows] = rng.integers(100, 30000, Q)
        b.positions[rows] = pos
        b.slot_mapping[rows] = table[pos // page_size] * page_size + pos % page_size
        b.block_tables[i, :n_pages] = table
        b.seq_lens[i] = ctx
        row += Q
        b.query_start[i + 1] = row
        b.logits_indices[i] = row - 1
    s = SamplingBatch.from_params([SamplingParams(temperature=0)] * S, [0] * S, [0] * S, S)
    return b, s


def time_steps(runners: dict, batch, sampling, repeats: int) -> dict:
    """{name: median seconds of `repeats` runs of one step} of each runner, after one
    untimed run each; the runners take turns run by run, so that a machine whose speed
    drifts (a VM) slows them alike."""
    times = {name: [] for name in runners}
    for r in runners.values():
        r.run(batch, sampling)
    for _ in range(repeats):
        for name, r in runners.items():
            t0 = time.perf_counter()
            r.run(batch, sampling)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def served(params, ecfg, cache_dir: Path, swiglu_epilogue: bool = True):
    """(params, kernels) as the engine serves f32 `params` with `ecfg` on one CPU device:
    the kernels it selects, the bf16 weight copies of bf16_matmul_min_rows (swiglu_epilogue:
    see jaxserve.worker.kernel_selection.layout_params)."""
    from jaxserve.worker.kernel_selection import prepare_params, select_kernels

    kernels = select_kernels(ecfg.kernels, "cpu", 1, "float32", cache_dir / "kernels")
    return prepare_params(params, ecfg.kernels, kernels,
                          swiglu_epilogue=swiglu_epilogue), kernels


def time_per_token(runner, batch, sampling, num_steps: int, repeats: int,
                   tokens: int = 64) -> float:
    """Median seconds per decoded token (per row) of `repeats` runs, each dispatching
    tokens / num_steps steps back to back (the engine overlaps its host work the same
    way) and waiting for the last one; after one untimed run."""
    def once():
        handles = [runner.dispatch(batch, sampling, num_steps)
                   for _ in range(max(1, tokens // num_steps))]
        runner.fetch(handles[-1])
        return len(handles) * num_steps
    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = once()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def main(argv: list[str] | None = None, prog: str = "jaxserve bench step") -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2_135m", help="a shipped config's name or a path")
    ap.add_argument("--cache-dir")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compare", choices=("precision", "attention", "matmul", "f32_panels",
                                          "fusion", "swiglu", "round_x", "decode_steps",
                                          "kv_dtype", "huge_pages"),
                    default="precision")
    ap.add_argument("--decode-steps", type=int,
                    help="multi-step decode tokens for --compare decode_steps (default: the config's)")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16",
                    help="--compare kv_dtype: baseline,variant KV cache dtypes "
                         "(--kv-cache-dtype's values)")
    ap.add_argument("--ragged", action="store_true", help="decode rows of random context length")
    ap.add_argument("--page-order", choices=PAGE_ORDERS, default="random",
                    help="where the sequences' pages lie in the KV pool (jaxserve.bench.pages; "
                         "the engine's page pool gives extents)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    from jaxserve.config.cache import KV_CACHE_DTYPES
    kv_names = args.kv_dtypes.split(",")
    if len(kv_names) != 2 or not all(KV_CACHE_DTYPES.get(d) for d in kv_names):
        sys.exit(f"--kv-dtypes: two of {[d for d in KV_CACHE_DTYPES if d != 'auto']}, "
                 f"comma-separated, got {args.kv_dtypes!r}")
    kv_pair = [KV_CACHE_DTYPES[d] for d in kv_names]

    from jaxserve.engine.builder import enable_compilation_cache
    from jaxserve.checkpoint import load_model_config, load_params
    from jaxserve.config import load_config
    from jaxserve.worker.runner import Runner
    from jaxserve.worker.kernel_selection import loop_layers, select_kernels
    from jaxserve.model.kv_cache import init_kv_cache, num_pages_for_budget
    from jaxserve.worker.huge_pages import advise_huge_pages
    from jaxserve.model.weight_layouts import dual_precision_params
    from jaxserve.model.transformer import Kernels
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint

    cfg = load_config(args.config)
    cfg = cfg.replace(engine=dataclasses.replace(  # on one CPU device: decode_steps for it
        cfg.engine, scheduler=cfg.engine.scheduler.resolve("cpu")))
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    enable_compilation_cache(cache_dir)
    # the comparisons whose variants are both laid out as the engine serves the config
    # (served()) load its weights as it does (Config.quantization: GGUF blocks kept); the
    # others lay out f32 weights themselves
    as_served = args.compare in ("attention", "swiglu", "decode_steps", "huge_pages",
                                 "kv_dtype")
    ckpt = resolve_checkpoint(cfg.source, cache_dir, cfg.quantization if as_served else None)
    if cfg.quantization and not as_served:
        print(f"the config's quantization {cfg.quantization!r} is not applied: --compare "
              f"{args.compare} lays out the checkpoint's weights dequantised to f32")
    model_cfg = load_model_config(ckpt).replace(dtype="float32")
    params = load_params(ckpt, model_cfg)
    ps = cfg.engine.cache.page_size
    num_pages = 1 + max(shape_pages(k, B, L, T, ps) for k, B, L, T in shapes)
    # room in the block tables for the longest shape (decode:32x256 is 4,096 tokens a row)
    longest = max(max(T, L * ps) if k != "prefill" else L for k, _, L, T in shapes)
    if longest > cfg.engine.max_model_len:
        cfg = cfg.override(max_model_len=-(-longest // ps) * ps)
    max_seqs = cfg.engine.scheduler.max_num_seqs
    for k, B, L, T in shapes:
        n_seqs = len(shape_sequences(k, B, L, T, ps))
        if n_seqs > max_seqs:
            sys.exit(f"--shapes {k}:{B}x{L}{f'x{T}' if T else ''}: {n_seqs} sequences in one "
                     f"step, the config's max_num_seqs is {max_seqs}")
    if args.compare == "precision":
        ecfg = cfg.engine.override(bf16_matmul_min_rows=None, bf16_matmul_max_rows=None,
                                   bf16_matmul_round_x_min_rows=None, weight_quant=None)
        xla = Kernels("xla", "xla")
        base, var = "f32", "bf16"
        variants = {base: (params, xla),
                    var: (dual_precision_params(params, min_rows=1), xla)}  # bf16 at every shape
    elif args.compare == "attention":
        ecfg = cfg.engine.override(attention_impl="cpu")
        params, kernels = served(params, ecfg, cache_dir)
        base, var = "xla", "cpu"
        variants = {base: (params, dataclasses.replace(kernels, attention="xla")),
                    var: (params, kernels)}
    elif args.compare == "round_x":
        ecfg = cfg.engine.override(matmul_impl="cpu", bf16_matmul_min_rows=1,
                                   bf16_matmul_max_rows=None, bf16_matmul_round_x_min_rows=1)
        params_x, kernels = served(params, ecfg, cache_dir)
        if kernels.round_x_min_rows is None:
            sys.exit("--compare round_x: this CPU's bf16 dot products are not faster than "
                     "f32 FMAs (or it has no AVX512-BF16)")
        base, var = "f32x", "bf16x"
        variants = {base: (dual_precision_params(params, 1, packed=True),
                           dataclasses.replace(kernels, round_x_min_rows=None)),
                    var: (params_x, kernels)}
    elif args.compare == "swiglu":
        ecfg = cfg.engine
        base, var = "unfused", "epilogue"
        variants = {base: served(params, ecfg, cache_dir, swiglu_epilogue=False),
                    var: served(params, ecfg, cache_dir)}
    elif args.compare == "decode_steps":
        ecfg = cfg.engine
        params, kernels = served(params, ecfg, cache_dir)
        n = args.decode_steps or ecfg.scheduler.decode_steps
        if n < 2 or any(k != "decode" for k, *_ in shapes):
            sys.exit("--compare decode_steps: needs --decode-steps >= 2 (or a config with "
                     "decode_steps >= 2) and decode shapes only")
        base, var = "1/step", f"{n}/step"
        variants = {base: (params, kernels)}  # one runner: both step kinds, same pool
    elif args.compare == "huge_pages":
        ecfg = cfg.engine
        params, kernels = served(params, ecfg, cache_dir)
        base, var = "4KiB", "huge"
        # the variant's own copy of every buffer, its pages advised alone
        variants = {base: (params, kernels), var: (jax.tree.map(jnp.copy, params), kernels)}
    elif args.compare == "kv_dtype":
        ecfg = cfg.engine.override(cache_dtype=kv_names[1])  # kernels for the variant's pool
        params, kernels = served(params, ecfg, cache_dir)
        base, var = (f"{d}kv" for d in kv_pair)
        variants = {base: (params, kernels), var: (params, kernels)}
    else:  # the C++ matmul (every shape) against f32 in XLA's dot, or unfused calls
        ecfg = cfg.engine.override(matmul_impl="cpu", bf16_matmul_min_rows=1,
                                   bf16_matmul_max_rows=None)
        kernels = select_kernels(ecfg.kernels, "cpu", 1, "float32", cache_dir / "kernels")
        if args.compare == "fusion":
            base, var = "unfused", "fused"
            variants = {base: (dual_precision_params(params, 1, packed=True, fuse=False), kernels),
                        var: (dual_precision_params(params, 1, packed=True), kernels)}
        else:  # matmul: bf16 copies; f32_panels: the f32 weights themselves
            f32 = args.compare == "f32_panels"
            base, var = "f32", "f32cpu" if f32 else "bf16cpu"
            packed = (dual_precision_params(params, 1, packed=True, copy_dtype=np.float32) if f32
                      else dual_precision_params(params, 1, packed=True))
            variants = {base: (params, dataclasses.replace(kernels, matmul="xla")),
                        var: (packed, kernels)}
    # the served KV dtype where both variants run the config's kernels, else f32 (XLA
    # attention in the precision comparison)
    served_kv = args.compare in ("swiglu", "round_x", "decode_steps", "huge_pages")
    kv_dtype = (ecfg.cache.cache_dtype or "float32") if served_kv else "float32"
    pools = {name: (kv_dtype, num_pages) for name in variants}
    if args.compare == "kv_dtype":
        pools = {name: (dt, max(num_pages, num_pages_for_budget(model_cfg, ps, dt,
                                                                ecfg.cache.kv_cache_memory_bytes)))
                 for name, dt in zip((base, var), kv_pair)}
    runners = {}
    for name, (p, kernels) in variants.items():
        # the layers as the engine runs them: one loop over stacked weights and a stacked
        # pool where it would (CompilationConfig.layer_loop), else unrolled
        p, looped = loop_layers(p, ecfg.compilation.layer_loop, kernels, 1)
        print(f"{name}: {'a loop over the stacked layers' if looped else 'layers unrolled'}")
        pool = init_kv_cache(model_cfg, pools[name][1], ps, pools[name][0],
                             layout="head_major", stacked=looped)
        # the buffers in huge pages where the engine would put them (the huge_pages
        # comparison: the variant's only)
        if (name == var if args.compare == "huge_pages" else ecfg.kernels.cpu_huge_pages):
            advise_huge_pages(p, zeros=pool)
        runners[name] = Runner(model_cfg, ecfg, p, pool, kernels)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'shape':>16} {'rows':>5} {base + ' ms':>9} {var + ' ms':>9} {var + '/' + base:>9}")
    for kind, B, L, T in shapes:
        if args.compare == "decode_steps":
            batch, sampling = make_batch(kind, B, L, ps, num_pages, rng, args.ragged, room=n + 1,
                                         page_order=args.page_order)
            r = runners[base]
            t = {base: time_per_token(r, batch, sampling, 1, args.repeats),
                 var: time_per_token(r, batch, sampling, n, args.repeats)}
        else:
            batch, sampling = make_batch(kind, B, L, ps, num_pages, rng, args.ragged, T=T,
                                         page_order=args.page_order)
            t = time_steps(runners, batch, sampling, args.repeats)
        n_rows = len(batch.tokens)
        shape = f"{kind}:{B}x{L}" + (f"x{T}" if kind == "mixed" else "")
        rows.append({"shape": shape, "rows": n_rows, f"{base}_ms": t[base] * 1e3,
                     f"{var}_ms": t[var] * 1e3, "ratio": t[var] / t[base]})
        print(f"{rows[-1]['shape']:>16} {n_rows:>5} {t[base] * 1e3:9.1f} {t[var] * 1e3:9.1f} "
              f"{t[var] / t[base]:9.2f}", flush=True)
    if args.compare in ("attention", "f32_panels", "fusion", "swiglu", "round_x",
                        "decode_steps", "kv_dtype", "huge_pages"):
        if args.json:
            Path(args.json).write_text(json.dumps({"shapes": rows}, indent=1))
        return 0
    lo, hi = suggest_row_range(rows)
    print(f"suggested bf16_matmul_min_rows: {lo}, bf16_matmul_max_rows: {hi} "
          "(min None: bf16 never wins; max None: no upper limit)")
    if args.json:
        Path(args.json).write_text(json.dumps({"shapes": rows, "suggested_min_rows": lo,
                                               "suggested_max_rows": hi}, indent=1))
    return 0


def suggest_row_range(rows: list[dict]) -> tuple[int | None, int | None]:
    """(min_rows, max_rows): the first run of consecutive measured row counts at which the
    variant wins every shape (ratio < 1), starting at its smallest winning row count;
    max_rows None when the run reaches the largest measured row count."""
    counts = sorted({r["rows"] for r in rows})
    wins = {n: all(r["ratio"] < 1 for r in rows if r["rows"] == n) for n in counts}
    lo = hi = None
    for n in counts:
        if wins[n]:
            lo = n if lo is None else lo
            hi = n
        elif lo is not None:
            break
    return lo, (None if hi == counts[-1] else hi)


if __name__ == "__main__":
    sys.exit(main())
