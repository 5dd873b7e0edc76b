"""Each row times its own LoRA slot's matrix on the CPU (Punica's BGMV): the C++ kernel of
lora_matmul.cc behind an FFI call, and its plain-jnp reference.

The LoRA shrink (x [T, in] times each row's A [in, R]) and expand (x A [T, R] times each
row's B [R, out]) of many adapters in one step (jaxserve.lora.batched) are both
y[t] = v[t] @ M[slot[t]] over a pool of slots M [S, K, N]. XLA's jnp form computes every
slot for every row (S times the FLOPs) and copies a layer loop's pools out of the stack;
the kernel computes each row's own slot only, reading a stacked pool at the loop's layer
in place (PERFORMANCE.md, "LoRA").

Source: Punica (Chen et al., 2023), BGMV; S-LoRA (Sheng et al., 2023).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import check, check_array, layer_operand

TARGET = "jaxserve_lora_matmul"
DELTA_TARGET = "jaxserve_lora_delta"
MAX_RANK = 512  # lora_delta's [rows, R] intermediate lives on the stack


@jax.jit
def lora_matmul(v: jax.Array, m: jax.Array, slot: jax.Array,
                layer: jax.Array | None = None) -> jax.Array:
    """v [T, K] f32, each row times its slot's matrix of the pool m [S, K, N] f32 or bf16
    -> [T, N] f32: row t = v[t] @ m[slot[t]] summed in f32 (k in order); 0 for slot 0 (no
    adapter) and for a slot outside [0, S). slot: [T] int32. layer: with a stack of pools
    m [L, S, K, N] (a layer loop's), the int32 index of the one to use (read in place).
    Needs `jaxserve.kernels.cpu.build.load_library` called first. Raises ValueError for
    bad shapes or dtypes, naming the argument."""
    fn = "cpu lora_matmul"
    check_array(fn, "v", v, (None, None), (jnp.float32,))
    stack = () if layer is None else (None,)
    check_array(fn, "m", m, stack + (None, v.shape[1], None), (jnp.float32, jnp.bfloat16))
    check_array(fn, "slot", slot, (v.shape[0],), (jnp.int32,))
    check(fn, m.shape[-3] >= 1, "m must hold at least one slot")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((v.shape[0], m.shape[-1]), jnp.float32))
    return call(v, m, slot, layer_operand(fn, layer))


@jax.jit
def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slot: jax.Array,
               layer: jax.Array | None = None) -> jax.Array:
    """Each row's LoRA delta in one call: x [T, in] f32, pools a [S, in, R] and b [S, R, out]
    (both f32 or both bf16) -> [T, out] f32, row t = (x[t] @ a[s]) @ b[s] with s = slot[t]
    (the shrink rounded to f32 and kept on the stack between the two products); 0 for slot
    0 and slots outside [0, S). layer: with stacks a [L, S, in, R], b [L, S, R, out], the
    int32 layer to use (read in place). R <= MAX_RANK. Needs `jaxserve.kernels.cpu.build.
    load_library` called first. Raises ValueError for bad shapes or dtypes, naming the
    argument."""
    fn = "cpu lora_delta"
    check_array(fn, "x", x, (None, None), (jnp.float32,))
    stack = () if layer is None else (None,)
    check_array(fn, "a", a, stack + (None, x.shape[1], None), (jnp.float32, jnp.bfloat16))
    check_array(fn, "b", b, a.shape[:-2] + (a.shape[-1], None), (a.dtype,))
    check_array(fn, "slot", slot, (x.shape[0],), (jnp.int32,))
    check(fn, a.shape[-1] <= MAX_RANK, f"the rank must be at most {MAX_RANK}, got {a.shape[-1]}")
    call = jax.ffi.ffi_call(DELTA_TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]), jnp.float32))
    return call(x, a, b, slot, layer_operand(fn, layer))


def lora_matmul_reference(v: jax.Array, m: jax.Array, slot: jax.Array,
                          layer: jax.Array | None = None) -> jax.Array:
    """Plain-jnp `lora_matmul` (same arguments and result): the row's slot gathered, in
    f32 (k summed by XLA's dot, not in order)."""
    if layer is not None:
        m = jax.lax.dynamic_index_in_dim(m, layer, keepdims=False)
    S = m.shape[0]
    ok = (slot > 0) & (slot < S)
    rows = m[jnp.where(ok, slot, 0)].astype(jnp.float32)  # [T, K, N]
    y = jnp.einsum("tk,tkn->tn", v.astype(jnp.float32), rows)
    return jnp.where(ok[:, None], y, 0.0)


__all__ = ["MAX_RANK", "lora_delta", "lora_matmul", "lora_matmul_reference"]
