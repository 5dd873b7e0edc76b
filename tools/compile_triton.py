"""Compile the Pallas (Triton backend) kernels to cubin offline and report, per kernel and
GPU architecture, registers, spills, shared memory, stack frame and cubin size.

No GPU and no CUDA driver are needed: JAX lowers each kernel for the "cuda" platform on
the CPU, the Triton-dialect module that Pallas embeds in every
`stablehlo.custom_call @__gpu$xla.gpu.triton` is read back, and pip's `triton` compiles it
(TTIR -> TTGIR -> LLVM IR -> PTX) for each explicit target; the `ptxas` that ships inside
the triton wheel then assembles the PTX to cubin with `-v`, whose report gives the numbers.

    python -m tools.compile_triton                      # our kernels, sm_80 and sm_90
    python -m tools.compile_triton --arch sm_90 --kernels quantized_matmul --json out.json
    python -m tools.compile_triton --demo               # JAX's shipped Pallas GPU kernels

`triton` must be importable; install it in a separate venv (the project venv stays
triton-free), e.g. one whose site-packages sees the project's through a .pth file.

What the numbers are (and are not): XLA compiles these custom calls with its own bundled
Triton and its own LLVM, so register counts from pip's triton are a close estimate, not the
exact figure a GPU run would show. The TTIR is lowered once, with jaxlib's driverless
fallback compute capability (9.0); on a real sm_80 device the lowering itself would reject
float8_e4m3fn casts (they need sm_89+), which shows here as an error row.
Columns: `smem` is the shared memory the kernel needs at launch: Triton's dynamic
allocation (`shared` in its metadata) plus any static `.shared` ptxas reports; `stack` is
the per-thread stack frame and `spill st/ld` the spill store/load bytes, both from ptxas;
`loop` the instructions of the kernel's largest loop (its K loop) in the SASS that the
wheel's nvdisasm lists, with their opcodes in the JSON (`loop_ops`): over the elements a
thread handles in one trip, the instructions an element costs (session 30's GEMV counts,
PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parent.parent

TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
# Newer jaxlibs compile the kernel at lowering time (needs a GPU) and embed PTX instead.
TRITON_FFI_CALL_TARGET = "triton_kernel_call_ffi"
DEFAULT_ARCHS = ("sm_80", "sm_90")
KERNELS = ("paged_attention", "flash_attention", "quantized_matmul", "ggml_matmul")
NO_TRITON_MESSAGE = ("compile_triton: pip's `triton` is not importable by this Python; "
                     "`pip install triton` in a separate venv (keep the project venv free of it) "
                     "and run this tool with that venv's python")


class TritonUnavailable(RuntimeError):
    """pip's triton (with its NVIDIA backend) cannot be imported."""


# ----------------------------------------------------------------------------- extraction

@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Pallas Triton kernel found in a lowered module.

    name: the kernel's (sanitised) function name; grid: (x, y, z) launch grid;
    num_warps / num_stages: Triton compiler params; ttir: the Triton-dialect module as
    text in MLIR's custom (pretty) form; ttir_generic: the same in MLIR's generic op form
    (a fallback for parsers whose custom op syntax differs).
    """

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    ttir: str
    ttir_generic: str


@functools.lru_cache(maxsize=1)
def _jax_triton_context():
    """One jaxlib MLIR context knowing StableHLO and the (jaxlib) Triton dialect."""
    from jax._src.interpreters import mlir
    from jax._src.lib.triton import dialect as tt_dialect

    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    return ctx


def ttir_bytecode_to_text(bytecode: bytes, *, generic: bool = False) -> str:
    """The text of a Triton-dialect module given as MLIR bytecode (what Pallas stores in
    the custom call's `ir` field), parsed with jaxlib's MLIR and Triton dialect.

    generic=True prints MLIR's generic op form. Locations are omitted.
    Raises the MLIR parser's error (jaxlib `MLIRError`/`ValueError`) on invalid bytecode.
    """
    from jax._src.lib.mlir import ir

    with _jax_triton_context():
        module = ir.Module.parse(bytecode)
        return module.operation.get_asm(enable_debug_info=False, print_generic_op_form=generic)


def extract_triton_calls(lowered: Any) -> list[TritonCall]:
    """Every Pallas Triton kernel in a module lowered for CUDA, in walk order.

    lowered: a `jax.stages.Lowered` (from `.lower(lowering_platforms=("cuda",))`), its
    StableHLO text (`Lowered.as_text()`), or a jaxlib `ir.Module`.
    Returns a list of TritonCall (empty if the module holds no Triton custom call).
    Raises ValueError if the module holds only already-compiled `triton_kernel_call_ffi`
    calls (a jaxlib newer than 0.10.2 compiling with a GPU present) or a malformed
    backend_config; the MLIR parser's error if the text does not parse.
    """
    from jax._src.lib.mlir import ir

    if isinstance(lowered, str):
        text = lowered
    elif hasattr(lowered, "as_text"):
        text = lowered.as_text()
    else:
        text = str(lowered)
    raw: list[dict[str, Any]] = []
    ffi_calls = 0
    with _jax_triton_context():
        module = ir.Module.parse(text)

        def visit(op):
            nonlocal ffi_calls
            if op.name == "stablehlo.custom_call":
                target = ir.StringAttr(op.attributes["call_target_name"]).value
                if target == TRITON_FFI_CALL_TARGET:
                    ffi_calls += 1
                elif target == TRITON_CALL_TARGET:
                    raw.append(_backend_config(op))
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
    if not raw and ffi_calls:
        raise ValueError(f"found {ffi_calls} `{TRITON_FFI_CALL_TARGET}` call(s) (kernels compiled "
                         f"by jaxlib, no Triton IR kept); lower without a GPU visible")
    return [TritonCall(name=d["name"], grid=(d["grid_x"], d["grid_y"], d["grid_z"]),
                       num_warps=d["num_warps"], num_stages=d["num_stages"],
                       ttir=ttir_bytecode_to_text(d["ir"]),
                       ttir_generic=ttir_bytecode_to_text(d["ir"], generic=True))
            for d in raw]


def _backend_config(op) -> dict[str, Any]:
    """The fields of a `__gpu$xla.gpu.triton` custom call's backend_config dict."""
    from jax._src.lib.mlir import ir

    attrs = op.attributes
    if "mhlo.backend_config" not in attrs:
        raise ValueError(f"{TRITON_CALL_TARGET} call without an mhlo.backend_config dict")
    cfg = ir.DictAttr(attrs["mhlo.backend_config"])
    out: dict[str, Any] = {"name": ir.StringAttr(cfg["name"]).value,
                           "ir": ir.StringAttr(cfg["ir"]).value_bytes}
    for key in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z"):
        out[key] = ir.IntegerAttr(cfg[key]).value
    return out


def lower_for_cuda(fn: Callable, args: Sequence[Any], kwargs: dict[str, Any] | None = None):
    """`jax.jit(fn)` traced with `args` (arrays or ShapeDtypeStructs; `kwargs` bound
    statically) and lowered for CUDA without a GPU (for an H100:
    jaxserve.kernels.pallas.lowering.cuda_target). Returns the `jax.stages.Lowered`.
    Raises whatever tracing/lowering raises (e.g. a kernel rejecting the shapes)."""
    import jax

    from jaxserve.kernels.pallas.lowering import cuda_target

    f = functools.partial(fn, **(kwargs or {}))
    with cuda_target():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


# ----------------------------------------------------------------------------- compilation

@dataclasses.dataclass
class PtxasStats:
    """What `ptxas -v` reports for the entry function (bytes unless said otherwise)."""

    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    smem: int = 0          # static .shared only; Triton's shared memory is dynamic
    cmem: int | None = None  # cmem[0]: kernel parameters and constants
    barriers: int | None = None


_RE_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_RE_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers")
_RE_SMEM = re.compile(r"(\d+) bytes smem")
_RE_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")
_RE_BARRIERS = re.compile(r"used (\d+) barriers")


def parse_ptxas_log(log: str, entry: str | None = None) -> PtxasStats:
    """PtxasStats of one entry function from a `ptxas -v` log.

    log: ptxas's stderr/stdout; entry: the function's name (default: the first entry
    function in the log, or the whole log if it names none). Fields stay None when the
    log lacks them. Never raises for an unexpected log.
    """
    sections = _RE_ENTRY.split(log)  # [preamble, name1, body1, name2, body2, ...]
    body = log
    if len(sections) >= 3:
        pairs = dict(zip(sections[1::2], sections[2::2]))
        body = pairs.get(entry, sections[2]) if entry else sections[2]
    stats = PtxasStats()
    if m := _RE_FRAME.search(body):
        stats.stack_frame, stats.spill_stores, stats.spill_loads = map(int, m.groups())
    if m := _RE_USED.search(body):
        stats.registers = int(m.group(1))
    if m := _RE_SMEM.search(body):
        stats.smem = int(m.group(1))
    if m := _RE_CMEM.search(body):
        stats.cmem = int(m.group(1))
    if m := _RE_BARRIERS.search(body):
        stats.barriers = int(m.group(1))
    return stats


_RE_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_RE_SASS_INSN = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)")
_RE_SASS_BRANCH = re.compile(r"BRA\s+`?\((\.L_x_\d+)\)")


def sass_loop(sass: str) -> tuple[int, dict[str, int]]:
    """The largest loop of `sass` (nvdisasm's listing of one kernel): (instructions from
    the label a backward branch jumps to through that branch, {opcode: count} over them,
    opcodes without their modifiers: "LDG.E.128" counts as LDG). (0, {}) when the kernel
    has no loop. A kernel's K loop is its largest: its instructions over the weight
    elements a thread handles in one trip give the instructions a weight element."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := _RE_SASS_LABEL.match(l))}
    best = (0, 0, -1)
    for i, line in enumerate(lines):
        m = _RE_SASS_BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            start = labels[m.group(1)]
            n = sum(1 for l in lines[start:i + 1] if _RE_SASS_INSN.match(l))
            if n > best[0]:
                best = (n, start, i)
    ops: dict[str, int] = {}
    for l in lines[best[1]:best[2] + 1]:
        if m := _RE_SASS_INSN.match(l):
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return best[0], dict(sorted(ops.items(), key=lambda kv: -kv[1]))


@dataclasses.dataclass
class CompileResult:
    """One kernel compiled for one arch: the PTX and cubin, Triton's metadata (`shared`:
    dynamic shared memory bytes, `name`, ...), the ptxas stats and log, the ptxas used,
    and which TTIR text form triton parsed ("custom" or "generic"); sass: nvdisasm's
    listing (the nvdisasm beside ptxas in the triton wheel; "" without one)."""

    arch: str
    ptx: str
    cubin: bytes
    metadata: dict[str, Any]
    stats: PtxasStats
    ptxas_log: str
    ptxas: str
    ttir_form: str
    sass: str = ""


def _import_triton():
    """(triton, helpers) with the NVIDIA backend; raises TritonUnavailable."""
    if importlib.util.find_spec("triton") is None:
        raise TritonUnavailable(NO_TRITON_MESSAGE)
    try:
        import triton
        from triton._C.libtriton import ir as tir
        from triton.backends.compiler import GPUTarget, Language
        from triton.backends.nvidia import compiler as nv
        from triton.compiler.compiler import make_backend
    except Exception as e:  # a broken or CPU-less build: one line, no trace
        raise TritonUnavailable(f"{NO_TRITON_MESSAGE} (import failed: {type(e).__name__}: {e})") from e
    return triton, dict(ir=tir, GPUTarget=GPUTarget, Language=Language, nv=nv, make_backend=make_backend)


def triton_available() -> str | None:
    """None if pip's triton with its NVIDIA backend imports, else the one-line reason."""
    try:
        _import_triton()
    except TritonUnavailable as e:
        return str(e)
    return None


def parse_arch(arch: str) -> int:
    """The compute capability of "sm_80" / "sm80" / "80" / "sm_90a" (-> 80, 90).
    Raises ValueError otherwise."""
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", arch.strip())
    if not m:
        raise ValueError(f"bad arch {arch!r}; expected e.g. sm_80")
    return int(m.group(1))


def compile_ttir(ttir: str | TritonCall, arch: str, *, num_warps: int = 4, num_stages: int = 3,
                 dump_dir: Path | None = None, ttir_generic: str | None = None) -> CompileResult:
    """Compile a Triton-dialect module (TTIR text) for `arch` with pip's triton, driverless.

    Runs triton's NVIDIA pipeline exactly as `triton.compile` would for a Python kernel
    (its TTIR clean-up passes included, which `triton.compile` skips for a .ttir file),
    then its bundled ptxas with triton's own flags plus `-v`. A TritonCall may be passed
    instead of text (its warps/stages/generic form are then used). If the custom-form
    text does not parse, the generic form is tried. dump_dir, if given, receives
    input.ttir (the text parsed), kernel.{ttir,ttgir,llir,ptx,cubin} and ptxas.log.
    Returns a CompileResult. Raises TritonUnavailable without triton, RuntimeError with
    the stage name for a failing Triton pass, parse or ptxas run.
    """
    if isinstance(ttir, TritonCall):
        num_warps, num_stages, ttir_generic, ttir = ttir.num_warps, ttir.num_stages, ttir.ttir_generic, ttir.ttir
    _, t = _import_triton()
    tir, nv = t["ir"], t["nv"]
    cap = parse_arch(arch)
    backend = t["make_backend"](t["GPUTarget"]("cuda", cap, 32))
    # FP fusion (FMA contraction) on: triton 3.9's default, passed explicitly because 3.9
    # warns when it is left unset.
    opts = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True))
    stages: dict[str, Callable] = {}
    backend.add_stages(stages, opts, t["Language"].TRITON)
    metadata: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="compile_triton_") as tmp:
        ctx = tir.context()
        tir.load_dialects(ctx)
        backend.load_dialects(ctx)
        module, form, errors = None, None, []
        for form, text in (("custom", ttir), ("generic", ttir_generic)):
            if text is None:
                continue
            path = Path(tmp, f"kernel.{form}.ttir")
            path.write_text(text)
            diag: list[str] = []
            try:
                with _captured_stderr(diag):
                    module = tir.parse_mlir_module(str(path), ctx)
                break
            except Exception as e:
                errors.append(f"{form} form: {_one_line(''.join(diag) or e)}")
        if module is None:
            raise RuntimeError("triton could not parse the TTIR: " + "; ".join(errors))
        module.context = ctx
        outputs: dict[str, Any] = {"input.ttir": path.read_text()}
        mod: Any = module
        for ext in ("ttir", "ttgir", "llir", "ptx"):
            diag = []
            try:
                with _captured_stderr(diag):
                    mod = stages[ext](mod, metadata)
            except Exception as e:
                raise RuntimeError(f"triton {ext} stage failed for {arch}: "
                                   f"{_one_line(''.join(diag) or e)}") from e
            if diag[0].strip():  # warnings of a stage that succeeded: pass them on
                sys.stderr.write(diag[0])
            outputs[f"kernel.{ext}"] = str(mod) if ext in ("ttir", "ttgir") else mod
        ptx = outputs["kernel.ptx"]
        ptxas = nv.get_ptxas(cap).path  # triton's choice: ptxas (<sm_90) / ptxas-blackwell
        ptx_path, cubin_path = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        ptx_path.write_text(ptx)
        gpu_name = nv.sm_arch_from_capability(cap)  # sm_90 -> sm_90a, as triton does
        cmd = [ptxas, "-lineinfo", *([] if opts.enable_fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", *(opts.ptx_options.split() if opts.ptx_options else []),
               f"--gpu-name={gpu_name}", str(ptx_path), "-o", str(cubin_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed for {arch} (rc {proc.returncode}): {_one_line(log)}")
        cubin = cubin_path.read_bytes()
        nvdisasm = Path(ptxas).with_name("nvdisasm")
        sass = ""
        if nvdisasm.exists():
            dis = subprocess.run([str(nvdisasm), "-c", str(cubin_path)], capture_output=True,
                                 text=True)
            sass = dis.stdout if dis.returncode == 0 else ""
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        for fname, content in outputs.items():
            (dump_dir / fname).write_text(content)
        (dump_dir / "kernel.cubin").write_bytes(cubin)
        (dump_dir / "ptxas.log").write_text(" ".join(cmd) + "\n" + log)
        if sass:
            (dump_dir / "kernel.sass").write_text(sass)
    stats = parse_ptxas_log(log, metadata.get("name"))
    return CompileResult(arch=arch, ptx=ptx, cubin=cubin, metadata=metadata, stats=stats,
                         ptxas_log=log, ptxas=ptxas, ttir_form=form or "custom", sass=sass)


@contextlib.contextmanager
def _captured_stderr(sink: list[str]):
    """Route file descriptor 2 to a temp file for the block and append what was written
    to `sink`: triton's C++ (MLIR diagnostics) writes there, not to sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode(errors="replace"))


def _one_line(e: Any, limit: int = 300) -> str:
    """An exception or log as one short line (MLIR diagnostics are multi-line)."""
    s = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)
    lines = [ln.strip() for ln in s.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]
    s = " | ".join((errs or lines)[:3])
    return s if len(s) <= limit else s[:limit - 3] + "..."


# ----------------------------------------------------------------------------- configurations

@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """A kernel entry point with concrete shapes: `label` names the row, `fn(*args,
    **kwargs)` is lowered (args are ShapeDtypeStructs)."""

    label: str
    fn: Callable
    args: tuple
    kwargs: dict


MODELS = {  # q_heads, kv_heads, head_dim
    "smollm2-135m": (9, 3, 64),
    "llama3-8b": (32, 8, 128),
}
PAGE_SIZE = 16
DECODE_CONTEXT = 4096   # pages_per_seq = DECODE_CONTEXT / PAGE_SIZE for decode
PREFILL_TOKENS = 512
MATMUL_K, MATMUL_N, GROUP = 4096, 14336, 128


def _sds(shape, dtype):
    import jax
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def kernel_configs(kernel: str, fn: Callable) -> list[KernelConfig]:
    """The representative configurations of one of our kernels (KERNELS) whose public
    function is `fn`. Raises KeyError for an unknown kernel name."""
    import jax.numpy as jnp

    bf16, i32 = jnp.bfloat16, jnp.int32
    out = []
    # the KV pools: bf16, and the engine's narrow ones (fp8 of scale 1, int8 rows carrying
    # their f32 scale: head_dim + 4 wide)
    pools = (("", bf16, 0), ("/fp8kv", jnp.float8_e4m3fn, 0), ("/int8kv", jnp.int8, 4))
    if kernel == "paged_attention":
        for model, (hq, hkv, d) in MODELS.items():
            for batch in (1, 32):
                for tag, pdt, extra in pools:
                    pps = DECODE_CONTEXT // PAGE_SIZE
                    kv = _sds((batch * pps, PAGE_SIZE, hkv, d + extra), pdt)
                    args = (_sds((batch, hq, d), bf16), kv, kv, _sds((batch, pps), i32),
                            _sds((batch,), i32))
                    out.append(KernelConfig(f"paged_attention/{model}/decode-b{batch}{tag}", fn,
                                            args, dict(impl="pallas")))
    elif kernel == "flash_attention":
        for model, (hq, hkv, d) in MODELS.items():
            for tag, pdt, extra in pools:
                batch, pps = 1, PREFILL_TOKENS // PAGE_SIZE
                kv = _sds((batch * pps, PAGE_SIZE, hkv, d + extra), pdt)
                args = (_sds((PREFILL_TOKENS, hq, d), bf16), kv, kv, _sds((batch, pps), i32),
                        _sds((batch + 1,), i32), _sds((batch,), i32))
                out.append(KernelConfig(f"flash_attention/{model}/prefill-{PREFILL_TOKENS}{tag}",
                                        fn, args, dict(impl="pallas")))
    elif kernel == "quantized_matmul":
        formats = (("int8-channel", jnp.int8, (MATMUL_N,)),
                   (f"int8-g{GROUP}", jnp.int8, (MATMUL_K // GROUP, MATMUL_N)),
                   ("fp8-channel", jnp.float8_e4m3fn, (MATMUL_N,)))
        for fmt, wdtype, sshape in formats:
            for m in (1, 256):
                args = (_sds((m, MATMUL_K), bf16), _sds((MATMUL_K, MATMUL_N), wdtype),
                        _sds(sshape, jnp.float32))
                out.append(KernelConfig(f"quantized_matmul/{MATMUL_K}x{MATMUL_N}/{fmt}/M{m}", fn, args,
                                        dict(impl="pallas")))
            # the CUDA-core GEMV variants (quantized_matmul's `gemv`), at 1 row and at their
            # most rows (their accumulators' registers grow with the rows)
            for m, modes in ((1, ("reduce", "reduce_magic")), (4, ("reduce_magic",))):
                args = (_sds((m, MATMUL_K), bf16), _sds((MATMUL_K, MATMUL_N), wdtype),
                        _sds(sshape, jnp.float32))
                for mode in modes:
                    out.append(KernelConfig(
                        f"quantized_matmul/{MATMUL_K}x{MATMUL_N}/{fmt}/M{m}/{mode}", fn, args,
                        dict(impl="pallas", gemv=mode)))
    elif kernel == "ggml_matmul":  # Llama-3-8B's w_down shape in each block format
        for fmt in ("q4_0", "q4_1", "q8_0"):
            q8 = fmt == "q8_0"
            blocks = MATMUL_K // 32
            qs = _sds((MATMUL_N, blocks, 32 if q8 else 16), jnp.int8 if q8 else jnp.uint8)
            d = _sds((MATMUL_N, blocks), jnp.float16)
            for m in (1, 256):
                args = (_sds((m, MATMUL_K), bf16), qs, d, d if fmt == "q4_1" else None)
                out.append(KernelConfig(f"ggml_matmul/{MATMUL_K}x{MATMUL_N}/{fmt}/M{m}", fn, args,
                                        dict(fmt=fmt, impl="pallas")))
            for m in (1, 4):  # the CUDA-core GEMV (ggml_matmul's `gemv`)
                args = (_sds((m, MATMUL_K), bf16), qs, d, d if fmt == "q4_1" else None)
                out.append(KernelConfig(f"ggml_matmul/{MATMUL_K}x{MATMUL_N}/{fmt}/M{m}/reduce",
                                        fn, args, dict(fmt=fmt, impl="pallas", gemv="reduce")))
    else:
        raise KeyError(f"unknown kernel {kernel!r}; known: {KERNELS}")
    return out


def demo_configs() -> list[KernelConfig]:
    """Configurations of JAX's shipped Pallas Triton kernels (`jax.experimental.pallas.ops.
    gpu`): paged attention decode and flash attention (mha) prefill at Llama-3-8B shapes."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention, paged_attention

    hq, hkv, d = MODELS["llama3-8b"]
    bf16, i32 = jnp.bfloat16, jnp.int32
    out = []
    for batch in (1, 32):
        pps = DECODE_CONTEXT // PAGE_SIZE
        pages = _sds((hkv, batch * pps, PAGE_SIZE, d), bf16)  # JAX's layout: kv heads first
        args = (_sds((batch, hq, d), bf16), pages, pages, _sds((batch, pps), i32), _sds((batch,), i32))
        out.append(KernelConfig(f"jax.paged_attention/llama3-8b/decode-b{batch}",
                                paged_attention.paged_attention, args, {}))
    q = _sds((1, PREFILL_TOKENS, hq, d), bf16)
    out.append(KernelConfig(f"jax.mha/llama3-8b/prefill-{PREFILL_TOKENS}", attention.mha,
                            (q, q, q, None), dict(causal=True)))
    return out


def our_configs(kernels: Sequence[str], log: Callable[[str], None] = print
                ) -> tuple[list[KernelConfig], list[dict]]:
    """KernelConfigs of those `kernels` whose module jaxserve/kernels/pallas/<name>.py exists (a
    missing one is reported through `log` and skipped), and error rows (see
    compile_config) for modules that fail to import or lack their public function.
    Never raises for a broken kernel module."""
    configs, problems = [], []
    for k in kernels:
        if not (REPO / "jaxserve" / "kernels" / "pallas" / f"{k}.py").exists():
            log(f"skipped {k}: jaxserve/kernels/pallas/{k}.py does not exist (yet)")
            continue
        try:
            module = importlib.import_module(f"jaxserve.kernels.pallas.{k}")
            configs.extend(kernel_configs(k, getattr(module, k)))
        except Exception as e:
            problems.append(dict(config=f"{k}/*", kernel="-", arch="-",
                                 error=f"import jaxserve.kernels.pallas.{k}: {_one_line(e)}"))
    return configs, problems


# ----------------------------------------------------------------------------- rows

# Triton's message for a feature the target lacks (fp8 e4m3 conversion needs sm_89+).
_RE_NEEDS_CC = re.compile(r"supported on compute capability >= ?(\d+)")

COLUMNS = (  # (row key, header)
    ("config", "config"), ("kernel", "kernel"), ("arch", "arch"), ("grid", "grid"),
    ("num_warps", "warps"), ("num_stages", "stages"), ("registers", "regs"),
    ("spills", "spill st/ld"), ("smem", "smem"), ("stack_frame", "stack"), ("cubin_bytes", "cubin"),
    ("loop_insns", "loop"),
)


def compile_config(cfg: KernelConfig, archs: Sequence[str], dump_dir: Path | None = None) -> list[dict]:
    """Lower one configuration, extract its Triton kernels and compile each for each arch.
    Returns one row dict per (kernel, arch) (keys: COLUMNS' plus spill_stores,
    spill_loads, smem_triton, smem_static, cmem, ttir_form, ptxas, seconds, error,
    unsupported; with nvdisasm, loop_insns and loop_ops: `sass_loop`); a failure becomes a row with `error` set (kernel "-" if lowering failed),
    or `unsupported` when Triton says the arch lacks a feature the kernel uses (not a
    failure: XLA would refuse it on such a device too). Raises TritonUnavailable only."""
    base = dict(config=cfg.label)
    try:
        calls = extract_triton_calls(lower_for_cuda(cfg.fn, cfg.args, cfg.kwargs))
        if not calls:
            raise ValueError("no Triton custom call in the lowered module (not a Pallas Triton kernel?)")
    except TritonUnavailable:
        raise
    except Exception as e:
        return [dict(base, kernel="-", arch=a, error=f"lowering: {_one_line(e)}") for a in archs]
    rows = []
    for i, call in enumerate(calls):
        kname = call.name if len(calls) == 1 else f"{call.name}#{i}"
        for arch in archs:
            row: dict[str, Any] = dict(base, kernel=kname, arch=arch, grid="x".join(map(str, call.grid)),
                                       num_warps=call.num_warps, num_stages=call.num_stages)
            t0 = time.perf_counter()
            sub = None
            if dump_dir is not None:
                sub = dump_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{cfg.label}.{kname}.{arch}")
            try:
                res = compile_ttir(call, arch, dump_dir=sub)
            except TritonUnavailable:
                raise
            except Exception as e:
                msg = _one_line(e)
                if m := _RE_NEEDS_CC.search(msg):  # e.g. fp8 e4m3 casts on sm_80
                    why = next(p for p in msg.split(" | ") if m.group(0) in p)
                    why = why.split("ERROR: ")[-1].split("error: ")[-1]
                    row["unsupported"] = f"needs sm_{m.group(1)}+: {why}"
                else:
                    row["error"] = msg
                rows.append(row)
                continue
            s, shared = res.stats, res.metadata.get("shared") or 0
            row.update(registers=s.registers, spill_stores=s.spill_stores, spill_loads=s.spill_loads,
                       spills=f"{s.spill_stores}/{s.spill_loads}", smem=shared + s.smem,
                       smem_triton=shared, smem_static=s.smem, stack_frame=s.stack_frame,
                       cmem=s.cmem, cubin_bytes=len(res.cubin), ttir_form=res.ttir_form,
                       ptxas=Path(res.ptxas).name, seconds=round(time.perf_counter() - t0, 2))
            if res.sass:
                row["loop_insns"], row["loop_ops"] = sass_loop(res.sass)
            rows.append(row)
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """The rows as an aligned text table (COLUMNS), errors as indented lines under
    their row."""
    headers = [h for _, h in COLUMNS]
    body = [[("-" if r.get(k) is None else str(r[k])) for k, _ in COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]
    numeric = {h for k, h in COLUMNS if k not in ("config", "kernel", "arch", "grid")}
    fmt = lambda cells: "  ".join(c.rjust(w) if h in numeric else c.ljust(w)  # noqa: E731
                                  for c, w, h in zip(cells, widths, headers)).rstrip()
    lines = [fmt(headers), fmt(["-" * w for w in widths])]
    for r, cells in zip(rows, body):
        lines.append(fmt(cells))
        if r.get("error"):
            lines.append(f"    error: {r['error']}")
        elif r.get("unsupported"):
            lines.append(f"    n/a: {r['unsupported']}")
    return "\n".join(lines)


def run(configs: Sequence[KernelConfig], archs: Sequence[str], dump_dir: Path | None = None,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    """compile_config over `configs`; returns all rows. Raises TritonUnavailable."""
    rows = []
    for cfg in configs:
        if progress:
            progress(f"{cfg.label} ...")
        rows.extend(compile_config(cfg, archs, dump_dir))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 some row failed, 2 no triton or
    nothing to compile)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), help="e.g. sm_80 sm_90")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                    help="which of jaxserve/kernels/pallas/ to compile (those that exist)")
    ap.add_argument("--demo", action="store_true",
                    help="compile JAX's shipped Pallas GPU kernels instead of ours")
    ap.add_argument("--configs", metavar="REGEX", help="only configurations whose label matches")
    ap.add_argument("--json", metavar="OUT", help="also write the rows (and tool versions) as JSON")
    ap.add_argument("--dump", metavar="DIR", help="write each kernel's ttir/ttgir/llir/ptx/cubin/ptxas log")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    try:
        archs = [f"sm_{parse_arch(a)}" for a in args.arch]
    except ValueError as e:
        ap.error(str(e))
    reason = triton_available()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    note = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    configs, problems = (demo_configs(), []) if args.demo else our_configs(args.kernels, note)
    if args.configs:
        configs = [c for c in configs if re.search(args.configs, c.label)]
    if not configs and not problems:
        print("compile_triton: nothing to compile (no kernel module/configuration matched); "
              "try --demo", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        rows = problems + run(configs, archs, Path(args.dump) if args.dump else None, note)
    except TritonUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    print(format_table(rows))
    failed = sum(1 for r in rows if r.get("error"))
    na = sum(1 for r in rows if r.get("unsupported"))
    note(f"{len(rows)} rows ({failed} failed, {na} not supported on their arch) in {time.perf_counter() - t0:.1f}s")
    if args.json:
        import triton
        meta = dict(triton_version=triton.__version__, archs=archs,
                    ptxas={a: _ptxas_version(parse_arch(a)) for a in archs},
                    note="smem = smem_triton (dynamic) + smem_static (ptxas); spills/stack in bytes")
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 1 if failed else 0


def _ptxas_version(cap: int) -> str:
    """'name release' of the ptxas triton uses for compute capability `cap`."""
    _, t = _import_triton()
    tool = t["nv"].get_ptxas(cap)
    return f"{Path(tool.path).name} {tool.version}"


if __name__ == "__main__":
    sys.exit(main())
