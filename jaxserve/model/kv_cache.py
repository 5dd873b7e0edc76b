"""The KV page pool on device: buffers and the write helper. No allocation policy here
(that is `jaxserve.engine.page_pool`, plain Python on the host).

Two layouts per layer, K and V each:
  "token_major" `[num_pages, page_size, kv_heads, head_dim]` (logical axes `pages`,
      `page_slots`, `kv_heads`, `head_dim`): what the Pallas kernels read, page by page;
  "head_major" `[kv_heads, num_pages, page_size, head_dim]`: what the XLA attention and the
      C++ CPU kernel read (one head's page is one contiguous [page_size, head_dim] block).
      Gathering a batch's pages then gives `[kv_heads, B, S, head_dim]`, already in the
      layout of a batched matmul over (kv head, sequence); from the token-major layout
      XLA:CPU copied and transposed every gathered page (twice the attention time).
A token's "slot" is `page * page_size + offset`. Page 0 is the null page: padding tokens
write there and the host allocator never hands it out.

A bfloat16 pool is stored as its bits, uint16 arrays (`storage_dtype`): XLA:CPU
float-normalises a bf16 dynamic-update-slice into convert(pool -> f32), update, convert
back, so every layer's K/V write copied the whole pool twice (PERFORMANCE.md, "Measurements
behind the code"). On uint16 the write updates the new rows in place.
`write_kv` rounds the new rows to bf16 and stores their bits; `jaxserve.kernels.common.kv_values` gives
readers the bf16 view (a bitcast, no copy); the C++ CPU kernel reads the bits directly.
An fp8 pool (vLLM's `--kv-cache-dtype fp8`: float8_e4m3fn values with a per-tensor scale
of 1, vLLM's default when a checkpoint gives no K/V scales) is stored the same way, as
uint8 bits: `write_kv` clips the new rows to +-448 (e4m3fn's largest finite value) and
rounds them to e4m3fn, a quarter of f32's bytes per element.
An int8 pool (`--kv-cache-dtype int8`) holds each (token, KV head) row as head_dim int8
values and their f32 scale's 4 bytes (jaxserve.kernels.common.INT8_KV): its arrays' last
axis is head_dim + 4 wide; `write_kv` quantises each new row on its own
(`quantize_kv_int8`), so a page's earlier tokens are never rewritten.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.pytree import pytree_dataclass
from jaxserve.distributed.sharding import ShardingRules, layers_per_stage
from jaxserve.kernels.common import (FP8_E4M3_MAX, INT8_KV, KV_BITS_VALUES, kv_row_width,
                                     quantize_kv_int8)

KV_AXES = ("pages", "page_slots", "kv_heads", "head_dim")
KV_LAYOUTS = ("token_major", "head_major")
_HEAD_MAJOR_AXES = ("kv_heads", "pages", "page_slots", "head_dim")


@pytree_dataclass(meta=("layout", "stacked"))
class KVCache:
    """k, v: tuples (one per layer) of pool arrays in `layout` (see module docstring); a
    pipeline's pool holds one stage-stacked array [PP, ...] per stage-local layer; with
    `stacked` (a loop over the layers, jaxserve.model.layer_loop) k and v hold one array
    each, every layer's pool stacked [L, ...], written and read at the loop's layer."""

    k: tuple
    v: tuple
    layout: str = "token_major"
    stacked: bool = False

    @property
    def staged(self) -> bool:
        return not self.stacked and self.k[0].ndim == 5

    @property
    def num_pages(self) -> int:
        lead = self.staged or self.stacked
        return self.k[0].shape[(1 if self.layout == "head_major" else 0) + lead]

    @property
    def page_size(self) -> int:
        lead = self.staged or self.stacked
        return self.k[0].shape[(2 if self.layout == "head_major" else 1) + lead]

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the values the pool holds (bfloat16 for a pool stored as bits; int8
        for an int8 pool, whose rows also hold their scales)."""
        return value_dtype(self.k[0].dtype)


def kv_axes(layout: str, staged: bool = False) -> tuple[str, ...]:
    """The logical axes of a pool array in `layout`; `staged`: of a pipeline's
    stage-stacked array (a leading `stages` axis). Raises ValueError for an unknown
    layout (one of KV_LAYOUTS)."""
    stage = ("stages",) if staged else ()
    if layout == "token_major":
        return stage + KV_AXES
    if layout == "head_major":
        return stage + _HEAD_MAJOR_AXES
    raise ValueError(f"KV cache layout must be one of {KV_LAYOUTS}, got {layout!r}")


_BITS_OF = {values: bits for bits, values in KV_BITS_VALUES.items()}


def storage_dtype(dtype: Any) -> jnp.dtype:
    """The array dtype a pool of `dtype` values is stored in: uint16 (the bits) for
    bfloat16, uint8 for float8_e4m3fn, `dtype` itself otherwise."""
    dtype = jnp.dtype(dtype)
    return _BITS_OF.get(dtype, dtype)


def value_dtype(stored: Any) -> jnp.dtype:
    """Inverse of `storage_dtype`: bfloat16 for uint16 pool arrays, float8_e4m3fn for
    uint8, else the dtype itself."""
    stored = jnp.dtype(stored)
    return KV_BITS_VALUES.get(stored, stored)


def token_bytes(cfg: ModelConfig, dtype: Any) -> int:
    """Bytes one token's K and V take across all layers in a pool of `dtype` values (an
    int8 pool's rows with their scales)."""
    stored = storage_dtype(dtype)
    return 2 * cfg.num_layers * cfg.num_kv_heads * kv_row_width(stored, cfg.head_dim) * stored.itemsize


def page_bytes(cfg: ModelConfig, page_size: int, dtype: Any) -> int:
    """Bytes one page takes across all layers, K and V together."""
    return page_size * token_bytes(cfg, dtype)


def num_pages_for_budget(cfg: ModelConfig, page_size: int, dtype: Any, budget_bytes: int) -> int:
    """How many pages (null page included) fit in `budget_bytes` of device memory."""
    return budget_bytes // page_bytes(cfg, page_size, dtype)


def abstract_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any,
                      rules: ShardingRules | None = None,
                      layout: str = "token_major", stacked: bool = False) -> KVCache:
    """ShapeDtypeStructs of the pool (allocates nothing), in `storage_dtype(dtype)`: one
    array per layer; on a mesh with pipeline stages (a `stage` axis of PP devices), one
    per stage-local layer, Lp = ceil(num_layers / PP) arrays of [PP, ...] split over
    `stage` (jaxserve.model.pipeline); `stacked` (one device: a loop over the layers):
    one array [num_layers, ...] for K and one for V. Raises ValueError for an unknown
    `layout` (one of KV_LAYOUTS), or `stacked` on a mesh."""
    stages = rules.size("stages") if rules is not None else 1
    axes = kv_axes(layout, staged=stages > 1)
    stored = storage_dtype(dtype)
    dims = {"stages": stages, "pages": num_pages, "page_slots": page_size,
            "kv_heads": cfg.num_kv_heads, "head_dim": kv_row_width(stored, cfg.head_dim)}
    shape = tuple(dims[a] for a in axes)
    sharding = rules.sharding(axes, shape) if rules is not None else None
    one = jax.ShapeDtypeStruct(shape, stored, sharding=sharding)
    if stacked:
        if rules is not None:
            raise ValueError("a stacked KV pool (the layer loop) is for one device, without a mesh")
        whole = jax.ShapeDtypeStruct((cfg.num_layers, *shape), stored)
        return KVCache(k=(whole,), v=(whole,), layout=layout, stacked=True)
    n = layers_per_stage(cfg.num_layers, stages)
    return KVCache(k=(one,) * n, v=(one,) * n, layout=layout)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any,
                  rules: ShardingRules | None = None, layout: str = "token_major",
                  stacked: bool = False) -> KVCache:
    """Zeroed pool: 2 * num_layers buffers of num_pages pages of page_size tokens, in
    `layout` ("token_major" or "head_major", see module docstring), holding `dtype` values
    (stored as `storage_dtype(dtype)`; an int8 pool's rows head_dim + 4 wide, scales 0);
    `stacked`: the layers' buffers as one [num_layers, ...] array for K and one for V."""
    abstract = abstract_kv_cache(cfg, num_pages, page_size, dtype, rules, layout, stacked)

    def zeros(s):
        if s.sharding is None:
            return jnp.zeros(s.shape, s.dtype)
        return jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=s.sharding)()

    return jax.tree.map(zeros, abstract)


def write_kv(pages: jax.Array, new: jax.Array, slot_mapping: jax.Array,
             layout: str = "token_major", layer: Any = None) -> jax.Array:
    """Scatter new K (or V) into the pool.

    pages: one layer's pool in `layout` ([num_pages, page_size, K, W] token-major or
    [K, num_pages, page_size, W] head-major, W = Dh, or Dh + 4 for int8); new: [..., K,
    Dh] (the step's [T, K, Dh]); slot_mapping: [...] (the step's [T]) int32 flat slots
    (padding -> slots of the null page). `new` is cast to the pool's value dtype (a uint16
    pool: rounded to bf16, its bits stored; a uint8 pool: clipped to +-448, rounded to fp8
    e4m3fn, its bits stored; an int8 pool: each row quantised with its own scale,
    jaxserve.kernels.common.quantize_kv_int8). layer: None, or the int32 index of the
    layer to write of a stacked pool [L, ...] (the layer loop). Returns the updated pool
    (in place when the pool is donated).
    """
    # Index (page, offset) directly: scattering into a reshaped [n * ps, K, Dh] view made
    # XLA:CPU copy the whole pool every step once the pool was also read.
    slots = slot_mapping.reshape(-1)
    K, Dh = new.shape[-2:]
    values = value_dtype(pages.dtype)
    rows = new.reshape(-1, K, Dh)
    if values == INT8_KV:
        rows = quantize_kv_int8(rows)
    elif values == jnp.float8_e4m3fn:
        rows = jnp.clip(rows, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    rows = rows.astype(values)  # (int8 rows are int8 already)
    if values != pages.dtype:  # stored as bits
        rows = jax.lax.bitcast_convert_type(rows, pages.dtype)
    if layer is None:
        if layout == "head_major":
            ps = pages.shape[2]
            return pages.at[:, slots // ps, slots % ps].set(rows.transpose(1, 0, 2), mode="drop")
        ps = pages.shape[1]
        return pages.at[slots // ps, slots % ps].set(rows, mode="drop")
    # a stacked pool at `layer` (numpy's rule: the layer index and the slots' indices are
    # not adjacent in the head-major index, so the update is [T, K, W] there too)
    if layout == "head_major":
        ps = pages.shape[3]
        return pages.at[layer, :, slots // ps, slots % ps].set(rows, mode="drop")
    ps = pages.shape[2]
    return pages.at[layer, slots // ps, slots % ps].set(rows, mode="drop")
