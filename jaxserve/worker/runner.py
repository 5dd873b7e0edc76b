"""Device side of the engine: holds the params and the KV pool, runs the jitted step.

The step (forward -> last-token logits -> sample) is compiled ahead of time once per
bucketed shape (kind, T, S, P, n: jaxserve.worker.compilation.StepShapes): "mixed" or
"decode", T token rows, S sequences, P block-table pages; the executables are kept here, so a shape outside the
buckets is a visible compilation (`num_compilations`), never a silent retrace. The KV
pool is donated to every step and replaced by the returned one.

Steps are dispatched asynchronously (`dispatch` returns before the device finishes) and
their sampled tokens stay on device: the next step reads its decode tokens from
the previous step's output (`StepBatch.prev_index`), so the host can plan and launch
step n+1 before it has read step n's tokens (`fetch`). Source: vLLM v1's async
scheduling; JetStream's overlapped generate loop.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.worker.input_batch import empty_batch
from jaxserve.worker.compilation import StepShapes
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.params import Params
from jaxserve.model.transformer import (Kernels, StepBatch, compute_logits, forward,
                                        last_token_logits, next_decode_batch, pin_lm_head)
from jaxserve.sample.logits_processors import (LogitsControls, apply_controls, controls_active,
                                               history, write_token_pool)
from jaxserve.sample.sampler import (PROMPT_LOGPROBS_BLOCK, SamplingBatch, sample_controlled,
                                     token_logprobs, top_logprobs)
from jaxserve.distributed.sharding import ShardingRules, constrain
from jaxserve.spec_decode import draft_model
from jaxserve.spec_decode.draft_model import Drafter
from jaxserve.sample.rejection_sampler import rejection_sample

log = logging.getLogger(__name__)


def _top(logits: jax.Array, sampling: SamplingBatch, num_top: int, impl) -> dict:
    """{"top_ids": [R, num_top] int32, "top_logprobs": [R, num_top] f32} of logits [R, V]
    (jaxserve.sample.sampler.top_logprobs), computed only when a row asks for any (zeros
    otherwise); {} when the engine reports none (num_top 0)."""
    if not num_top or sampling.num_logprobs is None:
        return {}
    R = logits.shape[0]
    ids, lps = jax.lax.cond(
        jnp.any(sampling.num_logprobs > 0), lambda: top_logprobs(logits, num_top, impl),
        lambda: (jnp.zeros((R, num_top), jnp.int32), jnp.zeros((R, num_top), jnp.float32)))
    return {"top_ids": ids, "top_logprobs": lps}


def _prompt_logprobs(params: Params, hidden: jax.Array, targets: jax.Array, *,
                     rules: ShardingRules | None, kernels: Kernels, num_top: int) -> dict:
    """Prompt logprobs of a mixed step, computed only when a row asks (zeros otherwise).
    hidden: [T, D]; targets: [T] int32, the token after each row whose logprob is asked
    (-1: none). Returns {"prompt_logprobs": [T] f32, and with num_top "prompt_top_ids"
    [T, num_top] int32, "prompt_top_logprobs" [T, num_top] f32}. The LM head runs in a
    `lax.map` over blocks of PROMPT_LOGPROBS_BLOCK rows, so that one block's [rows, vocab]
    logits are live at a time (unrolled blocks kept them all: 86 MiB of a 256-row step
    against 26 MiB); inside the loop the LM head weights are pinned to their shardings."""
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

    shapes = jax.eval_shape(compute)
    return jax.lax.cond(jnp.any(targets >= 0), compute,
                        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes))


def _sample_step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
                 draft_params, draft_cache, token_pool, *, cfg: ModelConfig,
                 drafter: Drafter | None, rules: ShardingRules | None, kernels: Kernels,
                 num_top: int):
    """forward -> each sequence's last-token logits -> controls (logit bias, penalties) ->
    sample: (tokens [S] int32, logprobs [S] f32, extra, cache, draft_cache, token_pool).
    extra: `_top` of the sampled rows, and in a mixed step `_prompt_logprobs`. The
    batch's tokens are written to the token pool first (the penalties' history). A
    drafter (speculative decoding) runs over the same rows, so that its K/V keep up with
    the target's."""
    token_pool = write_token_pool(token_pool, batch.slot_mapping, batch.tokens)
    hidden, cache = forward(params, cache, batch, cfg, rules, kernels)
    if drafter is not None:
        draft_cache = drafter.sync(params, draft_params, draft_cache, batch, hidden, rules,
                                   kernels)
    logits = last_token_logits(params, hidden, batch.logits_indices, rules, kernels.matmul)

    def context():
        return (history(token_pool, batch.block_tables, cache.page_size),
                batch.positions[batch.logits_indices] + 1)

    tokens, logprobs = sample_controlled(logits, sampling, kernels.sampling, context)
    extra = _top(logits, sampling, num_top, kernels.sampling)
    if sampling.prompt_targets is not None:
        extra.update(_prompt_logprobs(params, hidden, sampling.prompt_targets, rules=rules,
                                      kernels=kernels, num_top=num_top))
    return tokens, logprobs, extra, cache, draft_cache, token_pool


def _step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
          prev_tokens: jax.Array, draft_params, draft_cache, token_pool, *, cfg: ModelConfig,
          drafter: Drafter | None, rules: ShardingRules | None, kernels: Kernels,
          num_top: int = 0, num_steps: int = 1):
    """One engine step: `num_steps` tokens per sequence. prev_tokens: [max_rows] int32, the
    previous step's last sampled tokens; draft_params / draft_cache: the drafter's arrays
    (speculative decoding with a draft model or head; None without one), its cache donated
    like the target's; token_pool: [num_pages * page_size] int32, every sequence's tokens
    at their KV slots (donated; jaxserve.sample.logits_processors).

    num_steps > 1 (decode batches only): multi-step decode, a `fori_loop` in which each
    iteration samples one token per sequence and feeds it back as the next iteration's
    input (positions, slots and lengths advanced on device; the block tables must already
    hold the pages of every position written). Sub-step i samples with `sampling.step + i`,
    so the tokens are those of num_steps single steps. Source: vLLM's multi-step
    scheduling (num_scheduler_steps).

    Returns (last [max_rows] int32: the last sub-step's tokens padded with 0, tokens
    [num_steps, S] int32, logprobs [num_steps, S] f32, extra (`_sample_step`'s, the top
    logprobs with a leading [num_steps] axis), cache, draft_cache, token_pool)."""
    S = batch.seq_lens.shape[0]
    from_prev = prev_tokens[jnp.maximum(batch.prev_index, 0)]
    batch = dataclasses.replace(
        batch, tokens=jnp.where(batch.prev_index >= 0, from_prev, batch.tokens))
    run = functools.partial(_sample_step, params, cfg=cfg, drafter=drafter, rules=rules,
                            kernels=kernels, num_top=num_top)
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
    last = jnp.zeros(prev_tokens.shape, jnp.int32).at[:S].set(tokens[-1])
    return last, tokens, logprobs, extra, cache, draft_cache, token_pool


def _verify_step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch,
                 draft_params, draft_cache, token_pool, *, cfg: ModelConfig,
                 drafter: Drafter | None, rules: ShardingRules | None, kernels: Kernels,
                 num_top: int = 0):
    """A verify step (speculative decoding): forward over each sequence's last token and
    its drafts (the tokens after its first row), logits at every one of its rows
    (batch.logits_indices [S, J], J = 1 + num_speculative_tokens), the rows' logits
    controls (jaxserve.sample.logits_processors, each position with the drafts before it in its
    history), rejection sampling (jaxserve.sample.rejection_sampler). With a drafter
    (a draft model or head) the drafts are proposed here first
    (jaxserve.spec_decode.draft_model.propose; the batch's draft rows are placeholders),
    and the drafter runs over the verify rows too. Returns (tokens [J, S] int32, logprobs
    [J, S] f32 (of the raw logits), num_tokens [S] int32: output tokens kept per sequence,
    extra: the top logprobs [J, S, num_top] as `_top`, cache, draft_cache, token_pool)."""
    S, J = batch.logits_indices.shape
    start = batch.query_start[:-1]
    num_drafts = jnp.clip(batch.query_start[1:] - start - 1, 0, J - 1)
    draft_logits = None
    if drafter is not None:
        drafts, draft_logits, draft_cache = draft_model.propose(
            drafter, params, draft_params, draft_cache, batch, sampling, num_drafts, J - 1,
            cache.page_size, cfg.vocab_size, rules, kernels)
        batch = draft_model.fill_drafts(batch, drafts, num_drafts)
    token_pool = write_token_pool(token_pool, batch.slot_mapping, batch.tokens)
    hidden, cache = forward(params, cache, batch, cfg, rules, kernels)
    if drafter is not None:
        draft_cache = drafter.sync(params, draft_params, draft_cache, batch, hidden, rules,
                                   kernels)
    logits = last_token_logits(params, hidden, batch.logits_indices.reshape(-1), rules,
                               kernels.matmul)                            # [S * J, V]
    rows = jnp.clip(start[:, None] + 1 + jnp.arange(J - 1)[None, :], 0,
                    batch.tokens.shape[0] - 1)
    verify = functools.partial(rejection_sample, draft_ids=batch.tokens[rows],
                               num_drafts=num_drafts, sb=sampling, draft_logits=draft_logits,
                               impl=kernels.sampling)

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
        tokens, logprobs, num = jax.lax.cond(controls_active(sampling.controls), controlled,
                                             plain)
    extra = _top(logits, dataclasses.replace(
        sampling, num_logprobs=None if sampling.num_logprobs is None
        else jnp.repeat(sampling.num_logprobs, J)), num_top, kernels.sampling)
    extra = {k: v.reshape(S, J, -1).transpose(1, 0, 2) for k, v in extra.items()}
    return tokens.T, logprobs.T, num, extra, cache, draft_cache, token_pool


class StepKey(NamedTuple):
    """A compiled step shape: kind "mixed", "decode" or "verify", T token rows, S
    sequences, P block-table pages per sequence, n tokens sampled per sequence (multi-step
    decode; a verify step: the positions each sequence samples at, 1 + its drafts)."""

    kind: str
    T: int
    S: int
    P: int
    n: int = 1

    @classmethod
    def of(cls, batch: StepBatch, num_steps: int = 1) -> "StepKey":
        if batch.logits_indices.ndim == 2:
            return cls("verify", batch.tokens.shape[0], *batch.block_tables.shape,
                       batch.logits_indices.shape[1])
        return cls("decode" if batch.decode else "mixed", batch.tokens.shape[0],
                   *batch.block_tables.shape, num_steps)


def _abstract_inputs(key: StepKey, sharding, max_logit_bias: int, vocab_size: int
                     ) -> tuple[StepBatch, SamplingBatch]:
    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    i32, f32 = jnp.int32, jnp.float32
    T, S, P = key.T, key.S, key.P
    batch = StepBatch(tokens=s((T,), i32), positions=s((T,), i32),
                      slot_mapping=s((T,), i32), block_tables=s((S, P), i32),
                      seq_lens=s((S,), i32), query_start=s((S + 1,), i32),
                      logits_indices=s((S, key.n) if key.kind == "verify" else (S,), i32),
                      prev_index=s((T,), i32),
                      decode=key.kind == "decode")
    controls = jax.tree.map(lambda a: s(a.shape, a.dtype),
                            LogitsControls.neutral(S, max_logit_bias, vocab_size))
    sampling = SamplingBatch(temperature=s((S,), f32), top_k=s((S,), i32), top_p=s((S,), f32),
                             min_p=s((S,), f32), seed=s((S, 2), jnp.uint32), step=s((S,), i32),
                             num_logprobs=s((S,), i32), controls=controls,
                             prompt_targets=s((T,), i32) if key.kind == "mixed" else None)
    return batch, sampling


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Runner:
    """Params + KV pool on device, and one compiled step per bucketed shape."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, params: Params,
                 cache: KVCache, kernels: Kernels, rules: ShardingRules | None = None,
                 draft: tuple[Drafter, object, object] | None = None):
        """draft: (drafter, its params, its cache) for speculative decoding with a draft
        model or head (jaxserve.spec_decode.draft_model): its KV pool has the target's
        pages and page size."""
        self.model_cfg = model_cfg
        self.engine_cfg = engine_cfg
        self.params = params
        self.cache = cache
        self.drafter, self.draft_params, self.draft_cache = draft or (None, None, None)
        self.rules = rules
        self._replicated = NamedSharding(rules.mesh, PartitionSpec()) if rules else None
        self.kernels = kernels  # resolved: jaxserve.worker.kernel_selection.select_kernels
        self.shapes = StepShapes(engine_cfg, bucket_pages=kernels.attention.pads_pages)
        self.num_top = engine_cfg.sampler.max_logprobs
        self.max_logit_bias = engine_cfg.sampler.max_logit_bias
        static = dict(cfg=model_cfg, drafter=self.drafter, rules=rules, kernels=self.kernels,
                      num_top=self.num_top)
        self._jitted = jax.jit(functools.partial(_step, **static), donate_argnums=(1, 6, 7),
                               static_argnames=("num_steps",))
        self._jitted_verify = jax.jit(functools.partial(_verify_step, **static),
                                      donate_argnums=(1, 5, 6))
        self._compiled: dict[StepKey, object] = {}
        self._futures: dict[StepKey, Future] = {}
        self._lock = threading.Lock()           # compiled shapes, futures, counters
        self._dispatch_lock = threading.Lock()  # the KV pool: one step launched at a time
        self._pending_warmup = 0
        self._warmup_stop = threading.Event()
        self._warmup_thread: threading.Thread | None = None
        self.num_compilations = 0
        self.compile_seconds = 0.0
        # The last dispatched step's sampled tokens, on device, padded to max_rows.
        self.max_rows = max(self.shapes.seq_buckets)
        self.last_tokens = jnp.zeros((self.max_rows,), jnp.int32, device=self._replicated)
        # every sequence's tokens at their KV slots (jaxserve.sample.logits_processors)
        self.token_pool = self._zero_token_pool()
        # device-resident inputs of steps whose rows use no logits controls / ask no prompt
        # logprobs, by S / T (nothing to transfer for them)
        self._neutral: dict[tuple, object] = {}
        # multi-process (jaxserve.distributed.multiprocess): process 0's channel to the others, which
        # launch every step it launches (Runner.follow); None in one process
        self.mirror = None
        # to make the pools again (reset_cache)
        self._cache_spec = _abstract(cache)
        self._draft_cache_spec = _abstract(self.draft_cache)

    def _zero_token_pool(self):
        return jnp.zeros((self.cache.num_pages * self.cache.page_size,), jnp.int32,
                         device=self._replicated)

    def _complete(self, key: StepKey, sampling: SamplingBatch) -> SamplingBatch:
        """`sampling` with its optional inputs the compiled step takes filled in: neutral
        logits controls and no prompt-logprob targets (cached device arrays), num_logprobs
        0; prompt_targets dropped from a step that is not mixed."""
        def cached(name, size, make):
            value = self._neutral.get((name, size))
            if value is None:
                value = self._neutral[(name, size)] = jax.device_put(make(), self._replicated)
            return value

        S, T = key.S, key.T
        fill = {}
        if sampling.num_logprobs is None:
            fill["num_logprobs"] = cached("num_logprobs", S, lambda: np.zeros(S, np.int32))
        if sampling.controls is None:
            fill["controls"] = cached("controls", S,
                                      lambda: LogitsControls.neutral(
                                          S, self.max_logit_bias, self.model_cfg.vocab_size))
        if key.kind != "mixed":
            fill["prompt_targets"] = None
        elif sampling.prompt_targets is None:
            fill["prompt_targets"] = cached("prompt_targets", T,
                                            lambda: np.full(T, -1, np.int32))
        return dataclasses.replace(sampling, **fill) if fill else sampling

    def _compile(self, key: StepKey):
        t0 = time.perf_counter()
        batch, sampling = _abstract_inputs(key, self._replicated, self.max_logit_bias,
                                           self.model_cfg.vocab_size)
        params, cache = _abstract(self.params), _abstract(self.cache)
        draft = _abstract(self.draft_params), self._draft_cache_spec
        pool = _abstract(self.token_pool)
        if key.kind == "verify":
            traced = self._jitted_verify.trace(params, cache, batch, sampling, *draft, pool)
        else:
            traced = self._jitted.trace(params, cache, batch, sampling,
                                        _abstract(self.last_tokens), *draft, pool,
                                        num_steps=key.n)
        exe = traced.lower().compile()
        return exe, time.perf_counter() - t0

    def _executable(self, key: StepKey):
        exe = self._compiled.get(key)
        if exe is None:
            exe = self._get_or_compile(key, on_demand=True)
        return exe

    def _get_or_compile(self, key: StepKey, on_demand: bool = False):
        """The executable for `key`, compiling it unless it is compiled or being compiled
        (then wait for that compilation: a shape is never compiled twice). A warm-up
        compile (not on_demand) also runs the step once on an all-padding batch: an
        executable's first run costs ~0.3 s more than later ones on XLA:CPU."""
        with self._lock:
            future = self._futures.get(key)
            owner = future is None
            if owner:
                future = self._futures[key] = Future()
        if not owner:
            return future.result()
        if on_demand:
            log.warning("compiling step for unwarmed shape %s T=%d S=%d P=%d n=%d", *key)
        try:
            exe, dt = self._compile(key)
            if not on_demand:
                self._first_run(key, exe)
        except BaseException as e:
            with self._lock:
                del self._futures[key]
            future.set_exception(e)  # waiters raise it too; a later call tries again
            raise
        self._add(key, exe, dt)
        future.set_result(exe)
        return exe

    def _first_run(self, key: StepKey, exe) -> None:
        """Run `exe` once on an all-padding batch and wait for it (every write goes to the
        null page; the sampled tokens are dropped, `last_tokens` is kept for the engine's
        next step)."""
        batch = empty_batch(key.T, key.S, key.P, decode=key.kind == "decode",
                            verify=key.n if key.kind == "verify" else 0)
        sampling = SamplingBatch.from_params([], [], [], key.S)
        handle = self._call(exe, key, batch, sampling, keep_last=True)
        # wait for it here (not holding the lock): warm-up steps never pile up on the device
        # ahead of the engine's own
        handle.tokens.block_until_ready()

    def _call(self, exe, key: StepKey, batch: StepBatch, sampling: SamplingBatch,
              keep_last: bool = False) -> "StepHandle":
        """Run `exe` on the pools (donated, replaced by its outputs) and return its handle;
        a non-verify step also replaces `last_tokens` unless `keep_last`."""
        with self._dispatch_lock:
            if self.mirror is not None:  # the other processes launch the same step (each
                # fills in the inputs left None from its own device-resident defaults)
                self.mirror.send(("call", key, jax.tree.map(np.asarray, batch),
                                  jax.tree.map(np.asarray, sampling), keep_last))
            sampling = self._complete(key, sampling)
            if key.kind == "verify":
                tokens, logprobs, num, extra, self.cache, self.draft_cache, self.token_pool = exe(
                    self.params, self.cache, batch, sampling, self.draft_params,
                    self.draft_cache, self.token_pool)
                return StepHandle(tokens, logprobs, num, extra)
            last, tokens, logprobs, extra, self.cache, self.draft_cache, self.token_pool = exe(
                self.params, self.cache, batch, sampling, self.last_tokens, self.draft_params,
                self.draft_cache, self.token_pool)
            if not keep_last:
                self.last_tokens = last
        return StepHandle(tokens, logprobs, None, extra)

    def _add(self, key, exe, dt):
        with self._lock:
            self._compiled[key] = exe
            self.num_compilations += 1
            self.compile_seconds += dt

    def _warmup_keys(self, shapes) -> list[StepKey]:
        """Shapes to compile, most likely first: one-sequence shapes by page count (the
        first two: the shortest decode and prefill, what a first short request needs;
        multi-step decode after the single steps of the same page count), then the rest
        by size."""
        shapes = shapes if shapes is not None else self.shapes.warmup()
        keys = {StepKey(*shape) for shape in shapes} - set(self._compiled)
        return sorted(keys, key=lambda k: (False, k.P, k.n, k.T, k.kind) if k.S == 1 else
                      (True, k.T * k.P, k.S, k.n, k.kind))

    def warmup(self, shapes: list[tuple] | None = None, threads: int = 2) -> None:
        """Compile the step for every bucketed shape and wait (XLA compiles release the
        GIL, so `threads` compile side by side)."""
        todo = self._warmup_keys(shapes)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(self._get_or_compile, todo))
        log.info("warm-up: %d step shapes compiled in %.1f s", len(todo), time.perf_counter() - t0)

    def warmup_in_background(self, shapes: list[tuple] | None = None,
                             first: int = 2) -> None:
        """Compile the `first` most likely shapes now, the rest on a background thread:
        the engine serves meanwhile (a step whose shape is not compiled yet compiles it
        at once, or waits for the background compilation of it). `warmup_pending` counts
        the shapes still to compile. With the persistent compilation cache on disk this
        is what brings a restart to its first token in seconds."""
        todo = self._warmup_keys(shapes)
        for key in todo[:first]:
            self._get_or_compile(key)
        rest = todo[first:]
        self._pending_warmup = len(rest)

        def run():
            t0 = time.perf_counter()
            for key in rest:
                if self._warmup_stop.is_set():
                    break
                try:
                    self._get_or_compile(key)
                except Exception:  # noqa: BLE001 - a later on-demand compile raises it again
                    log.exception("background warm-up of shape %s failed", key)
                with self._lock:
                    self._pending_warmup -= 1
            log.info("background warm-up: %d step shapes compiled in %.1f s",
                     len(rest) - self._pending_warmup, time.perf_counter() - t0)

        self._warmup_thread = threading.Thread(target=run, name="jaxserve-warmup", daemon=True)
        self._warmup_thread.start()

    def stop_warmup(self) -> None:
        """Stop a background warm-up after the shape it is compiling and wait for it (a
        thread still inside XLA when the interpreter exits aborts the process)."""
        self._warmup_stop.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join()

    @property
    def warmup_pending(self) -> int:
        """Shapes the background warm-up has still to compile (0 when none runs)."""
        return self._pending_warmup

    def dispatch(self, batch: StepBatch, sampling: SamplingBatch,
                 num_steps: int = 1) -> "StepHandle":
        """Launch one step without waiting for it (host numpy arrays in; batch.prev_index
        None = all tokens from the host). num_steps > 1: multi-step decode (see `_step`;
        the block tables must hold the pages of all num_steps new tokens). Returns a handle
        for `fetch`; the KV pool and `last_tokens` are replaced by the step's (future)
        outputs at once. A verify batch (logits_indices [S, J]: speculative decoding) runs
        the verify step (`_verify_step`) and leaves `last_tokens` as it was: the engine
        reads its tokens before it plans the next step."""
        if batch.prev_index is None:
            batch = dataclasses.replace(
                batch, prev_index=np.full(batch.tokens.shape, -1, np.int32))
        key = StepKey.of(batch, num_steps)
        return self._call(self._executable(key), key, batch, sampling)

    def reset_cache(self) -> None:
        """Replace the KV pool (and a draft model's) and `last_tokens` by fresh zeroed arrays
        of the same shapes, dtypes and shardings: after a failed step, whose donated pools
        may be deleted or hold an error. The old pool is dropped first, so peak memory
        stays one pool.
        Raises whatever the allocation raises (then the engine is dead)."""
        def zeros(spec):
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), spec)

        with self._dispatch_lock:
            if self.mirror is not None:
                self.mirror.send(("reset",))
            self.cache = self.last_tokens = self.draft_cache = self.token_pool = None
            self.cache = zeros(self._cache_spec)
            self.draft_cache = zeros(self._draft_cache_spec)
            self.last_tokens = jnp.zeros((self.max_rows,), jnp.int32, device=self._replicated)
            self.token_pool = self._zero_token_pool()

    def follow(self, channel) -> None:
        """A follower process of a multi-process deployment: launch every step process 0
        launches, in its order, on this process's devices, until it says stop (returns)
        or is gone (jaxserve.distributed.multiprocess.DistributedError). Shapes compile on first use
        here (process 0's warm-up runs reach this process as steps too); each step is
        waited for before the next is read, so nothing piles up."""
        while True:
            record = channel.recv()
            if record[0] == "stop":
                return
            if record[0] == "reset":
                self.reset_cache()
                continue
            _, key, batch, sampling, keep_last = record
            exe = self._compiled.get(key)
            if exe is None:
                exe, dt = self._compile(key)
                self._add(key, exe, dt)
            self._call(exe, key, batch, sampling, keep_last).tokens.block_until_ready()

    @staticmethod
    def fetch(handle: "StepHandle", logprobs: bool = False) -> "StepOutput":
        """Wait for a dispatched step: its sampled tokens [n, S] int32 and their logprobs
        [n, S] f32 (column b: sequence b of the batch, padding included; n: num_steps, or
        J for a verify step), and for a verify step num_tokens [S] int32, the tokens of
        column b that count (the rest were rejected). logprobs: also read its top and
        prompt logprobs (`StepOutput.extra`; else {})."""
        num = None if handle.num_tokens is None else np.asarray(handle.num_tokens)
        extra = ({k: np.asarray(v) for k, v in handle.extra.items()} if logprobs else {})
        return StepOutput(np.asarray(handle.tokens), np.asarray(handle.logprobs), num, extra)

    def run(self, batch: StepBatch, sampling: SamplingBatch,
            num_steps: int = 1, logprobs: bool = False) -> "StepOutput":
        """Run one step and wait: `fetch`'s output."""
        return self.fetch(self.dispatch(batch, sampling, num_steps), logprobs)


@dataclasses.dataclass(frozen=True)
class StepHandle:
    """A dispatched step's outputs, still on device: tokens [n, S] int32, logprobs [n, S]
    f32 (S: the batch's sequence bucket), for a verify step num_tokens [S] int32, and
    extra: top_ids / top_logprobs [n, S, max_logprobs] (with max_logprobs > 0) and, for a
    mixed step, prompt_logprobs [T] (and prompt_top_ids / prompt_top_logprobs [T,
    max_logprobs]): zeros unless a row asked."""

    tokens: jax.Array
    logprobs: jax.Array
    num_tokens: jax.Array | None = None
    extra: dict = dataclasses.field(default_factory=dict)


class StepOutput(NamedTuple):
    """A finished step's outputs on the host (see `Runner.fetch`)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    num_tokens: np.ndarray | None = None
    extra: dict = {}
