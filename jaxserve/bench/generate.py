"""Offline generation speed against the memory-bandwidth bound, and against HF transformers
in the same run: the one command for a GPU session (issue 28's table), on CPU too.

    jaxserve bench generate [--config llama3_8b] [--load-format dummy]
        [--cases 1x128x256,64x512x256] [--decode-steps 1,auto] [--branches auto]
        [--fuse-projections auto] [--weight-quant auto] [--matmul-impl auto]
        [--fused-decode auto] [--hf]
        [--trace DIR] [--bandwidth-gb-s GB_S]
        [--xla-compiler-options JSON [JSON ...]] [--json out.json]

A case SxPxO is S streams of P-token random prompts, O greedy tokens each (ignore_eos).
For each decode_steps value ("auto": the config's own), and each set of XLA compiler
options given (CompilationConfig.xla_compiler_options; one JSON object per set, `{}`: the
config's, `{"xla_gpu_enable_command_buffer": ""}`: no CUDA graphs), and each value of
--branches (KernelConfig.branches: "device", "host", "auto"; jaxserve.sample.plan),
--fuse-projections (KernelConfig.fuse_projections: "on", "off", "auto";
jaxserve.model.weight_layouts.fuse_projections) and --weight-quant (KernelConfig.weight_quant:
"none", "int8", "fp8_e4m3", "auto") and --matmul-impl (KernelConfig.matmul_impl: "xla",
"pallas", "pallas_mosaic", "pallas_gemv", "auto"; what runs the quantised projections) and
--fused-decode (CompilationConfig.fused_decode: "on", "off", "auto"; a one-token decode step
in one program or two), one engine is built
(`jaxserve.LLM`, warm-up off, room for the largest case) and each case runs on it:
`generate` once on one set of prompts (which compiles the case's step shapes), then timed
on another set of the same lengths (other random tokens, so no prefix-cache hit changes
the shapes); the JAX compile events of the timed call are reported and should be 0. Per
case it prints:

- output tok/s (S x O tokens over the timed call, prefill included);
- the bound: one decode step reads every projection and the LM head once, in the format
  served (jaxserve.bench.bandwidth.weight_bytes_per_token; a GGUF-served model's blocks
  counted from its params: ggml_weight_bytes_per_token), and each stream's K/V up to
  its mean context (P + O / 2 tokens), at the device's read bandwidth measured here (an
  XLA sum over 1 GiB less the same call over 1,024 floats, the median of three samples:
  jaxserve.bench.bandwidth.read_bandwidth_gb_s), or at --bandwidth-gb-s; the ratio
  tok/s / bound (prefill is in the timed call, not in the bound: long prompts lower the
  ratio);
- the host's share of the step loop: host microseconds per engine step (Engine.stats'
  host_seconds: `step()` time not spent waiting for the device) and their fraction of the
  steps' time (on XLA:CPU the call that launches a step runs part of it on the calling
  thread, which counts here as the host's: PERFORMANCE.md, "The host's share of a step");
- with --trace DIR, the device-busy fraction of a third, traced call: the union of the
  device's kernel intervals over the span from its first kernel to its last
  (`busy_fraction`; GPU traces only: XLA:CPU runs its ops on host threads, None there);
- with --hf, HF transformers' eager `generate` on the same shapes and a model of the same
  shape (random weights; bf16 on a GPU, f32 on CPU), timed the same way, and our ratio
  to it. It runs first, in a process of its own (JAX started on a GPU holds most of its
  memory). transformers and torch are the test extras: not installed, it says so.

A benchmark, not a test: run it alone on an idle machine. Source of the cases and the bound:
issue 28's first GPU run (PERFORMANCE.md, "Nothing compiled after warm-up").
"""

from __future__ import annotations

import argparse
import gc
import gzip
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jaxserve.bench.bandwidth import (ggml_weight_bytes_per_token, read_bandwidth_gb_s,
                                      weight_bytes_per_token)

DEFAULT_CASES = "1x128x256,64x512x256"


def parse_case(text: str) -> tuple[int, int, int]:
    """"64x512x256" -> (64, 512, 256): streams, prompt tokens, output tokens. Raises
    ValueError naming the case when it is not three positive integers."""
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--cases: {text!r} is not STREAMSxPROMPTxOUTPUT (positive integers)")
    s, p, o = map(int, parts)
    return s, p, o


def busy_fraction(events: list[dict], device_pids: set) -> float | None:
    """Fraction of the span from the first to the last device kernel during which some
    kernel ran. events: Chrome-trace events ({"ph": "X", "pid", "ts", "dur"} in us);
    device_pids: the pids of the device's streams. None when no kernel ran."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("pid") in device_pids)
    if not spans:
        return None
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    total = max(end for _, end in spans) - spans[0][0]
    return busy / total if total > 0 else 1.0


def device_pids(events: list[dict]) -> set:
    """The pids a perfetto trace of jax.profiler names as GPU devices ("/device:GPU:N")."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:GPU" in str(e.get("args", {}).get("name", ""))}


def trace_busy_fraction(trace_dir: Path) -> float | None:
    """busy_fraction of the newest perfetto trace jax.profiler wrote under trace_dir."""
    traces = sorted(trace_dir.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return None
    with gzip.open(traces[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return busy_fraction(events, device_pids(events))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _prompts(rng, streams: int, length: int, vocab: int) -> list[list[int]]:
    return [rng.integers(10, vocab - 1, length).tolist() for _ in range(streams)]


def parse_compiler_options(text: str) -> tuple[tuple[str, str], ...] | None:
    """One --xla-compiler-options value: a JSON object of XLA option names to string values
    -> CompilationConfig.xla_compiler_options pairs; `{}` -> None (the config's own). Raises
    ValueError for anything else."""
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--xla-compiler-options: {text!r} is not JSON ({e})") from None
    if not isinstance(opts, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in opts.items()):
        raise ValueError(f"--xla-compiler-options: {text!r} is not a JSON object of option "
                         "names to string values")
    return tuple(opts.items()) or None


# The KernelConfig fields one engine per value is built for: flag -> (field, {flag value:
# field value}), "auto" keeping the config's (a field absent from an engine's `kernel`)
KERNEL_AXES = {
    "branches": ("branches", {"device": "device", "host": "host"}),
    "fuse_projections": ("fuse_projections", {"on": True, "off": False}),
    "weight_quant": ("weight_quant", {"none": None, "int8": "int8", "fp8_e4m3": "fp8_e4m3"}),
    "matmul_impl": ("matmul_impl", {"xla": "xla", "pallas": "pallas",
                                    "pallas_mosaic": "pallas_mosaic",
                                    "pallas_gemv": "pallas_gemv"}),
    # not a KernelConfig field, but varied the same way (EngineConfig.override routes it)
    "fused_decode": ("fused_decode", {"on": True, "off": False}),
}


def build_llm(config, cases, decode_steps, cache_dir, compiler_options=None,
              kernel: dict | None = None):
    """The engine the cases run on with one decode_steps value ("auto": the config's),
    XLA compiler options (CompilationConfig.xla_compiler_options pairs; None: the
    config's) and KernelConfig fields and CompilationConfig.fused_decode (`kernel`,
    {flag: value} of KERNEL_AXES; "auto" or absent: the config's; a weight_quant format
    clears the config's bf16 weight copies): `jaxserve.LLM` with warm-up off,
    max_num_seqs and max_model_len raised to hold the largest case."""
    from jaxserve.api import LLM

    fields = {KERNEL_AXES[k][0]: KERNEL_AXES[k][1][v]
              for k, v in (kernel or {}).items() if v != "auto"}
    if fields.get("weight_quant"):  # quantised weights have no bf16 copies (as "fp8" does)
        fields.update(bf16_matmul_min_rows=None, bf16_matmul_max_rows=None,
                      bf16_matmul_round_x_min_rows=None)
        if fields.get("matmul_impl", config.engine.kernels.matmul_impl) == "cpu":
            fields["matmul_impl"] = "auto"
    engine = config.engine.override(
        max_num_seqs=max([s for s, _, _ in cases] + [config.engine.scheduler.max_num_seqs]),
        max_model_len=max([p + o for _, p, o in cases] + [config.engine.max_model_len]),
        **({} if decode_steps == "auto" else {"decode_steps": int(decode_steps)}),
        **({} if compiler_options is None else {"xla_compiler_options": compiler_options}),
        **fields)
    return LLM(config.replace(engine=engine), cache_dir=cache_dir, warmup=False)


def run_case(llm, case, trace_dir: Path | None, bandwidth: float) -> dict:
    """One case on `llm` (`build_llm`): see the module docstring. Returns its figures
    (bandwidth: bytes per second)."""
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.worker import compile_events

    import jax
    streams, prompt_len, out_len = case
    engine = llm.engine.engine_config
    runner = llm.engine.runner
    vocab = llm.engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(list(case))  # each case its own prompts: no prefix hits
    llm.generate(_prompts(rng, streams, prompt_len, vocab), sp)  # compiles the shapes
    before, stats0 = compile_events.snapshot(), llm.engine.stats()
    seconds = _timed(lambda: llm.generate(_prompts(rng, streams, prompt_len, vocab), sp))
    events, stats1 = compile_events.snapshot() - before, llm.engine.stats()
    num_steps = stats1.num_steps - stats0.num_steps
    host_s = stats1.host_seconds - stats0.host_seconds
    step_s = stats1.step_seconds - stats0.step_seconds
    busy = None
    if trace_dir is not None:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            llm.generate(_prompts(rng, streams, prompt_len, vocab), sp)
        busy = trace_busy_fraction(trace_dir)
    model_cfg = llm.engine.model_config
    per_part = (ggml_weight_bytes_per_token(runner.params)
                or weight_bytes_per_token(model_cfg, engine))
    weight_bytes = sum(per_part.values())
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.cache))
    kv_per_token = cache_bytes / (runner.cache.num_pages * runner.cache.page_size)
    step_bytes = weight_bytes + streams * (prompt_len + out_len / 2) * kv_per_token
    bound = streams * bandwidth / step_bytes
    tok_s = streams * out_len / seconds
    out = {"case": "x".join(map(str, case)), "decode_steps": engine.scheduler.decode_steps,
           "branches": "host" if runner.kernels.host_branches else "device",
           "fuse_projections": bool(engine.kernels.fuse_projections),
           "weight_quant": engine.kernels.weight_quant,
           "matmul_impl": runner.kernels.matmul.name,
           "xla_compiler_options": dict(engine.compilation.xla_compiler_options),
           "fused_decode": runner.fused_decode,
           "output_tok_s": tok_s, "seconds": seconds, "bound_tok_s": bound,
           "ratio_to_bound": tok_s / bound, "weight_bytes": weight_bytes,
           "kv_bytes_per_token": kv_per_token, "device_busy": busy, "num_steps": num_steps,
           "host_us_per_step": 1e6 * host_s / max(num_steps, 1),
           "host_share": host_s / step_s if step_s else None,
           "compile_events_timed": events.total}
    return out


def hf_tok_s(model_cfg, case) -> float | str:
    """HF transformers' eager greedy `generate` on `case` with a LlamaForCausalLM of
    model_cfg's shape (random weights, bf16 on CUDA, f32 on CPU): output tok/s of the
    second of two calls; or why it could not run."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        return f"not run: {e.name} is not installed (pip install -e '.[test]')"
    streams, prompt_len, out_len = case
    cuda = torch.cuda.is_available()
    cfg = LlamaConfig(vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.hidden_size,
                      intermediate_size=model_cfg.intermediate_size,
                      num_hidden_layers=model_cfg.num_layers,
                      num_attention_heads=model_cfg.num_heads,
                      num_key_value_heads=model_cfg.num_kv_heads,
                      head_dim=model_cfg.head_dim, rms_norm_eps=model_cfg.rms_norm_eps,
                      max_position_embeddings=prompt_len + out_len,
                      tie_word_embeddings=model_cfg.tie_word_embeddings)
    dtype = torch.bfloat16 if cuda else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the served dtype: no f32 copy of an 8B model
    try:
        with torch.device("cuda" if cuda else "cpu"):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(10, model_cfg.vocab_size - 1, (streams, prompt_len),
                        device=model.device)

    def run():
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        if cuda:
            torch.cuda.synchronize()
    run()
    return streams * out_len / _timed(run)


def parser(prog: str = "jaxserve bench generate") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama3_8b",
                    help="a shipped config's name or a config file (default: llama3_8b)")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="dummy",
                    help="dummy (default): random weights of the config's shape")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="serve only the first N layers (a smaller model of the same width)")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"STREAMSxPROMPTxOUTPUT, comma-separated (default: {DEFAULT_CASES})")
    ap.add_argument("--decode-steps", default="1,auto",
                    help="decode_steps values to run each case with; auto: the config's "
                         "(default: 1,auto)")
    ap.add_argument("--branches", default="auto",
                    help="KernelConfig.branches values to run each case with, comma-separated: "
                         "who decides the sampler's branches, device or host (default: auto)")
    ap.add_argument("--fuse-projections", default="auto",
                    help="KernelConfig.fuse_projections values to run each case with, "
                         "comma-separated: on, off, auto (on a GPU: on) (default: auto)")
    ap.add_argument("--weight-quant", default="auto",
                    help="KernelConfig.weight_quant values to run each case with, "
                         "comma-separated: none, int8, fp8_e4m3, auto (the config's) "
                         "(default: auto)")
    ap.add_argument("--matmul-impl", default="auto",
                    help="KernelConfig.matmul_impl values to run each case with, "
                         "comma-separated: xla, pallas, pallas_mosaic, pallas_gemv, auto "
                         "(the config's) "
                         "(default: auto)")
    ap.add_argument("--fused-decode", default="auto",
                    help="CompilationConfig.fused_decode values to run each case with, "
                         "comma-separated: on (a one-token decode step in one program), off "
                         "(forward, then sampler), auto (on a GPU: on) (default: auto)")
    ap.add_argument("--hf", action="store_true",
                    help="also time HF transformers' eager generate on the same shapes")
    ap.add_argument("--trace", type=Path, default=None, metavar="DIR",
                    help="trace a third call per case with jax.profiler into DIR and report "
                         "the device-busy fraction")
    ap.add_argument("--xla-compiler-options", nargs="+", default=["{}"], metavar="JSON",
                    help="sets of XLA compiler options to run every case with, one JSON object "
                         "each (CompilationConfig.xla_compiler_options); {}: the config's "
                         "(default: {})")
    ap.add_argument("--bandwidth-gb-s", type=float, default=None, metavar="GB_S",
                    help="the read bandwidth the bound uses, in GB/s (default: measured here, "
                         "jaxserve.bench.bandwidth.read_bandwidth_gb_s); e.g. 4300, the "
                         "device-to-device copy rate seen on an H200")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    return ap


def main(argv: list[str] | None = None, prog: str = "jaxserve bench generate") -> int:
    """Run the cases; print a table (stdout) and optionally write JSON. Exit status 2 for a
    bad flag."""
    args = parser(prog).parse_args(argv)
    from jaxserve.config import ConfigError, load_config
    try:
        cases = [parse_case(c) for c in args.cases.split(",")]
        steps = args.decode_steps.split(",")
        for s in steps:
            if s != "auto" and not (s.isdigit() and int(s) > 0):
                raise ValueError(f"--decode-steps: {s!r} is not a positive integer or auto")
        if args.bandwidth_gb_s is not None and not args.bandwidth_gb_s > 0:
            raise ValueError(f"--bandwidth-gb-s: must be a positive number of GB/s, got "
                             f"{args.bandwidth_gb_s}")
        option_sets = [parse_compiler_options(o) for o in args.xla_compiler_options]
        kernel_axes = {}  # flag -> its values, each checked
        for flag in KERNEL_AXES:
            values, allowed = getattr(args, flag).split(","), ("auto", *KERNEL_AXES[flag][1])
            for x in values:
                if x not in allowed:
                    raise ValueError(f"--{flag.replace('_', '-')}: {x!r} is not one of "
                                     f"{', '.join(allowed)}")
            kernel_axes[flag] = values
        overrides = {"load_format": args.load_format}
        if args.num_layers is not None:
            overrides["num_layers"] = args.num_layers
        config = load_config(args.config).override(**overrides)
    except (ValueError, ConfigError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    hf = {}
    if args.hf:  # first, in a process of its own: JAX, once started on a GPU, holds most of
        # its memory (XLA's preallocation, then the KV pool), and torch would get the rest
        import multiprocessing

        from jaxserve.checkpoint.sources import default_cache_dir
        from jaxserve.engine.builder import resolve_model_config
        model_cfg, _ = resolve_model_config(config, Path(args.cache_dir or default_cache_dir()))
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            hf = dict(zip(cases, pool.starmap(hf_tok_s, [(model_cfg, c) for c in cases])))
    import jax
    device = jax.devices()[0]
    bandwidth = (args.bandwidth_gb_s if args.bandwidth_gb_s is not None
                 else statistics.median(read_bandwidth_gb_s(samples=3))) * 1e9
    print(f"{device.device_kind} ({device.platform}), read bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s, config {config.name}", flush=True)
    results = []
    # one engine per option set, decode_steps value and value of each kernel axis, freed
    # before the next; the axes given more than one value name it (label, trace folder)
    varied = [k for k, values in kernel_axes.items() if len(values) > 1]
    for (v, opts), s, *kv in itertools.product(enumerate(option_sets), steps,
                                               *kernel_axes.values()):
        kernel = dict(zip(kernel_axes, kv))
        label = ("" if opts is None else " " + json.dumps(dict(opts))) + "".join(
            f" {k} {kernel[k]}" for k in varied)
        try:
            llm = build_llm(config, cases, s, args.cache_dir, opts, kernel)
            for case in cases:
                name = (f"{'x'.join(map(str, case))}-{s}" + (f"-options{v}" if v else "")
                        + "".join(f"-{kernel[k]}" for k in varied))
                r = run_case(llm, case, args.trace / name if args.trace else None, bandwidth)
                results.append(r)
                busy = "-" if r["device_busy"] is None else f"{r['device_busy']:.0%}"
                print(f"{r['case']:>14} decode_steps {r['decode_steps']:>2}{label}: "
                      f"{r['output_tok_s']:9.1f} tok/s, bound {r['bound_tok_s']:9.1f} "
                      f"({r['ratio_to_bound']:.0%}), host {r['host_us_per_step']:.0f} us/step "
                      f"({r['host_share']:.0%} of the step loop), device busy {busy}, "
                      f"compile events in the timed call {r['compile_events_timed']}",
                      flush=True)
        except ConfigError as e:  # an option set XLA does not take: refused at the start
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        del llm
        gc.collect()
    for case in cases:
        if case in hf:
            name = "x".join(map(str, case))
            mine = max(r["output_tok_s"] for r in results if r["case"] == name)
            for r in results:
                if r["case"] == name:
                    r["hf_tok_s"] = hf[case]
            line = (f"{hf[case]:9.1f} tok/s; jaxserve's best {mine / hf[case]:.2f}x"
                    if isinstance(hf[case], float) else hf[case])
            print(f"{name:>14} HF transformers eager: {line}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": device.device_kind,
                                         "read_bandwidth": bandwidth, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
