"""Pooling a step's final hidden states into one vector per sequence (embeddings), for the
engine's step (jaxserve.worker.step) and jaxserve.functional.embed alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import query_sequence
from jaxserve.model.inputs import StepBatch


def pool_hidden(hidden: jax.Array, batch: StepBatch, pooling: str) -> jax.Array:
    """[S, D] f32: each sequence's pooled final hidden states of this step (hidden [T, D],
    after the final norm): "last", its last row's (batch.logits_indices); "mean", the
    sum of its rows (the caller divides by its length; the engine adds a prompt's chunks
    up first). Padding rows and sequences add nothing. Source: vLLM's LAST / MEAN poolers."""
    if pooling == "last":
        return hidden[batch.logits_indices].astype(jnp.float32)
    S, T = batch.seq_lens.shape[0], hidden.shape[0]
    owner = query_sequence(batch.query_start, T)     # S (dropped) past the last sequence
    return jax.ops.segment_sum(hidden.astype(jnp.float32), owner, num_segments=S)
