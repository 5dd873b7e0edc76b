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
def test_f32_kernels_never_multiply_in_tf32(kernel):
    dots = [DOT.search(line) for call in ct.extract_triton_calls(_lowered(kernel, jnp.float32))
            for line in call.ttir.splitlines() if "tt.dot " in line]
    assert dots and all(dots), dots
    f32 = [m.group(1) or "ieee" for m in dots if m.group(2) == "f32"]
    assert f32, "no f32 dot found: the pattern no longer matches the IR"
    assert set(f32) <= {"ieee", "tf32x3"}, f32


def test_the_check_can_fail():
    """bf16 inputs lower their dots with Triton's tf32 attribute, which the pattern sees."""
    lines = [line for call in ct.extract_triton_calls(_lowered("paged_attention", jnp.bfloat16))
             for line in call.ttir.splitlines() if "tt.dot " in line]
    assert {DOT.search(line).group(1) for line in lines} == {"tf32"}
