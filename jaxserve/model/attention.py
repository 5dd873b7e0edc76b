"""Ragged paged attention: the step's new tokens are packed one sequence after another (a
flat ragged batch of T rows over S sequences), and each sequence's tokens attend to its
whole context through its block table.

One interface serves prefill of several prompts, decode (one row per sequence; a static
`decode` flag lets implementations use their decode specialisation), and later chunked
prefill, prefix-cache hits and speculative verification. The engine picks one `Attention`
when it is built (KernelConfig.attention_impl -> XlaAttention, CpuAttention or
PallasAttention); the model builds its `AttentionMetadata` once per step (outside the
layer loop) and each layer calls it with its own pool. XlaAttention gathers the context
pages and runs dense masked softmax attention; the kernels drop in behind the same call.

Source: PagedAttention (Kwon et al., SOSP 2023); vLLM v1's unified ragged batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.kernels.impl_table import lookup
from jaxserve.pytree import pytree_dataclass
from jaxserve.kernels.common import kv_values, query_sequence

# Finite, so a padding row whose keys are all masked gets a harmless uniform softmax.
MASK_VALUE = -1e30


@pytree_dataclass(meta=("decode",))
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    block_tables: [S, P] int32 page ids of each sequence, in order (padding -> null page).
    seq_lens: [S] int32 context length after this step's tokens are written (0 = padding).
    query_start: [S + 1] int32: sequence b owns token rows query_start[b] : query_start[b+1].
    positions: [T] int32 absolute position of each new token.
    bias: f32 additive mask (0 visible, MASK_VALUE hidden) for the "xla" implementation:
        [S, 1, P * page_size] for decode, [T, S * P * page_size] otherwise; None for
        implementations that mask inside the kernel.
    decode (static): T == S and row b is sequence b's only new token.
    """

    block_tables: Any
    seq_lens: Any
    query_start: Any
    positions: Any
    bias: Any = None
    decode: bool = False


def _xla_bias(block_tables, seq_lens, query_start, positions, page_size: int,
              decode: bool) -> jax.Array:
    """The XLA path's additive causal + length mask (see AttentionMetadata.bias), computed
    once per step: a `jnp.where` inside every layer cost 4-6x on XLA:CPU."""
    S, P = block_tables.shape
    key_pos = jnp.arange(P * page_size, dtype=jnp.int32)
    if decode:
        visible = ((key_pos[None, None, :] <= positions[:, None, None])
                   & (key_pos[None, None, :] < seq_lens[:, None, None]))  # [S, 1, P*ps]
    else:
        row_seq = query_sequence(query_start, positions.shape[0])  # [T]
        visible = ((row_seq[:, None, None] == jnp.arange(S)[None, :, None])
                   & (key_pos[None, None, :] <= positions[:, None, None])
                   & (key_pos[None, None, :] < seq_lens[None, :, None]))  # [T, S, P*ps]
        visible = visible.reshape(positions.shape[0], S * P * page_size)
    return jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)


class Attention:
    """An attention implementation, chosen once when the engine is built
    (jaxserve.worker.kernel_selection.select_kernels) and called by the model; no implementation name is
    compared anywhere else. Subclasses are frozen dataclasses: hashable, equal by value,
    so a backend can be part of a jitted function's static configuration.

    name: the KernelConfig.attention_impl it stands for. kv_layout: the KV pool layout it
    wants allocated (jaxserve.model.kv_cache); layouts: the layouts it can read. pads_pages:
    whether its cost grows with the block-table width P (it reads or masks every page of
    the padded table), so the engine buckets P (jaxserve.worker.compilation.StepShapes).
    """

    name: str
    kv_layout: str
    layouts: tuple[str, ...]
    pads_pages: bool = True

    def metadata(self, block_tables: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                 positions: jax.Array, page_size: int, decode: bool = False
                 ) -> AttentionMetadata:
        """The step's AttentionMetadata (shapes there); kernels that mask inside need no
        bias."""
        return AttentionMetadata(block_tables=block_tables, seq_lens=seq_lens,
                                 query_start=query_start, positions=positions, decode=decode)

    def __call__(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                 meta: AttentionMetadata, layout: str = "token_major") -> jax.Array:
        """Attention of a flat ragged batch of new queries over one layer's paged K/V.

        q: [T, H, Dh]; k_pages, v_pages: the pool (this step's K/V already written) in
        `layout`: "token_major" [num_pages, page_size, K, Dh] or "head_major"
        [K, num_pages, page_size, Dh] (jaxserve.model.kv_cache), f32, bf16, or uint16 holding
        bf16 bits; returns [T, H, Dh] in q.dtype (rows outside every sequence: 0, or for
        XLA a harmless finite value). Scale 1/sqrt(Dh), softmax in f32. GQA: the H query
        heads are grouped as [K, H // K]; K/V are never repeated in memory. Raises
        ValueError for a layout this implementation cannot read."""
        if layout not in self.layouts:
            raise ValueError(f"attention impl {self.name!r} reads only the "
                             f"{' or '.join(self.layouts)} KV layout, got {layout!r}")
        return self._attend(q, k_pages, v_pages, meta, layout)

    def _attend(self, q, k_pages, v_pages, meta, layout):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class XlaAttention(Attention):
    """Plain XLA ops over either layout: the reference every kernel is checked against.
    Each sequence's pages are gathered (decode) or every row scores against all the
    step's sequences under the metadata's additive mask (ragged batches)."""

    name = "xla"
    kv_layout = "head_major"
    layouts = ("token_major", "head_major")

    def metadata(self, block_tables, seq_lens, query_start, positions, page_size,
                 decode=False):
        meta = super().metadata(block_tables, seq_lens, query_start, positions, page_size,
                                decode)
        return dataclasses.replace(meta, bias=_xla_bias(block_tables, seq_lens, query_start,
                                                        positions, page_size, decode))

    def _attend(self, q, k_pages, v_pages, meta, layout):
        k_pages, v_pages = kv_values(k_pages), kv_values(v_pages)
        if meta.decode:
            attend = (_paged_attention_xla_head_major if layout == "head_major"
                      else _paged_attention_xla)
            return attend(q[:, None], k_pages, v_pages, meta)[:, 0]
        return _ragged_attention_xla(q, k_pages, v_pages, meta, layout)


@dataclasses.dataclass(frozen=True)
class CpuAttention(Attention):
    """The C++ kernel of jaxserve.kernels.cpu.paged_attention (XLA FFI): reads only each sequence's
    own pages, in place, up to its own length; a bf16 pool's bits directly. Its library
    must be loaded (jaxserve.worker.kernel_selection.select_kernels)."""

    name = "cpu"
    kv_layout = "head_major"
    layouts = ("head_major",)
    pads_pages = False  # reads each sequence's pages up to its seq_len only

    def _attend(self, q, k_pages, v_pages, meta, layout):
        from jaxserve.kernels.cpu.paged_attention import paged_attention as cpu_paged_attention
        out = cpu_paged_attention(q.astype(jnp.float32), k_pages, v_pages, meta.block_tables,
                                  meta.seq_lens, meta.query_start, meta.positions)
        return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class PallasAttention(Attention):
    """The Pallas kernels (jaxserve/kernels/pallas/): decode steps call the paged decode kernel,
    other steps the ragged flash-prefill kernel over the pool. interpret: run them in
    Pallas interpret mode (on CPU, for tests)."""

    interpret: bool = False
    kv_layout = "token_major"
    layouts = ("token_major",)
    pads_pages = False  # their loops over a sequence's pages stop at its seq_len

    @property
    def name(self) -> str:
        return "pallas_interpret" if self.interpret else "pallas"

    def _attend(self, q, k_pages, v_pages, meta, layout):
        k_pages, v_pages = kv_values(k_pages), kv_values(v_pages)
        return _paged_attention_pallas(q, k_pages, v_pages, meta, self.name)


_ATTENTIONS = {"xla": XlaAttention(), "cpu": CpuAttention(), "pallas": PallasAttention(),
               "pallas_interpret": PallasAttention(interpret=True)}


def attention_backend(impl: "str | Attention") -> Attention:
    """The Attention an implementation name stands for ("xla", "cpu", "pallas",
    "pallas_interpret"); an Attention is returned as it is. Raises ValueError for an
    unknown name."""
    return lookup(_ATTENTIONS, impl, Attention, "attention impl")


def make_metadata(block_tables: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                  positions: jax.Array, page_size: int, impl: "str | Attention",
                  decode: bool = False) -> AttentionMetadata:
    """`attention_backend(impl).metadata(...)`. Raises ValueError for an unknown impl."""
    return attention_backend(impl).metadata(block_tables, seq_lens, query_start, positions,
                                            page_size, decode)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    meta: AttentionMetadata, impl: "str | Attention" = "xla",
                    layout: str = "token_major") -> jax.Array:
    """`attention_backend(impl)(q, k_pages, v_pages, meta, layout)` (see Attention.__call__).
    Raises ValueError for an unknown `impl` or a layout it cannot read."""
    return attention_backend(impl)(q, k_pages, v_pages, meta, layout)


def _paged_attention_pallas(q, k_pages, v_pages, meta: AttentionMetadata, impl: str) -> jax.Array:
    from jaxserve.kernels.pallas.flash_attention import flash_attention
    from jaxserve.kernels.pallas.paged_attention import paged_attention as paged_decode

    if meta.decode:
        return paged_decode(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, impl=impl)
    return flash_attention(q, k_pages, v_pages, meta.block_tables, meta.query_start,
                           meta.seq_lens, impl=impl)


def _widened(q, k, v):
    """Gathered K/V in the wider of q's and the pool's dtypes (f32 queries over a bf16 pool:
    f32), converted after the gather so the pool itself is never converted. (A bf16 x bf16
    -> f32 dot of probabilities and V is unimplemented in XLA:CPU's DotThunk.)"""
    dt = jnp.promote_types(q.dtype, k.dtype)
    return k.astype(dt), v.astype(dt)


def _ragged_attention_xla(q, k_pages, v_pages, meta: AttentionMetadata, layout: str) -> jax.Array:
    # Every row scores against the keys of all S sequences (gathered once, [S * P * ps]);
    # the bias keeps its own sequence's visible keys. S times the work of a per-sequence
    # formulation, but no [T, keys] gather per row; the kernels do the real thing.
    T, H, Dh = q.shape
    S, P = meta.block_tables.shape
    if layout == "head_major":
        K, _, ps, _ = k_pages.shape
        k = k_pages[:, meta.block_tables].reshape(K, S * P * ps, Dh)
        v = v_pages[:, meta.block_tables].reshape(K, S * P * ps, Dh)
    else:
        _, ps, K, _ = k_pages.shape
        k = k_pages[meta.block_tables].reshape(S * P * ps, K, Dh).transpose(1, 0, 2)
        v = v_pages[meta.block_tables].reshape(S * P * ps, K, Dh).transpose(1, 0, 2)
    k, v = _widened(q, k, v)
    qg = q.reshape(T, K, H // K, Dh)
    scores = jnp.einsum("tkgd,ksd->tkgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5) + meta.bias[:, None, None, :]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("tkgs,ksd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(T, H, Dh).astype(q.dtype)


def _paged_attention_xla(q, k_pages, v_pages, meta: AttentionMetadata) -> jax.Array:
    B, Q, H, Dh = q.shape
    _, ps, K, _ = k_pages.shape
    P = meta.block_tables.shape[1]
    k = k_pages[meta.block_tables].reshape(B, P * ps, K, Dh)  # [B, S, K, Dh]
    v = v_pages[meta.block_tables].reshape(B, P * ps, K, Dh)
    k, v = _widened(q, k, v)
    qg = q.reshape(B, Q, K, H // K, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5) + meta.bias[:, None, None, :, :]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, Q, H, Dh).astype(q.dtype)


def _paged_attention_xla_head_major(q, k_pages, v_pages, meta: AttentionMetadata) -> jax.Array:
    # Pages [K, N, ps, Dh] gathered -> [K, B, S, Dh]: both matmuls batch over (kv head,
    # sequence), the leading axes, so XLA moves only the small q / output, never K or V.
    B, Q, H, Dh = q.shape
    K, _, ps, _ = k_pages.shape
    G = H // K
    P = meta.block_tables.shape[1]
    k = k_pages[:, meta.block_tables].reshape(K, B, P * ps, Dh)
    v = v_pages[:, meta.block_tables].reshape(K, B, P * ps, Dh)
    k, v = _widened(q, k, v)
    qg = q.reshape(B, Q, K, G, Dh).transpose(2, 0, 3, 1, 4).reshape(K, B, G * Q, Dh)
    scores = jnp.einsum("kbqd,kbsd->kbqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(K, B, G, Q, P * ps) * (Dh ** -0.5) + meta.bias[None, :, None]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(K, B, G * Q, P * ps)
    out = jnp.einsum("kbqs,kbsd->kbqd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(K, B, G, Q, Dh).transpose(1, 3, 0, 2, 4).reshape(B, Q, H, Dh).astype(q.dtype)
