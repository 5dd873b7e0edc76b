"""The step functions the runner compiles: pure functions of (params, KV pool, step arrays,
sampling arrays) that return the sampled tokens, their logprobs and the new KV pool.

A one-token mixed or decode step is two programs, as vLLM v1 splits `execute_model` from
`sample_tokens`: `forward_step` (forward -> the logits of the rows that sample, left on
device) and `sample_step` (controls -> sample), so that the engine can dispatch step N+1's
forward before it has read step N's tokens, and give the sampler what depends on them (a
grammar's bitmask) afterwards. `model_step` is the same in one program, `num_steps` times
for a multi-step decode (each sub-step feeding its tokens back on device), once for a
one-token decode step with no grammar row when CompilationConfig.fused_decode is on;
`verify_step` verifies draft tokens (the draft model or head proposes inside it, then the
rejection sampler keeps exactly the model's distribution), in one round or several
(SpeculativeConfig.verify_steps). Logits controls, top logprobs and prompt logprobs run
only in steps where some row asks, and sampling noise and filters only where some row
samples or filters: the sampler's branches are a static `plan`, decided on
the host (KernelConfig.branches "host", GPUs' default: no conditional in a decode step's
programs) or on device (`lax.cond`; jaxserve.sample.plan); with host branches the
prompt logprobs are a program of their own (`prompt_logprobs_step`). The KV pool is
passed in and returned (donated by the runner).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.distributed.sharding import ShardingRules, constrain
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.params import Params
from jaxserve.model.pooling import pool_hidden
from jaxserve.model.inputs import StepBatch, next_decode_batch, shift_sequences
from jaxserve.model.transformer import (Kernels, compute_logits, forward_features,
                                        last_token_logits, logits_sharding, pin_lm_head)
from jaxserve.sample.logits_processors import (apply_controls, controls_active, history,
                                               write_token_pool)
from jaxserve.sample.plan import ON_DEVICE, SamplerPlan, branch
from jaxserve.sample.rejection_sampler import rejection_sample
from jaxserve.sample.sampler import (PROMPT_LOGPROBS_BLOCK, SamplingBatch, sample_controlled,
                                     token_logprobs, top_logprobs)
from jaxserve.spec_decode import draft_model
from jaxserve.spec_decode.draft_model import Drafter
from jaxserve.spec_decode.ngram_device import ngram_propose


def _top(logits: jax.Array, sampling: SamplingBatch, num_top: int, impl,
         plan: SamplerPlan) -> dict:
    """{"top_ids": [R, num_top] int32, "top_logprobs": [R, num_top] f32} of logits [R, V]
    (jaxserve.sample.sampler.top_logprobs), computed only when a row asks for any (zeros
    otherwise: plan.top_logprobs, or with None decided on device); {} when the engine
    reports none (num_top 0)."""
    if not num_top or sampling.num_logprobs is None:
        return {}
    R = logits.shape[0]
    ids, lps = branch(
        plan.top_logprobs, lambda: jnp.any(sampling.num_logprobs > 0),
        lambda: top_logprobs(logits, num_top, impl),
        lambda: (jnp.zeros((R, num_top), jnp.int32), jnp.zeros((R, num_top), jnp.float32)))
    return {"top_ids": ids, "top_logprobs": lps}


def _prompt_logprobs(params: Params, hidden: jax.Array, targets: jax.Array, *,
                     rules: ShardingRules | None, kernels: Kernels, num_top: int,
                     on_device: bool = True) -> dict:
    """Prompt logprobs of a mixed step, computed only when a row asks (zeros otherwise;
    on_device False: computed, the host having decided: `prompt_logprobs_step`).
    hidden: [T, D]; targets: [T] int32, the token after each row whose logprob is asked
    (-1: none). Returns {"prompt_logprobs": [T] f32, and with num_top "prompt_top_ids"
    [T, num_top] int32, "prompt_top_logprobs" [T, num_top] f32}. The LM head runs in a
    `lax.map` over blocks of PROMPT_LOGPROBS_BLOCK rows, so that one block's [rows, vocab]
    logits are live at a time (unrolled blocks kept them all: PERFORMANCE.md, "Measurements
    behind the code"); inside the loop the LM head weights are pinned to their
    shardings."""
    T = hidden.shape[0]

    def block(h, tgt):
        h = constrain(rules, h, (None, None))  # replicated, as compute_logits takes it
        logits = compute_logits(pin_lm_head(params, rules), h, rules, kernels.matmul)
        out = {"prompt_logprobs": token_logprobs(logits, jnp.maximum(tgt, 0), kernels.sampling)}
        if num_top:
            out["prompt_top_ids"], out["prompt_top_logprobs"] = top_logprobs(
                logits, num_top, kernels.sampling)
        return out

    def compute():
        R = min(T, PROMPT_LOGPROBS_BLOCK)
        nb = -(-T // R)
        pad = nb * R - T
        h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(nb, R, -1)
        tg = jnp.pad(targets, (0, pad)).reshape(nb, R)
        out = jax.lax.map(lambda a: block(*a), (h, tg))
        return jax.tree.map(lambda x: x.reshape((nb * R,) + x.shape[2:])[:T], out)

    if not on_device:
        return compute()
    shapes = jax.eval_shape(compute)
    return jax.lax.cond(jnp.any(targets >= 0), compute,
                        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes))


def _forward_sync(params: Params, cache: KVCache, batch: StepBatch, draft_params, draft_cache,
                  cfg: ModelConfig, drafter: Drafter | None, rules: ShardingRules | None,
                  kernels: Kernels):
    """The forward pass and the drafter's sync over the same rows (its K/V keep up with
    the target's; it reads the target's hidden states and the features of its
    `feature_layers`): (hidden [T, D], cache, draft_cache)."""
    layers = drafter.feature_layers if drafter is not None else ()
    hidden, features, cache = forward_features(params, cache, batch, cfg, rules, kernels,
                                               layers)
    if drafter is not None:
        draft_cache = drafter.sync(params, draft_params, draft_cache, batch, hidden,
                                   features, rules, kernels)
    return hidden, cache, draft_cache


def _forward_logits(params: Params, cache: KVCache, batch: StepBatch, draft_params,
                    draft_cache, token_pool, *, cfg: ModelConfig, drafter: Drafter | None,
                    rules: ShardingRules | None, kernels: Kernels):
    """The batch's tokens written to the token pool (the penalties' history), the forward
    pass, and each sequence's last-token logits: (hidden [T, D], logits [S, V] f32, cache,
    draft_cache, token_pool). A drafter (speculative decoding) runs over the same rows, so
    that its K/V keep up with the target's."""
    token_pool = write_token_pool(token_pool, batch.slot_mapping, batch.tokens)
    hidden, cache, draft_cache = _forward_sync(params, cache, batch, draft_params,
                                               draft_cache, cfg, drafter, rules, kernels)
    logits = last_token_logits(params, hidden, batch.logits_indices, rules, kernels.matmul)
    return hidden, logits, cache, draft_cache, token_pool


def _sample_logits(logits: jax.Array, sampling: SamplingBatch, token_pool: jax.Array,
                   block_tables: jax.Array, num_context: jax.Array, *, page_size: int,
                   kernels: Kernels, num_top: int, plan: SamplerPlan):
    """logits [S, V] f32 -> controls (logit bias, penalties, grammar bitmask) -> sample:
    (tokens [S] int32, logprobs [S] f32, extra: `_top` of the rows). The penalties read
    each row's history from the token pool through block_tables [S, P] int32, its first
    num_context [S] int32 positions (`apply_controls`). plan: the branches taken
    (jaxserve.sample.plan)."""
    def context():
        return history(token_pool, block_tables, page_size), num_context

    tokens, logprobs = sample_controlled(logits, sampling, kernels.sampling, context, plan)
    return tokens, logprobs, _top(logits, sampling, num_top, kernels.sampling, plan)


def _sample_step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
                 draft_params, draft_cache, token_pool, *, cfg: ModelConfig,
                 drafter: Drafter | None, rules: ShardingRules | None, kernels: Kernels,
                 num_top: int, plan: SamplerPlan):
    """`_forward_logits`, then `_sample_logits` in the same program: (tokens [S] int32,
    logprobs [S] f32, extra, cache, draft_cache, token_pool). extra: `_top` of the sampled
    rows, and in a mixed step `_prompt_logprobs`."""
    hidden, logits, cache, draft_cache, token_pool = _forward_logits(
        params, cache, batch, draft_params, draft_cache, token_pool, cfg=cfg, drafter=drafter,
        rules=rules, kernels=kernels)
    tokens, logprobs, extra = _sample_logits(
        logits, sampling, token_pool, batch.block_tables,
        batch.positions[batch.logits_indices] + 1, page_size=cache.page_size,
        kernels=kernels, num_top=num_top, plan=plan)
    if sampling.prompt_targets is not None:
        extra.update(_prompt_logprobs(params, hidden, sampling.prompt_targets, rules=rules,
                                      kernels=kernels, num_top=num_top))
    return tokens, logprobs, extra, cache, draft_cache, token_pool


def _with_prev_tokens(batch: StepBatch, prev_tokens: jax.Array, prev_index: jax.Array
                      ) -> StepBatch:
    """batch with token row t replaced by prev_tokens[prev_index[t]] where prev_index[t] >= 0
    (a token the previous step sampled, which the host has not read)."""
    from_prev = prev_tokens[jnp.maximum(prev_index, 0)]
    return dataclasses.replace(batch, tokens=jnp.where(prev_index >= 0, from_prev,
                                                       batch.tokens))


def _padded_last(tokens: jax.Array, max_rows: int, rules: ShardingRules | None) -> jax.Array:
    """[max_rows] int32: tokens [S] int32 padded with 0, replicated (the next step's
    prev_tokens)."""
    last = jnp.zeros((max_rows,), jnp.int32).at[:tokens.shape[0]].set(tokens)
    return constrain(rules, last, (None,))


def forward_step(params: Params, cache: KVCache, batch: StepBatch, prompt_targets,
                 prev_tokens: jax.Array, prev_index: jax.Array, draft_params, draft_cache,
                 token_pool, *, cfg: ModelConfig, drafter: Drafter | None,
                 rules: ShardingRules | None, kernels: Kernels, num_top: int = 0,
                 pooling: str | None = None, keep_hidden: bool = False):
    """The first half of a one-token mixed or decode step: the forward pass up to each
    sequence's last-token logits, which stay on device for `sample_step` (dispatched
    after it, once the host knows the sampling inputs that depend on the previous step's
    tokens: a structured-output grammar's bitmask). Source: vLLM v1's
    GPUModelRunner.execute_model / sample_tokens.

    prev_tokens / prev_index / draft_params / draft_cache / token_pool as `model_step`;
    prompt_targets: [T] int32 (a mixed step; `SamplingBatch.prompt_targets`) or None.
    pooling: the engine's EngineConfig.pooling; when set, extra["pooled"] is `pool_hidden`
    [S, D] f32 (embedding requests read theirs). keep_hidden: extra["hidden"] is the
    hidden states [T, D] (cfg.dtype, replicated), for `prompt_logprobs_step` (with host
    branches the prompt logprobs are a program of their own, not a conditional here).
    Returns (logits [S, V] f32, extra: `_prompt_logprobs` when prompt_targets is given
    (else {}), "pooled", "hidden", cache, draft_cache, token_pool)."""
    batch = _with_prev_tokens(batch, prev_tokens, prev_index)
    hidden, logits, cache, draft_cache, token_pool = _forward_logits(
        params, cache, batch, draft_params, draft_cache, token_pool, cfg=cfg, drafter=drafter,
        rules=rules, kernels=kernels)
    sharding = logits_sharding(params, rules, cfg.vocab_size)
    if sharding is not None:  # what sample_step is compiled to take
        logits = jax.lax.with_sharding_constraint(logits, sharding)
    extra = {}
    if prompt_targets is not None:
        extra = _prompt_logprobs(params, hidden, prompt_targets, rules=rules, kernels=kernels,
                                 num_top=num_top)
    if pooling is not None:
        extra["pooled"] = constrain(rules, pool_hidden(hidden, batch, pooling), (None, None))
    if keep_hidden:
        extra["hidden"] = constrain(rules, hidden, (None, None))
    return logits, extra, cache, draft_cache, token_pool


def prompt_logprobs_step(params: Params, hidden: jax.Array, targets: jax.Array, *,
                         rules: ShardingRules | None, kernels: Kernels, num_top: int = 0
                         ) -> dict:
    """A mixed step's prompt logprobs as a program of its own, dispatched after its forward
    only when some row asks (host branches, jaxserve.sample.plan: the forward then has no
    conditional for them): hidden [T, D] (`forward_step`'s extra["hidden"]), targets [T]
    int32 as `SamplingBatch.prompt_targets`. Returns `_prompt_logprobs`' dict."""
    return _prompt_logprobs(params, hidden, targets, rules=rules, kernels=kernels,
                            num_top=num_top, on_device=False)


def sample_step(logits: jax.Array, sampling: SamplingBatch, token_pool: jax.Array,
                block_tables: jax.Array, num_context: jax.Array, *, page_size: int,
                max_rows: int, rules: ShardingRules | None, kernels: Kernels,
                num_top: int = 0, plan: SamplerPlan = ON_DEVICE):
    """The second half of a one-token step: logits [S, V] f32 (`forward_step`'s, with its
    sharding) -> controls -> sample (`_sample_logits`). token_pool: [num_slots] int32,
    read for the penalties' history and returned as it is (donated, so that it passes
    from step to step in order); block_tables: [S, P] int32 and num_context: [S] int32,
    each sequence's pages and the positions before its sampled token. plan: the sampler's
    branches (jaxserve.sample.plan: decided on the host, or left to the device).

    Returns (last [max_rows] int32: the tokens padded with 0, replicated, the next step's
    prev_tokens; tokens [1, S] int32, logprobs [1, S] f32, extra: the top logprobs
    [1, S, num_top], token_pool), as `model_step` with num_steps 1."""
    tokens, logprobs, extra = _sample_logits(logits, sampling, token_pool, block_tables,
                                             num_context, page_size=page_size,
                                             kernels=kernels, num_top=num_top, plan=plan)
    extra = {k: v[None] for k, v in extra.items()}
    return (_padded_last(tokens, max_rows, rules), tokens[None], logprobs[None], extra,
            token_pool)


def model_step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
               prev_tokens: jax.Array, prev_index: jax.Array, draft_params, draft_cache,
               token_pool, *, cfg: ModelConfig, drafter: Drafter | None,
               rules: ShardingRules | None, kernels: Kernels, num_top: int = 0,
               num_steps: int = 1, plan: SamplerPlan = ON_DEVICE):
    """One engine step: `num_steps` tokens per sequence. prev_tokens: [max_rows] int32, the
    previous step's last sampled tokens (still on device); prev_index: [T] int32, token row
    t is prev_tokens[prev_index[t]], or batch.tokens[t] where prev_index[t] < 0 (the host
    has not read the previous step's tokens yet); draft_params / draft_cache: the drafter's arrays
    (speculative decoding with a draft model or head; None without one), its cache donated
    like the target's; token_pool: [num_pages * page_size] int32, every sequence's tokens
    at their KV slots (donated; jaxserve.sample.logits_processors).

    num_steps > 1 (decode batches only): multi-step decode, a `fori_loop` in which each
    iteration samples one token per sequence and feeds it back as the next iteration's
    input (positions, slots and lengths advanced on device; the block tables must already
    hold the pages of every position written). Sub-step i samples with `sampling.step + i`,
    so the tokens are those of num_steps single steps. Source: vLLM's multi-step
    scheduling (num_scheduler_steps). plan: the sampler's branches (jaxserve.sample.plan),
    the same in every sub-step.

    Returns (last [max_rows] int32: the last sub-step's tokens padded with 0, tokens
    [num_steps, S] int32, logprobs [num_steps, S] f32, extra (`_sample_step`'s, the top
    logprobs with a leading [num_steps] axis), cache, draft_cache, token_pool)."""
    S = batch.seq_lens.shape[0]
    batch = _with_prev_tokens(batch, prev_tokens, prev_index)
    run = functools.partial(_sample_step, params, cfg=cfg, drafter=drafter, rules=rules,
                            kernels=kernels, num_top=num_top, plan=plan)
    if num_steps == 1:
        tokens, logprobs, extra, cache, draft_cache, token_pool = run(
            cache, batch, sampling, draft_params, draft_cache, token_pool)
        tokens, logprobs = tokens[None], logprobs[None]
        extra = {k: v[None] if k.startswith("top") else v for k, v in extra.items()}
    else:
        if not batch.decode:
            raise ValueError(f"num_steps={num_steps} > 1 needs a decode batch")

        def body(i, carry):
            b, cache, dcache, pool, tokens, logprobs, extra = carry
            t, lp, ex, cache, dcache, pool = run(
                cache, b, dataclasses.replace(sampling, step=sampling.step + i), draft_params,
                dcache, pool)
            b = next_decode_batch(b, t, cache.page_size)
            extra = {k: extra[k].at[i].set(ex[k]) for k in extra}
            return b, cache, dcache, pool, tokens.at[i].set(t), logprobs.at[i].set(lp), extra

        top = {}
        if num_top and sampling.num_logprobs is not None:
            top = {"top_ids": jnp.zeros((num_steps, S, num_top), jnp.int32),
                   "top_logprobs": jnp.zeros((num_steps, S, num_top), jnp.float32)}
        init = (batch, cache, draft_cache, token_pool, jnp.zeros((num_steps, S), jnp.int32),
                jnp.zeros((num_steps, S), jnp.float32), top)
        _, cache, draft_cache, token_pool, tokens, logprobs, extra = jax.lax.fori_loop(
            0, num_steps, body, init)
    last = _padded_last(tokens[-1], prev_tokens.shape[0], rules)
    return last, tokens, logprobs, extra, cache, draft_cache, token_pool


def _verify_round(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
                  ahead: jax.Array, draft_params, draft_cache, token_pool, *,
                  cfg: ModelConfig, drafter: Drafter | None, ngram: tuple[int, int] | None,
                  rules: ShardingRules | None, kernels: Kernels, num_top: int,
                  plan: SamplerPlan, draft_confidence: float):
    """One verify round over `batch` (its rows already at their positions, each first row
    holding the sequence's last token): drafts proposed where they are made on device (a
    drafter for every sequence, up to its first below `draft_confidence`; n-gram lookup
    for the `ahead` [S] bool ones), the forward (with the C++ CPU matmul, of the first
    rows alone when no sequence has a draft), the rows' logits controls and rejection
    sampling (see `verify_step`).
    Returns (tokens [S, J] int32, logprobs [S, J] f32, num_tokens [S] int32, num_drafts [S]
    int32, extra: the top logprobs [S, J, num_top], cache, draft_cache, token_pool)."""
    S, J = batch.logits_indices.shape
    T = batch.tokens.shape[0]
    start = batch.query_start[:-1]
    first = jnp.minimum(start, T - 1)
    num_drafts = jnp.clip(batch.query_start[1:] - start - 1, 0, J - 1)
    if ngram is not None:
        hist = history(token_pool, batch.block_tables, cache.page_size)
        p0 = batch.positions[first]
        hist = hist.at[jnp.arange(S), p0].set(batch.tokens[first])
        found, num_found = ngram_propose(hist, jnp.where(batch.seq_lens > 0, p0 + 1, 0),
                                         min_n=ngram[0], max_n=ngram[1], k=J - 1)
        num_drafts = jnp.where(ahead, jnp.minimum(num_found, num_drafts), num_drafts)
        batch = draft_model.fill_drafts(batch, found, jnp.where(ahead, num_drafts, 0))
    # With the C++ CPU matmul a verify row costs time, so a round with fewer drafts
    # should run fewer: the drafter stops once no sequence takes another draft, and a
    # round whose sequences have no draft runs the forward of their first rows alone
    # (a few rows' FMAs cost more than one row's: a 2-core Intel Xeon with AMX, ~10.3 ms
    # against ~13.6 for 5 rows; PERFORMANCE.md, "Verify rounds without drafts"). Row 0's
    # bits are the same either way (the kernels sum a row alone: the plain decode
    # step's); the other rows' logits are unused (zeros). Not on a GPU, where 5 rows
    # cost what 1 does and a conditional waits on the host.
    rows_cost = not (J == 1 or kernels.host_branches or kernels.matmul.name != "cpu")
    draft_logits = None
    if drafter is not None:
        drafts, draft_logits, draft_cache, num_drafts = draft_model.propose(
            drafter, params, draft_params, draft_cache, batch, sampling, num_drafts, J - 1,
            cache.page_size, cfg.vocab_size, rules, kernels, plan, draft_confidence,
            stop_early=rows_cost)
        batch = draft_model.fill_drafts(batch, drafts, num_drafts)
    token_pool = write_token_pool(token_pool, batch.slot_mapping, batch.tokens)

    def all_rows():
        hidden, c, dc = _forward_sync(params, cache, batch, draft_params, draft_cache, cfg,
                                      drafter, rules, kernels)
        return last_token_logits(params, hidden, batch.logits_indices.reshape(-1), rules,
                                 kernels.matmul), c, dc                  # [S * J, V]

    def first_rows_only():  # no drafts to verify: a decode step's forward, 1 row each
        b1 = draft_model.first_rows(batch)
        if batch.lora_slot is not None:
            b1 = dataclasses.replace(b1, lora_slot=batch.lora_slot[first])
        hidden, c, dc = _forward_sync(params, cache, b1, draft_params, draft_cache, cfg,
                                      drafter, rules, kernels)
        lg = last_token_logits(params, hidden, jnp.arange(S), rules, kernels.matmul)
        return jnp.zeros((S, J, lg.shape[-1]), lg.dtype).at[:, 0].set(lg).reshape(S * J, -1), \
            c, dc

    if not rows_cost:
        logits, cache, draft_cache = all_rows()
    else:
        logits, cache, draft_cache = jax.lax.cond(jnp.any(num_drafts > 0), all_rows,
                                                  first_rows_only)
    rows = jnp.clip(start[:, None] + 1 + jnp.arange(J - 1)[None, :], 0, T - 1)
    verify = functools.partial(rejection_sample, draft_ids=batch.tokens[rows],
                               num_drafts=num_drafts, sb=sampling, draft_logits=draft_logits,
                               impl=kernels.sampling, plan=plan)

    def plain():
        return verify(logits.reshape(S, J, -1))

    def controlled():
        steps = (sampling.step[:, None] + jnp.arange(J, dtype=jnp.int32)[None, :]).reshape(-1)
        context = jnp.repeat(history(token_pool, batch.block_tables, cache.page_size), J, 0)
        num_context = batch.positions[batch.logits_indices.reshape(-1)] + 1
        processed = apply_controls(logits, sampling.controls.repeat(J), steps, context,
                                   num_context)
        tokens, _, num = verify(processed.reshape(S, J, -1))
        raw = token_logprobs(logits, tokens.reshape(-1), kernels.sampling).reshape(S, J)
        return tokens, raw, num

    if sampling.controls is None:
        tokens, logprobs, num = plain()
    else:
        tokens, logprobs, num = branch(plan.controls,
                                       lambda: controls_active(sampling.controls),
                                       controlled, plain)
    extra = _top(logits, dataclasses.replace(
        sampling, num_logprobs=None if sampling.num_logprobs is None
        else jnp.repeat(sampling.num_logprobs, J)), num_top, kernels.sampling, plan)
    extra = {k: v.reshape(S, J, -1) for k, v in extra.items()}
    return tokens, logprobs, num, num_drafts, extra, cache, draft_cache, token_pool


def verify_step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
                prev_tokens: jax.Array, prev_shift: jax.Array, prev_index: jax.Array,
                draft_params, draft_cache, token_pool, *, cfg: ModelConfig,
                drafter: Drafter | None, ngram: tuple[int, int] | None,
                rules: ShardingRules | None, kernels: Kernels, num_top: int = 0,
                rounds: int = 1, plan: SamplerPlan = ON_DEVICE,
                draft_confidence: float = 0.0):
    """A verify step (speculative decoding): forward over each sequence's last token and
    its drafts (the tokens after its first row), logits at every one of its rows
    (batch.logits_indices [S, J], J = 1 + num_speculative_tokens), the rows' logits
    controls (jaxserve.sample.logits_processors, each position with the drafts before it in its
    history), rejection sampling (jaxserve.sample.rejection_sampler). With a drafter
    (a draft model or head) the drafts are proposed here first
    (jaxserve.spec_decode.draft_model.propose; the batch's draft rows are placeholders),
    each sequence's ending before the first whose probability under the drafter is below
    draft_confidence (SpeculativeConfig.draft_confidence_threshold; 0: none end early),
    and the drafter runs over the verify rows too.

    Async scheduling: prev_tokens / prev_shift [max_rows] int32 are the previous step's
    outputs (`last`, `shift` below; shift zeros after a step that is not a verify step);
    a sequence whose first row has prev_index >= 0 was planned before the previous
    verify step's tokens were read, as if that step had kept one token of it: its last
    token is prev_tokens[prev_index], and its rows, slots, seq_len and sampling step move
    prev_shift[prev_index] positions on (`shift_sequences`; its block table holds the
    pages of the furthest case). Its drafts are proposed here: by the drafter, or with
    `ngram` = (min_n, max_n) by n-gram lookup over its history in the token pool
    (jaxserve.spec_decode.ngram_device; at most its planned draft rows, the rest unused).
    Source: vLLM v1's async scheduling with speculative decoding.

    rounds > 1: `rounds` verify rounds in one program (a `fori_loop`; SpeculativeConfig.
    verify_steps), as multi-step decode runs decode steps: round r + 1 is the batch of
    round 0 moved on by the tokens rounds 0..r kept, its first rows holding their last
    kept tokens and its drafts proposed on device as for a sequence planned ahead (every
    block table must hold the pages of the furthest case: every draft of every round
    accepted). Each sequence keeps the tokens of every round, in order. plan: the
    sampler's branches (jaxserve.sample.plan), the drafter's and the rejection sampler's.

    Returns (last [max_rows] int32: each sequence's last kept token, padded; shift
    [max_rows] int32: its kept tokens - 1, padded; tokens [rounds * J, S] int32 and
    logprobs [rounds * J, S] f32 (of the raw logits): column b's first sum(num_tokens[:,
    b]) rows are sequence b's kept tokens, every round's in order (the rest: rejected
    drafts or unused); num_tokens [rounds, S] int32: output tokens kept per round and
    sequence; num_drafts [rounds, S] int32: the drafts verified; extra: the top logprobs
    [rounds * J, S, num_top] laid out as the tokens, as `_top`; cache, draft_cache,
    token_pool)."""
    S, J = batch.logits_indices.shape
    T = batch.tokens.shape[0]
    first = jnp.minimum(batch.query_start[:-1], T - 1)
    live = batch.seq_lens > 0
    prev = prev_index[first]
    ahead = (prev >= 0) & live    # planned before its last token was read
    shift = jnp.where(ahead, prev_shift[jnp.maximum(prev, 0)], 0)
    batch = _with_prev_tokens(batch, prev_tokens, prev_index)
    run = functools.partial(_verify_round, params, cfg=cfg, drafter=drafter, ngram=ngram,
                            rules=rules, kernels=kernels, num_top=num_top, plan=plan,
                            draft_confidence=draft_confidence)

    def moved(b: StepBatch, by: jax.Array):
        return (shift_sequences(b, by, cache.page_size),
                dataclasses.replace(sampling, step=sampling.step + by))

    max_rows = prev_tokens.shape[0]
    if rounds == 1:
        tokens, logprobs, num, num_drafts, extra, cache, draft_cache, token_pool = run(
            cache, *moved(batch, shift), ahead, draft_params, draft_cache, token_pool)
        kept = jnp.maximum(num - 1, 0)
        last = tokens[jnp.arange(S), kept]
        extra = {k: v.transpose(1, 0, 2) for k, v in extra.items()}
        return (_padded_last(last, max_rows, rules), _padded_last(kept, max_rows, rules),
                tokens.T, logprobs.T, num[None], num_drafts[None], extra, cache, draft_cache,
                token_pool)

    R = rounds * J
    cols = jnp.broadcast_to(jnp.arange(S)[:, None], (S, J))

    def place(buf, values, done, num):
        """values [S, J, ...] of one round into buf [R, S, ...]: sequence b's first
        num[b] at rows done[b]..; the rest dropped."""
        j = jnp.arange(J)[None, :]
        rows = jnp.where(j < num[:, None], done[:, None] + j, R)
        return buf.at[rows, cols].set(values, mode="drop")

    def body(r, carry):
        done, last, cache, dcache, pool, out = carry
        # each first row: the last token kept so far (round 0: its own)
        b = dataclasses.replace(batch, tokens=batch.tokens.at[jnp.where(live, first, T)].set(
            last, mode="drop"))
        tokens, logprobs, num, num_drafts, extra, cache, dcache, pool = run(
            cache, *moved(b, shift + done), ahead | ((r > 0) & live), draft_params, dcache,
            pool)
        num = jnp.where(live, num, 0)
        out = {"tokens": place(out["tokens"], tokens, done, num),
               "logprobs": place(out["logprobs"], logprobs, done, num),
               "num": out["num"].at[r].set(num), "num_drafts": out["num_drafts"].at[r].set(
                   jnp.where(live, num_drafts, 0)),
               **{k: place(out[k], v, done, num) for k, v in extra.items()}}
        last = jnp.where(live, tokens[jnp.arange(S), jnp.maximum(num - 1, 0)], last)
        return done + num, last, cache, dcache, pool, out

    out = {"tokens": jnp.zeros((R, S), jnp.int32), "logprobs": jnp.zeros((R, S), jnp.float32),
           "num": jnp.zeros((rounds, S), jnp.int32),
           "num_drafts": jnp.zeros((rounds, S), jnp.int32)}
    if num_top and sampling.num_logprobs is not None:
        out["top_ids"] = jnp.zeros((R, S, num_top), jnp.int32)
        out["top_logprobs"] = jnp.zeros((R, S, num_top), jnp.float32)
    init = (jnp.zeros((S,), jnp.int32), batch.tokens[first], cache, draft_cache, token_pool,
            out)
    done, last, cache, draft_cache, token_pool, out = jax.lax.fori_loop(0, rounds, body, init)
    extra = {k: out[k] for k in ("top_ids", "top_logprobs") if k in out}
    kept = jnp.maximum(done - 1, 0)
    return (_padded_last(last, max_rows, rules), _padded_last(kept, max_rows, rules),
            out["tokens"], out["logprobs"], out["num"], out["num_drafts"], extra, cache,
            draft_cache, token_pool)
