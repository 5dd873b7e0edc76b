"""Ragged paged attention: the step's new tokens are packed one sequence after another (a
flat ragged batch of T rows over S sequences), and each sequence's tokens attend to its
whole context through its block table.

One interface serves prefill of several prompts, decode (one row per sequence; a static
`decode` flag lets implementations use their decode specialisation), and later chunked
prefill, prefix-cache hits and speculative verification. The engine picks one `Attention`
when it is built (KernelConfig.attention_impl -> XlaAttention, CpuAttention or
PallasAttention); the model builds its `AttentionMetadata` once per step (outside the
layer loop) and each layer calls it with its own pool. XlaAttention runs an online softmax over chunks of
each row's context pages, in blocks of query rows, so its temporaries are bounded by a
block, whatever the step's tokens and table width; the kernels drop in behind the same
call.

Source: PagedAttention (Kwon et al., SOSP 2023); vLLM v1's unified ragged batch;
FlashAttention (Dao et al., 2022) for the online softmax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.kernels.impl_table import lookup, pallas_impl
from jaxserve.pytree import pytree_dataclass
from jaxserve.kernels.common import (MASK_VALUE, cdiv, finish_softmax, kv_rows_f32, kv_values,
                                     query_sequence, softmax_block)

# XlaAttention's blocking: each step of its loop gathers one chunk of about XLA_KV_CHUNK
# context keys (whole pages) for each of a block of query rows, the block as many rows as
# keep that gather (of K, and again of V) within XLA_BLOCK_BYTES. A step's attention
# temporaries are then ~2 x XLA_BLOCK_BYTES plus the block's f32 scores, whatever its
# tokens and table width (`xla_attention_temp_bytes`).
XLA_KV_CHUNK = 256
XLA_BLOCK_BYTES = 32 * 2**20


@pytree_dataclass(meta=("decode",))
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    block_tables: [S, P] int32 page ids of each sequence, in order (padding -> null page).
    seq_lens: [S] int32 context length after this step's tokens are written (0 = padding).
    query_start: [S + 1] int32: sequence b owns token rows query_start[b] : query_start[b+1].
    positions: [T] int32 absolute position of each new token.
    row_seq, row_limit: for the "xla" implementation (None for the kernels, which mask
        inside): [T] int32 the sequence of each row (clipped into 0..S-1) and [T] int32
        how many of its context keys the row sees, min(seq_len, position + 1) (0 for rows
        outside every sequence): keys 0 .. row_limit - 1 are visible (causal + length).
    decode (static): T == S and row b is sequence b's only new token.
    """

    block_tables: Any
    seq_lens: Any
    query_start: Any
    positions: Any
    row_seq: Any = None
    row_limit: Any = None
    decode: bool = False


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
                 meta: AttentionMetadata, layout: str = "token_major",
                 layer: Any = None) -> jax.Array:
        """Attention of a flat ragged batch of new queries over one layer's paged K/V.

        q: [T, H, Dh]; k_pages, v_pages: the pool (this step's K/V already written) in
        `layout`: "token_major" [num_pages, page_size, K, Dh] or "head_major"
        [K, num_pages, page_size, Dh] (jaxserve.model.kv_cache), f32, bf16, or uint16 holding
        bf16 bits; returns [T, H, Dh] in q.dtype (rows outside every sequence: 0, or for
        XLA a harmless finite value). Scale 1/sqrt(Dh), softmax in f32. GQA: the H query
        heads are grouped as [K, H // K]; K/V are never repeated in memory. layer: None,
        or the int32 index of the layer to read of stacked pools [L, ...] (the layer
        loop: the C++ kernel reads it in place, the others a slice). Raises ValueError
        for a layout this implementation cannot read."""
        if layout not in self.layouts:
            raise ValueError(f"attention impl {self.name!r} reads only the "
                             f"{' or '.join(self.layouts)} KV layout, got {layout!r}")
        return self._attend(q, k_pages, v_pages, meta, layout, layer)

    def _attend(self, q, k_pages, v_pages, meta, layout, layer=None):
        raise NotImplementedError


def _layer_of(pool: jax.Array, layer: Any) -> jax.Array:
    """One layer's pool of a stacked one (a slice), or the pool itself (layer None)."""
    return pool if layer is None else jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)


@dataclasses.dataclass(frozen=True)
class XlaAttention(Attention):
    """Plain XLA ops over either layout: the reference every kernel is checked against.
    An online softmax over chunks of each row's own context pages (gathered through its
    sequence's block table), in blocks of query rows (`_chunked_attention_xla`): the
    temporaries are bounded by XLA_BLOCK_BYTES, never scores over the whole table for
    every row; the loop over chunks stops at the block's longest visible context."""

    name = "xla"
    kv_layout = "head_major"
    layouts = ("token_major", "head_major")
    pads_pages = False  # its chunk loop stops at each block's longest context

    def metadata(self, block_tables, seq_lens, query_start, positions, page_size,
                 decode=False):
        meta = super().metadata(block_tables, seq_lens, query_start, positions, page_size,
                                decode)
        S = block_tables.shape[0]
        seq = query_sequence(query_start, positions.shape[0])
        inside = (seq >= 0) & (seq < S)
        seq = jnp.clip(seq, 0, S - 1)
        limit = jnp.where(inside, jnp.minimum(seq_lens[seq], positions + 1), 0)
        return dataclasses.replace(meta, row_seq=seq, row_limit=limit.astype(jnp.int32))

    def _attend(self, q, k_pages, v_pages, meta, layout, layer=None):
        return _chunked_attention_xla(q, _layer_of(k_pages, layer), _layer_of(v_pages, layer),
                                      meta, layout)


@dataclasses.dataclass(frozen=True)
class CpuAttention(Attention):
    """The C++ kernel of jaxserve.kernels.cpu.paged_attention (XLA FFI): reads only each sequence's
    own pages, in place, up to its own length; a bf16 pool's bits directly. Its library
    must be loaded (jaxserve.worker.kernel_selection.select_kernels)."""

    name = "cpu"
    kv_layout = "head_major"
    layouts = ("head_major",)
    pads_pages = False  # reads each sequence's pages up to its seq_len only

    def _attend(self, q, k_pages, v_pages, meta, layout, layer=None):
        from jaxserve.kernels.cpu.paged_attention import paged_attention as cpu_paged_attention
        out = cpu_paged_attention(q.astype(jnp.float32), k_pages, v_pages, meta.block_tables,
                                  meta.seq_lens, meta.query_start, meta.positions, layer=layer)
        return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class PallasAttention(Attention):
    """The Pallas kernels (jaxserve/kernels/pallas/): decode steps call the paged decode kernel,
    other steps the ragged flash-prefill kernel over the pool (pages of the model's dtype,
    fp8 pages of scale 1, int8 rows with their scales). interpret: run them in
    Pallas interpret mode (on CPU, for tests). mosaic: the Mosaic GPU (Hopper) decode and
    prefill kernels wherever they take the dtypes and shapes
    (attention_mosaic.mosaic_attention_supports: bf16 / f16, head_dim 64 / 128, GQA
    groups <= 64), the Triton ones otherwise."""

    interpret: bool = False
    mosaic: bool = False
    kv_layout = "token_major"
    layouts = ("token_major",)
    pads_pages = False  # their loops over a sequence's pages stop at its seq_len

    @property
    def name(self) -> str:
        return pallas_impl(self.mosaic, self.interpret)

    def _attend(self, q, k_pages, v_pages, meta, layout, layer=None):
        # bf16 / fp8 bits as their values (fp8: scale 1); int8 rows carry their scales
        k_pages = kv_values(_layer_of(k_pages, layer))
        v_pages = kv_values(_layer_of(v_pages, layer))
        if self.mosaic:
            from jaxserve.kernels.pallas.attention_mosaic import mosaic_attention_supports
            _, page_size, kv_heads, _ = k_pages.shape
            head_dim = q.shape[-1]
            if mosaic_attention_supports(q.dtype, k_pages.dtype, head_dim, page_size,
                                         q.shape[1] // kv_heads):
                return _attention_mosaic(q, k_pages, v_pages, meta, self.name)
        return _paged_attention_pallas(q, k_pages, v_pages, meta,
                                       pallas_impl(False, self.interpret))


_ATTENTIONS = {"xla": XlaAttention(), "cpu": CpuAttention(), "pallas": PallasAttention(),
               "pallas_interpret": PallasAttention(interpret=True),
               "pallas_mosaic": PallasAttention(mosaic=True),
               "pallas_mosaic_interpret": PallasAttention(interpret=True, mosaic=True)}


def attention_backend(impl: "str | Attention") -> Attention:
    """The Attention an implementation name stands for ("xla", "cpu", "pallas",
    "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret"); an Attention is
    returned as it is. Raises ValueError for an unknown name."""
    return lookup(_ATTENTIONS, impl, Attention, "attention impl")


def make_metadata(block_tables: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                  positions: jax.Array, page_size: int, impl: "str | Attention",
                  decode: bool = False) -> AttentionMetadata:
    """`attention_backend(impl).metadata(...)`. Raises ValueError for an unknown impl."""
    return attention_backend(impl).metadata(block_tables, seq_lens, query_start, positions,
                                            page_size, decode)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    meta: AttentionMetadata, impl: "str | Attention" = "xla",
                    layout: str = "token_major", layer: Any = None) -> jax.Array:
    """`attention_backend(impl)(q, k_pages, v_pages, meta, layout, layer)` (see
    Attention.__call__). Raises ValueError for an unknown `impl` or a layout it cannot
    read."""
    return attention_backend(impl)(q, k_pages, v_pages, meta, layout, layer)


def _paged_attention_pallas(q, k_pages, v_pages, meta: AttentionMetadata, impl: str) -> jax.Array:
    from jaxserve.kernels.pallas.flash_attention import flash_attention
    from jaxserve.kernels.pallas.paged_attention import paged_attention as paged_decode

    if meta.decode:
        return paged_decode(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, impl=impl)
    return flash_attention(q, k_pages, v_pages, meta.block_tables, meta.query_start,
                           meta.seq_lens, impl=impl)


def _attention_mosaic(q, k_pages, v_pages, meta: AttentionMetadata, impl: str) -> jax.Array:
    from jaxserve.kernels.pallas.flash_attention_mosaic import flash_attention_mosaic
    from jaxserve.kernels.pallas.paged_attention_mosaic import paged_attention_mosaic

    if meta.decode:
        return paged_attention_mosaic(q, k_pages, v_pages, meta.block_tables, meta.seq_lens,
                                      impl=impl)
    return flash_attention_mosaic(q, k_pages, v_pages, meta.block_tables, meta.query_start,
                                  meta.seq_lens, impl=impl)


def xla_attention_temp_bytes(num_heads: int, num_kv_heads: int, head_dim: int,
                             page_size: int) -> int:
    """Bytes of XlaAttention's largest temporaries, per layer call, whatever the step's
    tokens: one block's gathered f32 K and V chunks, its f32 scores and probabilities, and
    the f32 running output (num_heads, num_kv_heads: this device's)."""
    rows, pages = _xla_blocking(1 << 30, 1 << 30, page_size, num_kv_heads * head_dim * 4)
    keys = pages * page_size
    return (2 * rows * keys * num_kv_heads * head_dim * 4
            + 2 * rows * num_heads * keys * 4 + 2 * rows * num_heads * head_dim * 4)


def _xla_blocking(num_rows: int, table_pages: int, page_size: int, key_bytes: int
                  ) -> tuple[int, int]:
    """(query rows per block, pages per chunk) for XlaAttention: chunks of about
    XLA_KV_CHUNK keys (whole pages, at most the table), blocks of as many rows (at most
    num_rows) as keep one chunk's gathered K within XLA_BLOCK_BYTES (key_bytes: one key's
    f32 K bytes over the kv heads)."""
    pages = max(1, min(table_pages, XLA_KV_CHUNK // page_size))
    rows = max(1, min(num_rows, XLA_BLOCK_BYTES // (pages * page_size * key_bytes)))
    return rows, pages


def _chunked_attention_xla(q, k_pages, v_pages, meta: AttentionMetadata, layout: str
                           ) -> jax.Array:
    """Attention of the ragged batch q [T, H, Dh] over the pool (either layout, as stored:
    jaxserve.kernels.common.kv_values) by an online softmax: the rows in blocks of R, each
    block looping over chunks of C pages of its rows' own block tables, up to the block's
    longest visible context (row_limit). Per
    step of the loop: K, V gathered [R, C * ps, K, Dh], f32 scores [R, K, G, C * ps]; a
    block whose rows are all one sequence's (a prompt's; not in decode steps) gathers
    each chunk once, [C * ps, K, Dh], and multiplies it with all R rows.
    Scores, softmax and products in f32 (f32 inputs: IEEE products). An int8 pool's rows
    (values and scale) are dequantised as they are gathered (kv_rows_f32)."""
    T, H, Dh = q.shape
    S, P = meta.block_tables.shape
    if layout == "head_major":
        K, _, ps, _ = k_pages.shape
    else:
        _, ps, K, _ = k_pages.shape
    G = H // K
    # Products in f32: f32 inputs at HIGHEST precision (IEEE products on GPUs, whose
    # default is TF32); narrower inputs (bf16, f16) at the default, exact for them (TF32
    # holds their mantissas; an int8 pool's q * s products lose at most TF32's 2^-11
    # relative, below the int8 rounding's 2^-8 of the row's largest value). (XLA:CPU's
    # DotThunk has no bf16 x bf16 -> f32 for every shape.)
    f32 = jnp.float32
    narrow = max(jnp.dtype(q.dtype).itemsize, jnp.dtype(kv_values(k_pages).dtype).itemsize) < 4
    W = k_pages.shape[-1]  # a pool row: Dh values (int8: and their scale's bytes)
    precision = None if narrow else jax.lax.Precision.HIGHEST
    R, C = _xla_blocking(T, P, ps, K * Dh * 4)
    n_blocks = cdiv(T, R)
    R = cdiv(T, n_blocks)  # the same number of blocks, the least padding
    n_chunks = cdiv(P, C)
    tables = jnp.pad(meta.block_tables, ((0, 0), (0, n_chunks * C - P)))  # -> null page 0
    pad = n_blocks * R - T
    qg = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(n_blocks, R, K, G, Dh)
    seq = jnp.pad(meta.row_seq, (0, pad)).reshape(n_blocks, R)
    limit = jnp.pad(meta.row_limit, (0, pad)).reshape(n_blocks, R)
    keys = C * ps

    def gather(pages, pool):  # pages [..., C] -> [..., C * ps, K, Dh] f32
        # A bf16 pool stays its uint16 bits until gathered: XLA:CPU would convert a bf16
        # array entering the loop to f32, the whole pool, every layer. An int8 pool's rows
        # are dequantised once gathered.
        lead = pages.shape[:-1]
        if layout == "head_major":
            x = jnp.moveaxis(pool[:, pages].reshape(K, *lead, keys, W), 0, -2)
        else:
            x = pool[pages].reshape(*lead, keys, K, W)
        return kv_rows_f32(x)

    def block(qb, seq_b, limit_b, shared: bool):
        """One block of rows [R, K, G, Dh] (their sequences [R], visible keys [R]): with
        `shared`, all of one sequence (or padding), whose chunks are gathered once for
        all R rows; else each row gathers its own sequence's."""
        table = tables[seq_b[0]] if shared else tables[seq_b]  # [(R,) n_chunks * C]
        r = "" if shared else "r"

        def chunk(c, carry):
            acc, m, l = carry
            pages = jax.lax.dynamic_slice_in_dim(table, c * C, C, axis=-1)
            key = c * keys + jnp.arange(keys, dtype=jnp.int32)
            visible = key[None, :] < limit_b[:, None]  # [R, C * ps]
            # a slot no row sees may hold anything (another sequence's stale K/V, NaN):
            # its V is zeroed, as p = 0 times NaN would not be
            seen = (key < limit_b.max()) if shared else visible
            k = gather(pages, k_pages)
            v = jnp.where(seen[..., None, None], gather(pages, v_pages), 0)
            s = jnp.einsum(f"rkgd,{r}skd->rkgs", qb.astype(f32), k,
                           precision=precision) * (Dh ** -0.5)
            s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
            p, correction, m, l = softmax_block(m, l, s)
            pv = jnp.einsum(f"rkgs,{r}skd->rkgd", p, v, precision=precision)
            return acc * correction[..., None] + pv, m, l

        init = (jnp.zeros((R, K, G, Dh), f32), jnp.full((R, K, G), MASK_VALUE, f32),
                jnp.zeros((R, K, G), f32))
        if n_chunks == 1:  # no loop: XLA:CPU would hoist its gathers and fuse them with
            # this step's K/V write, which then copies the pool
            return finish_softmax(*chunk(0, init))[0].astype(q.dtype)
        used = jnp.minimum(cdiv(limit_b.max(), keys), n_chunks)
        return finish_softmax(*jax.lax.fori_loop(0, used, chunk, init))[0].astype(q.dtype)

    def any_block(qb, seq_b, limit_b):
        if meta.decode or R == 1:  # every row its own sequence
            return block(qb, seq_b, limit_b, shared=False)
        one_sequence = jnp.all((seq_b == seq_b[0]) | (limit_b == 0))
        return jax.lax.cond(one_sequence, functools.partial(block, shared=True),
                            functools.partial(block, shared=False), qb, seq_b, limit_b)

    if n_blocks == 1:
        out = any_block(qg[0], seq[0], limit[0])[None]
    else:
        # The blocks' outputs overwrite the queries' own buffer: a fresh output buffer
        # (lax.map's) has no inputs, and XLA schedules its allocation early, so every
        # layer's would be live at once.
        out = jax.lax.fori_loop(0, n_blocks, lambda b, out: out.at[b].set(
            any_block(qg[b], seq[b], limit[b])), qg)
    return out.reshape(n_blocks * R, H, Dh)[:T]
