"""Weight-only quantisation of the layers' projection matrices (int8 / fp8 e4m3) and the
one matmul helper the model uses for every projection, float or quantised.

A `QuantizedWeight` keeps the stored values in the weight's own shape ([embed, heads,
head_dim], [mlp, embed], ...) and its scales as the kernel wants them, flattened to the
output features: [out_features] per channel, or [in_features // group, out_features] per
group. `dense` contracts the leading `n_in` axes of the weight with the trailing ones of
the activations; with a QuantizedWeight it calls `pallas_kernels.quantized_matmul`
("pallas" / "pallas_interpret") or its plain-jnp reference ("xla": dequantise, then an f32
matmul). Embeddings, norms, biases and the LM head are never quantised.

Source: weight-only per-channel int8 (LLM.int8 / vLLM's W8A16), per-group int8 as in
GPTQ/AWQ's group scales, FP8 e4m3 per-channel as in vLLM's fp8 W8A16 path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import KERNEL_IMPLS
from jaxserve.model.params import LayerParams, Params
from jaxserve.pytree import pytree_dataclass

# The LayerParams fields that are projections, with how many leading axes are inputs.
PROJECTIONS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


@pytree_dataclass(meta=("fmt", "n_in"))
class QuantizedWeight:
    """w_q: the stored weight, its float shape [*in, *out], int8 or float8_e4m3fn;
    scales: f32 [prod(out)] or [prod(in) // group, prod(out)]; fmt: "int8" / "fp8_e4m3";
    n_in: how many leading axes of w_q are contracted."""

    w_q: Any
    scales: Any
    fmt: str = "int8"
    n_in: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w_q.shape)


def quantize_weight(w: jax.Array, n_in: int, fmt: str, group_size: int | None = None) -> QuantizedWeight:
    """Quantise one float weight [*in, *out] (first `n_in` axes contracted).

    fmt: "int8" or "fp8_e4m3"; group_size: None (per output channel) or, for int8, a power
    of two dividing prod(in). Raises ValueError (from `quantize_weights`) otherwise.
    """
    from pallas_kernels.quantized_matmul import quantize_weights

    k = math.prod(w.shape[:n_in])
    w_q, scales = quantize_weights(w.reshape(k, -1), fmt, group_size)
    return QuantizedWeight(w_q=w_q.reshape(w.shape), scales=scales, fmt=fmt, n_in=n_in)


def quantize_params(params: Params, fmt: str, group_size: int | None = None) -> Params:
    """`params` with every layer projection (PROJECTIONS) replaced by a QuantizedWeight;
    everything else unchanged. Runs one small jitted quantisation per weight, so peak
    memory stays near the float weights plus one quantised copy."""
    quantize = jax.jit(quantize_weight, static_argnums=(1, 2, 3))

    def layer(lp: LayerParams) -> LayerParams:
        return dataclasses.replace(lp, **{name: quantize(getattr(lp, name), n_in, fmt, group_size)
                                          for name, n_in in PROJECTIONS.items()})

    return dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers))


def dense(x: jax.Array, w: Any, n_in: int, impl: str = "xla") -> jax.Array:
    """x [..., *in] contracted with w [*in, *out] -> [..., *out].

    w: a float array (a plain dot_general in x.dtype) or a QuantizedWeight (f32
    accumulation, result in x.dtype; `impl` picks the Pallas kernel or its reference).
    Raises ValueError for an unknown impl.
    """
    if not isinstance(w, QuantizedWeight):
        return jnp.tensordot(x, w, axes=n_in)
    from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference

    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    lead = x.shape[:x.ndim - n_in]
    x2 = x.reshape(-1, math.prod(in_shape))
    w2 = w.w_q.reshape(x2.shape[1], -1)
    if impl == "xla":
        y = quantized_matmul_reference(x2, w2, w.scales)
    elif impl in KERNEL_IMPLS:
        y = quantized_matmul(x2, w2, w.scales, impl=impl)
    else:
        raise ValueError(f"matmul impl must be one of {KERNEL_IMPLS}, got {impl!r}")
    return y.reshape(*lead, *out_shape)
