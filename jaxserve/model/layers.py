"""Llama building blocks as pure functions: RMSNorm, RoPE (with llama3 scaling), SwiGLU.

Shapes use T = the step's token rows (sequences packed), D = hidden size, H / K = query / KV
heads, Dh = head_dim, F = MLP width. All math in the params' dtype, except RMSNorm's
variance and RoPE's angles, which are computed in f32 as in HF transformers.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.lora.batched import add_lora
from jaxserve.model.linear import matmul_backend
from jaxserve.distributed.sharding import ShardingRules, constrain


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight.

    x: [..., D]; weight: [D]. Variance in f32, result cast back to x.dtype before the
    weight multiply (matches HF `LlamaRMSNorm`). Source: Zhang & Sennrich 2019.
    """
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype) * weight


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] f32 for RoPE, with Llama 3.1 scaling if given.

    Source: Su et al. 2021 (RoFormer); llama3 scaling as in Meta's `apply_scaling` /
    HF `_compute_llama3_parameters`.
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, cfg: ModelConfig, fusion_barrier: bool = True
                ) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., Dh // 2] f32 for int32 `positions` [...] (the step's [T] token
    positions); computed once per step.

    XLA:CPU fuses elementwise producers into each consumer, so the cos and sin were
    recomputed per element of every layer's q and k (a large share of a long prefill step:
    PERFORMANCE.md, "Measurements behind the code"); an optimization_barrier is removed before fusion there. A conditional is a
    boundary no fusion crosses: the tables are computed inside one. Its predicate (every
    position >= 0) holds for every batch; the other branch only matches the shapes.
    fusion_barrier False: no conditional (for XLA:GPU, which waits on the host at one:
    jaxserve.sample.plan)."""
    inv = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv
    tables = lambda a: (jnp.cos(a), jnp.sin(a))
    if not fusion_barrier:
        return tables(angles)
    zeros = lambda a: (jnp.zeros_like(a), jnp.zeros_like(a))
    return jax.lax.cond(jnp.all(positions >= 0), tables, zeros, angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` [..., heads, Dh] by position, "rotate_half" layout (HF Llama convention:
    the first and second halves of head_dim are the pair). cos/sin: [..., Dh // 2] f32.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate: Any, w_up: Any, w_down: Any,
               rules: ShardingRules | None, matmul: Any = "xla", lora: dict | None = None,
               row_slot: jax.Array | None = None) -> jax.Array:
    """SwiGLU MLP: (silu(x @ w_gate) * (x @ w_up)) @ w_down.

    x: [T, D]; w_gate, w_up: [D, F]; w_down: [F, D] -> [T, D]; the weights float
    arrays or QuantizedWeights / DualPrecisionWeights (`matmul`, a
    jaxserve.model.linear.Matmul or its name, then picks the kernel); w_gate may be a
    FusedWeight of w_gate | w_up (w_up None: one matmul; laid out for the C++ kernel's
    SwiGLU epilogue, one call that returns the activation: Matmul.swiglu). The F axis is the
    tensor-parallel `mlp` axis. lora / row_slot: the layer's LoRA slots ({projection:
    LoraSlots}) and each row's slot [T] int32 (jaxserve.lora.batched.add_lora): each
    row's adapter delta joins w_gate's, w_up's and w_down's outputs; None: no LoRA.
    Source: Shazeer 2020, "GLU Variants Improve Transformer".
    """
    mm = matmul_backend(matmul)
    lora = lora or {}
    if lora.get("w_gate") is None and lora.get("w_up") is None:
        # the C++ kernel's epilogue where laid out for it; h then already in bf16 if the
        # down matmul rounds its x to bf16
        h = mm.swiglu(x, w_gate, w_up, w_down if lora.get("w_down") is None else None)
    else:
        gate, up = mm.project(x, (w_gate, w_up))
        gate = add_lora(gate, x, lora.get("w_gate"), row_slot, mm.lora_delta)
        up = add_lora(up, x, lora.get("w_up"), row_slot, mm.lora_delta)
        h = jax.nn.silu(gate) * up
    h = constrain(rules, h, ("tokens", "mlp"))
    return add_lora(mm.dense(h, w_down, 1, out_dtype=x.dtype), h, lora.get("w_down"), row_slot,
                    mm.lora_delta)
