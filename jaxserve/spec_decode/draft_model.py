"""Drafters on device: a draft model's or draft head's state kept in step with the target,
and k proposals per sequence in the verify step's dispatch.

A drafter's KV pool has the target's pages: page p holds the drafter's K/V for the tokens
whose target K/V are in page p, so the scheduler's block tables, prefix cache and
preemption serve both. Every step runs the drafter over the step's token rows as well
(`Drafter.sync`: its K/V only, no logits), so its K/V cover what the target's cover. A
verify step first proposes (`propose`): k drafter iterations from each sequence's last
token, each sampling with the request's own parameters from a key independent of the
target's; the proposals and the drafter's logits for them go to the rejection sampler
(jaxserve.sample.rejection_sampler).

`DraftModel`: a whole smaller model sharing the target's tokenizer (any jaxserve
checkpoint; Leviathan et al. 2023). `jaxserve.spec_decode.eagle.EagleHead`: one decoder
layer over the target's hidden states (Li et al. 2024). Source: vLLM's draft-model and
EAGLE proposers, whose drafts run over the target's accepted tokens the same way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.params import Params
from jaxserve.model.inputs import StepBatch, next_decode_batch
from jaxserve.model.transformer import (Kernels, compute_logits, forward)
from jaxserve.sample.plan import ON_DEVICE, SamplerPlan
from jaxserve.sample.sampler import SamplingBatch, sample
from jaxserve.distributed.sharding import ShardingRules

# XOR'ed into each request's key data for the drafter's own draws, so that a proposal is
# independent of the target's acceptance test and residual draw at the same output index
# (the rejection sampler's correctness needs the draft's randomness to be separate).
_DRAFT_KEY_SALT = 0x0D4AF7ED


class Drafter:
    """What a drafter does on device (static: hashable, part of the compiled step's
    configuration; its arrays are passed in: `dparams`, and `dcache`, donated).

    feature_layers: the layers whose entering residual streams `sync` reads (the step's
        forward exports them: transformer.forward_features); () for none.
    sync: run over a step's rows (the target's hidden states [T, D] at them given, and
        the features of `feature_layers`: one [T, D] each), writing the drafter's K/V;
        returns the new dcache.
    start: the carry of the first proposal iteration for the decode batch `pb` of each
        sequence's last token.
    step: one proposal iteration on decode batch `pb`: (logits [S, V] f32 over the target's
        vocabulary, the next carry, dcache)."""

    feature_layers: tuple[int, ...] = ()

    def sync(self, params: Params, dparams, dcache, batch: StepBatch, hidden: jax.Array,
             features: tuple[jax.Array, ...], rules: ShardingRules | None, kernels: Kernels):
        raise NotImplementedError

    def start(self, params: Params, dparams, dcache, pb: StepBatch) -> Any:
        return ()

    def step(self, params: Params, dparams, dcache, pb: StepBatch, carry,
             rules: ShardingRules | None, kernels: Kernels):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class DraftModel(Drafter):
    """A draft model of config `cfg`: dparams its Params, dcache its KVCache."""

    cfg: ModelConfig

    def sync(self, params, dparams, dcache, batch, hidden, features, rules, kernels):
        _, dcache = forward(dparams, dcache, batch, self.cfg, rules, kernels)
        return dcache

    def step(self, params, dparams, dcache, pb, carry, rules, kernels):
        h, dcache = forward(dparams, dcache, pb, self.cfg, rules, kernels)
        return compute_logits(dparams, h, rules, kernels.matmul), carry, dcache


def first_rows(batch: StepBatch) -> StepBatch:
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


def propose(drafter: Drafter, params: Params, dparams, dcache, batch: StepBatch,
            sampling: SamplingBatch, num_drafts: jax.Array, k: int, page_size: int,
            vocab_size: int, rules: ShardingRules | None, kernels: Kernels,
            plan: SamplerPlan = ON_DEVICE, min_confidence: float = 0.0,
            stop_early: bool = False):
    """k draft tokens per sequence of a verify batch.

    batch: the verify batch (each sequence's last token in its first row, at position
    num_computed); vocab_size: the target's (the logits' width); num_drafts: [S] int32, the
    proposals each sequence may take (<= k); the pages of positions up to num_computed +
    num_drafts must be in its block table.
    Iteration j feeds the last token (j = 0) or draft j, writes the drafter's K/V at
    position num_computed + j (the null page once the sequence has no further draft) and
    samples draft j + 1 from the drafter's logits with the request's parameters (greedy:
    the argmax; output index sampling.step + j, the drafter's own key; the sampling mode
    plan.mode's, jaxserve.sample.plan).
    min_confidence (SpeculativeConfig.draft_confidence_threshold): a sequence's drafts end
    before the first whose probability under the drafter's raw logits is below it (0: no
    limit). stop_early: the iterations stop once no sequence takes a further draft (a
    while loop, for a backend where that saves time: the C++ CPU matmul; else all k run,
    their surplus unused).
    Returns (drafts [S, k] int32, draft logits [S, k, V] f32 (raw: the rejection sampler
    applies the request's parameters), dcache, num_drafts [S] int32: the proposals taken,
    <= the given num_drafts; past them drafts and logits are unused)."""
    S = batch.seq_lens.shape[0]
    seed = sampling.seed ^ jnp.asarray([0, _DRAFT_KEY_SALT], jnp.uint32)
    dsb = dataclasses.replace(sampling, seed=seed)
    pb0 = first_rows(batch)
    log_min = math.log(min_confidence) if min_confidence > 0 else None

    def body(state):
        j, pb, carry, dcache, drafts, logits, taken = state
        lg, carry, dcache = drafter.step(params, dparams, dcache, pb, carry, rules, kernels)
        tok, logprob = sample(lg, dataclasses.replace(dsb, step=dsb.step + j),
                              kernels.sampling, plan)
        going = asked(j, taken)
        if log_min is not None:
            going &= logprob >= log_min
        taken = jnp.where(going, j + 1, taken)
        pb = next_decode_batch(pb, tok, page_size, going & (j + 1 < num_drafts)
                               & (pb.seq_lens > 0))
        return (j + 1, pb, carry, dcache, drafts.at[:, j].set(tok), logits.at[:, j].set(lg),
                taken)

    def asked(j, taken):  # draft j + 1 wanted: every draft before it taken, room for it
        return (taken == j) & (j < num_drafts)

    # taken [S]: the drafts each sequence takes so far
    init = (jnp.int32(0), pb0, drafter.start(params, dparams, dcache, pb0), dcache,
            jnp.zeros((S, k), jnp.int32), jnp.zeros((S, k, vocab_size), jnp.float32),
            jnp.zeros((S,), jnp.int32))
    if stop_early:
        state = jax.lax.while_loop(
            lambda st: (st[0] < k) & jnp.any(asked(st[0], st[-1])), body, init)
    else:
        state = jax.lax.fori_loop(0, k, lambda _, st: body(st), init)
    _, _, _, dcache, drafts, logits, taken = state
    return drafts, logits, dcache, taken


def fill_drafts(batch: StepBatch, drafts: jax.Array, num_drafts: jax.Array) -> StepBatch:
    """The verify batch with each sequence's draft rows (after its first) holding its
    proposals: drafts [S, k] int32, the first num_drafts[s] of row s."""
    k = drafts.shape[1]
    rows = batch.query_start[:-1, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :]
    rows = jnp.where(jnp.arange(k)[None, :] < num_drafts[:, None], rows, batch.tokens.shape[0])
    return dataclasses.replace(batch, tokens=batch.tokens.at[rows].set(drafts, mode="drop"))
