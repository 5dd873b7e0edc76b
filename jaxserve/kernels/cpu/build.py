"""Compile, cache and register the C++ kernels of this package.

`load_library(build_dir)` compiles every `*.cc` here (with the shared `*.h`) into one
shared library with the
system C++ compiler (g++, c++ or clang++ on PATH) against `jax.ffi.include_dir()`, caches it
under `build_dir` keyed by a hash of the sources, compiler flags, compiler version, jaxlib
version and this CPU's instruction-set flags (the library is built with -march=native), and
registers each handler in HANDLERS with `jax.ffi.register_ffi_target` for the "cpu"
platform. A second call (any build_dir) returns the loaded library at once.

The first build takes seconds (a C++ compile); later processes load the cached file.
Raises KernelBuildError (with the compiler's output) when no compiler is found or the
build fails.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

SOURCE_DIR = Path(__file__).resolve().parent
# FFI handler symbol in the library -> target name it is registered under.
HANDLERS = {"JaxservePagedAttention": "jaxserve_paged_attention",
            "JaxserveBf16Matmul": "jaxserve_bf16_matmul",
            "JaxserveBf16MatmulBf16x": "jaxserve_bf16_matmul_bf16x",
            "JaxserveF32Matmul": "jaxserve_f32_matmul",
            "JaxserveArgmaxLogsumexp": "jaxserve_argmax_logsumexp",
            "JaxserveGgmlMatmul": "jaxserve_ggml_matmul",
            "JaxserveLoraMatmul": "jaxserve_lora_matmul",
            "JaxserveLoraDelta": "jaxserve_lora_delta"}
COMPILERS = ("g++", "c++", "clang++")
# -fassociative-math (with its prerequisites) lets the compiler vectorise the f32 dot
# products' reductions; no -ffast-math: the kernels rely on -inf / NaN semantics.
CXXFLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
            "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math")

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded (message holds the reason)."""


def find_compiler() -> str | None:
    """Path of the first C++ compiler of COMPILERS on PATH, or None."""
    for name in COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key(compiler: str, sources: list[Path], extra_flags: tuple[str, ...] = ()) -> str:
    """The cache key of a library built from `sources` (sources and headers) with
    CXXFLAGS + extra_flags by `compiler`: 16 hex digits of a hash of the sources, the
    flags, the compiler's version, jaxlib's version and this CPU's instruction-set flags."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    flags = " ".join(CXXFLAGS + tuple(extra_flags))
    for part in ([s.read_bytes() for s in sources] +
                 [flags.encode(), version.encode(), jaxlib.__version__.encode(),
                  platform.machine().encode(), _cpu_flags().encode()]):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _compile(compiler: str, sources: list[Path], target: Path,
             extra_flags: tuple[str, ...] = ()) -> None:
    """Compile `sources` into the shared library `target` (CXXFLAGS, then extra_flags: a
    later -march wins, which is how the tests build the portable, non-AVX-512 path)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *CXXFLAGS, *extra_flags, "-I", jax.ffi.include_dir(), "-I", str(SOURCE_DIR),
           *map(str, sources), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise KernelBuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n"
                               f"{proc.stderr[-4000:]}")
    os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same file


def load_library(build_dir: Path, compiler: str | None = None) -> ctypes.CDLL:
    """Build (once, cached in `build_dir`) and load the kernels, registering their FFI
    targets. compiler: a C++ compiler path, None = find_compiler(). Thread-safe.
    Raises KernelBuildError if there is no compiler or the build or load fails."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        compiler = compiler or find_compiler()
        if compiler is None:
            raise KernelBuildError(f"no C++ compiler found (looked for {', '.join(COMPILERS)} "
                                   "on PATH); install g++ or use attention_impl='xla'")
        sources = sorted(SOURCE_DIR.glob("*.cc"))
        headers = sorted(SOURCE_DIR.glob("*.h"))
        key = build_key(compiler, sources + headers)
        target = Path(build_dir) / f"jaxserve_cpu_kernels-{key}.so"
        if not target.exists():
            _compile(compiler, sources, target)
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as e:
            raise KernelBuildError(f"loading {target} failed: {e}") from e
        for symbol, name in HANDLERS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
        _loaded = lib
        return lib
