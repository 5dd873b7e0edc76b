"""The Pallas kernels' f32 precision on the GPU, checked without one: each kernel lowered for
CUDA with f32 inputs, its Triton IR read back (tools/compile_triton.py), and every `tt.dot`
over f32 operands must be IEEE f32 (Triton's default, no `inputPrecision`) or 3xTF32 —
never plain TF32 (a 10-bit significand), which made all 23 f32 kernel cases fail at 1e-5
on the first native run (an H200, issue 29). bf16 dots are bf16 whatever the attribute."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.kernels.pallas.flash_attention import flash_attention
from jaxserve.kernels.pallas.paged_attention import paged_attention
from jaxserve.kernels.pallas.quantized_matmul import quantized_matmul
from tools import compile_triton as ct

S, i32 = jax.ShapeDtypeStruct, jnp.int32
DOT = re.compile(r"tt\.dot [^\n]*?(?:inputPrecision = (\w+) )?: tensor<[0-9x]+x(\w+)>")


def _lowered(kernel: str, dtype):
    pages = S((9, 16, 2, 64), dtype)
    if kernel == "flash_attention":
        fn, args = flash_attention, (S((16, 8, 64), dtype), pages, pages, S((1, 8), i32),
                                     S((2,), i32), S((1,), i32))
    elif kernel == "paged_attention":
        fn, args = paged_attention, (S((2, 8, 64), dtype), pages, pages, S((2, 4), i32),
                                     S((2,), i32))
    else:
        fn, args = quantized_matmul, (S((16, 256), dtype), S((256, 128), jnp.int8),
                                      S((1, 128), jnp.float32))
    return jax.jit(functools.partial(fn, impl="pallas")).trace(*args).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("kernel", ["flash_attention", "paged_attention", "quantized_matmul"])
def test_f32_kernels_never_multiply_in_tf32(kernel, cuda_lowering):
    dots = [DOT.search(line) for call in ct.extract_triton_calls(_lowered(kernel, jnp.float32))
            for line in call.ttir.splitlines() if "tt.dot " in line]
    assert dots and all(dots), dots
    f32 = [m.group(1) or "ieee" for m in dots if m.group(2) == "f32"]
    assert f32, "no f32 dot found: the pattern no longer matches the IR"
    assert set(f32) <= {"ieee", "tf32x3"}, f32


def test_the_check_can_fail(cuda_lowering):
    """bf16 inputs lower their dots with Triton's tf32 attribute, which the pattern sees."""
    lines = [line for call in ct.extract_triton_calls(_lowered("paged_attention", jnp.bfloat16))
             for line in call.ttir.splitlines() if "tt.dot " in line]
    assert {DOT.search(line).group(1) for line in lines} == {"tf32"}


def test_cuda_target_names_the_gpu_and_restores_the_registry():
    """jaxserve.kernels.pallas.lowering.cuda_target: without it the Triton lowering has no
    GPU to target (JAX 0.11); with a mesh it names the CPU devices' kind an H100's only for
    its duration, and it refuses a GPU kind JAX does not know."""
    from jax._src.pallas.triton import gpu_info

    from jaxserve.kernels.pallas.lowering import cuda_target

    with pytest.raises(RuntimeError, match="No supported GPU devices found"):
        _lowered("paged_attention", jnp.bfloat16)
    mesh = jax.make_mesh((1,), ("model",), devices=jax.devices()[:1])
    kind = jax.devices()[0].device_kind
    with cuda_target(mesh):
        assert gpu_info.get_gpu_info().compute_capability == 90
        assert "xla.gpu.triton" in _lowered("paged_attention", jnp.bfloat16).as_text()
    assert kind not in gpu_info.registry
    with pytest.raises(ValueError, match="no GPU of kind 'NVIDIA Nothing'"):
        with cuda_target(mesh, device_kind="NVIDIA Nothing"):
            pass
