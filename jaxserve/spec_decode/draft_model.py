"""A draft model on device: its own KV pool under the target's block tables, kept in step
with the target by running over every step's tokens, and k proposals per sequence in the
verify step's dispatch.

The draft (any jaxserve checkpoint sharing the target's tokenizer: a smaller sibling, or
a truncated copy of the target) has a KV pool of the same pages as the target's: page p
holds the draft's K/V for the tokens whose target K/V are in page p, so the scheduler's
block tables, prefix cache and preemption serve both. Every step runs the draft over the
step's token rows as well (its K/V only; no logits), so the draft's K/V cover what the
target's cover. A verify step first proposes: k draft decode iterations from each
sequence's last token (`propose`), each sampling with the request's own parameters from a
key independent of the target's; the proposals and the draft's logits for them go to the
rejection sampler (jaxserve.spec_decode.rejection_sampler). Source: Leviathan et al. 2023
(draft-model speculative decoding); vLLM's draft-model proposer, whose draft runs over
the target's accepted tokens the same way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache
from jaxserve.model.params import Params
from jaxserve.model.transformer import Kernels, StepBatch, compute_logits, forward
from jaxserve.pytree import pytree_dataclass
from jaxserve.sampling import SamplingBatch, sample
from jaxserve.sharding import ShardingRules

# XOR'ed into each request's key data for the draft's own draws, so that a proposal is
# independent of the target's acceptance test and residual draw at the same output index
# (the rejection sampler's correctness needs the draft's randomness to be separate).
_DRAFT_KEY_SALT = 0x0D4AF7ED


@pytree_dataclass
class DraftState:
    """The draft's device state: params and KV pool (the target's pages and page size)."""

    params: Params
    cache: KVCache


def sync(draft: DraftState, batch: StepBatch, cfg: ModelConfig, rules: ShardingRules | None,
         kernels: Kernels) -> DraftState:
    """Run the draft over `batch`'s token rows: its K/V written where the target's are."""
    _, cache = forward(draft.params, draft.cache, batch, cfg, rules, kernels)
    return dataclasses.replace(draft, cache=cache)


def _first_rows(batch: StepBatch) -> StepBatch:
    """A decode batch ([S] rows) of each sequence's first row of a verify batch: its last
    token at its position (padding sequences: null slot, seq_len 0)."""
    S = batch.seq_lens.shape[0]
    first = jnp.minimum(batch.query_start[:-1], batch.tokens.shape[0] - 1)
    live = batch.seq_lens > 0
    pos = batch.positions[first]
    return StepBatch(tokens=batch.tokens[first], positions=pos,
                     slot_mapping=jnp.where(live, batch.slot_mapping[first], 0),  # 0: null page
                     block_tables=batch.block_tables, seq_lens=jnp.where(live, pos + 1, 0),
                     query_start=jnp.arange(S + 1, dtype=jnp.int32),
                     logits_indices=jnp.arange(S, dtype=jnp.int32), decode=True)


def propose(draft: DraftState, batch: StepBatch, sampling: SamplingBatch,
            num_drafts: jax.Array, k: int, page_size: int, cfg: ModelConfig,
            rules: ShardingRules | None, kernels: Kernels
            ) -> tuple[jax.Array, jax.Array, DraftState]:
    """k draft tokens per sequence of a verify batch.

    batch: the verify batch (each sequence's last token in its first row, at position
    num_computed); num_drafts: [S] int32, the proposals each sequence takes (<= k); the
    pages of positions up to num_computed + num_drafts must be in its block table.
    Iteration j feeds the last token (j = 0) or draft j, writes its draft K/V at position
    num_computed + j (the null page once j >= num_drafts) and samples draft j + 1 from the
    draft's logits with the request's parameters (greedy: the argmax; output index
    sampling.step + j, the draft's own key).
    Returns (drafts [S, k] int32, draft logits [S, k, V] f32 (raw: the rejection sampler
    applies the request's parameters), the draft state)."""
    S = batch.seq_lens.shape[0]
    seed = sampling.seed ^ jnp.asarray([0, _DRAFT_KEY_SALT], jnp.uint32)
    dsb = dataclasses.replace(sampling, seed=seed)

    def body(j, carry):
        pb, cache, drafts, logits = carry
        hidden, cache = forward(draft.params, cache, pb, cfg, rules, kernels)
        lg = compute_logits(draft.params, hidden, rules, kernels.matmul)   # [S, V]
        tok, _ = sample(lg, dataclasses.replace(dsb, step=dsb.step + j), kernels.sampling)
        more = (j + 1 < num_drafts) & (pb.seq_lens > 0)
        pos = jnp.where(more, pb.positions + 1, pb.positions)
        page = jnp.take_along_axis(pb.block_tables, (pos // page_size)[:, None], axis=1,
                                   mode="clip")[:, 0]
        pb = dataclasses.replace(pb, tokens=tok, positions=pos,
                                 slot_mapping=jnp.where(more, page * page_size + pos % page_size,
                                                        0),
                                 seq_lens=jnp.where(more, pb.seq_lens + 1, pb.seq_lens))
        return pb, cache, drafts.at[:, j].set(tok), logits.at[:, j].set(lg)

    init = (_first_rows(batch), draft.cache, jnp.zeros((S, k), jnp.int32),
            jnp.zeros((S, k, cfg.vocab_size), jnp.float32))
    _, cache, drafts, logits = jax.lax.fori_loop(0, k, body, init)
    return drafts, logits, dataclasses.replace(draft, cache=cache)


def fill_drafts(batch: StepBatch, drafts: jax.Array, num_drafts: jax.Array) -> StepBatch:
    """The verify batch with each sequence's draft rows (after its first) holding its
    proposals: drafts [S, k] int32, the first num_drafts[s] of row s."""
    k = drafts.shape[1]
    rows = batch.query_start[:-1, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
    rows = jnp.where(jnp.arange(k)[None, :] < num_drafts[:, None], rows, batch.tokens.shape[0])
    return dataclasses.replace(batch, tokens=batch.tokens.at[rows].set(drafts, mode="drop"))
