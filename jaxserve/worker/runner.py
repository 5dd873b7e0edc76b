"""Device side of the engine: holds the params and the KV pool, runs the jitted step.

The step (forward -> last-token logits -> sample) is compiled ahead of time once per
bucketed shape (kind, T, S, P, n: jaxserve.worker.compilation.StepShapes): "mixed" or
"decode", T token rows, S sequences, P block-table pages; with host branches
(Kernels.host_branches, GPUs' default) a program that samples once per sampler plan too
(jaxserve.sample.plan: `_plans`), each step running its batch's (`_planned`). The
executables are kept here, so a shape outside the buckets is a visible compilation
(`num_compilations`), never a silent retrace; they come through jitted functions shared
with every engine of the same static configuration in the process
(jaxserve.worker.shared_jit), so an engine built again compiles nothing. The KV pool is
donated to every step and replaced by the returned one. A one-token step is two
executables, the forward (`dispatch_forward`: the logits of the sampled rows stay on
device) and the sampler (`dispatch_sample`, one per sequence bucket), so that what the
sampler needs from the host (a grammar's bitmask) can be given after the forward is
launched; multi-step decode and verify steps are one executable.

Steps are dispatched asynchronously (`dispatch` returns before the device finishes) and
their sampled tokens stay on device: the next step reads its decode tokens from
the previous step's output (`dispatch`'s prev_index), so the host can plan and launch
step n+1 before it has read step n's tokens (`fetch`). Source: vLLM v1's async
scheduling; JetStream's overlapped generate loop.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.worker.executable_cache import ExecutableCache
from jaxserve.worker.input_batch import empty_batch
from jaxserve.worker.shared_jit import shared_jit
from jaxserve.worker.compilation import (StepKey, StepShapes, abstract_inputs,
                                         abstract_sample_inputs, warmup_order)
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.lora import adapter_arrays, lora_pools, slot_writer, with_pools
from jaxserve.model.params import Params
from jaxserve.model.inputs import StepBatch
from jaxserve.model.transformer import Kernels, logits_sharding
from jaxserve.sample.logits_processors import LogitsControls
from jaxserve.sample.plan import FUSED_PLANS, ON_DEVICE, SamplerPlan, plan_of, sampler_plans
from jaxserve.sample.sampler import SamplingBatch
from jaxserve.distributed.sharding import ShardingRules
from jaxserve.spec_decode.draft_model import Drafter
from jaxserve.worker.step import (forward_step, model_step, prompt_logprobs_step, sample_step,
                                  verify_step)

log = logging.getLogger(__name__)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Runner:
    """Params + KV pool on device, and one compiled step per bucketed shape."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, params: Params,
                 cache: KVCache, kernels: Kernels, rules: ShardingRules | None = None,
                 draft: tuple[Drafter, object, object] | None = None,
                 executable_cache: ExecutableCache | None = None):
        """draft: (drafter, its params, its cache) for speculative decoding with a draft
        model or head (jaxserve.spec_decode.draft_model): its KV pool has the target's
        pages and page size. executable_cache: where the step programs are compiled
        through (read back when kept; jaxserve.worker.executable_cache), for a process
        JAX's persistent compilation cache does not serve (a multi-process follower);
        None: compiled by JAX (its persistent cache, when on)."""
        self.model_cfg = model_cfg
        self.engine_cfg = engine_cfg
        self.executable_cache = executable_cache
        self._compiler_options = dict(engine_cfg.compilation.xla_compiler_options) or None
        if self._compiler_options:  # a name XLA does not know: refused now, not at a step
            self._compile_lowered(jax.jit(lambda: jnp.zeros(())).lower())
        self.params = params
        self.cache = cache
        self.drafter, self.draft_params, self.draft_cache = draft or (None, None, None)
        self.rules = rules
        self._replicated = NamedSharding(rules.mesh, PartitionSpec()) if rules else None
        self.kernels = kernels  # resolved: jaxserve.worker.kernel_selection.select_kernels
        self.shapes = StepShapes(engine_cfg, bucket_pages=kernels.attention.pads_pages)
        self.num_top = engine_cfg.sampler.max_logprobs
        # one-token decode steps without a grammar run forward and sampler in one program
        # (CompilationConfig.fused_decode; None, unresolved: off)
        self.fused_decode = bool(engine_cfg.compilation.fused_decode)
        self.max_logit_bias = engine_cfg.sampler.max_logit_bias
        static = dict(cfg=model_cfg, drafter=self.drafter, rules=rules, kernels=self.kernels,
                      num_top=self.num_top)
        self._jitted = shared_jit(model_step, (1, 7, 8), ("num_steps", "plan"), **static)
        spec = engine_cfg.speculative
        ngram = ((spec.prompt_lookup_min, spec.prompt_lookup_max)
                 if spec is not None and spec.method == "ngram" else None)
        confidence = spec.draft_confidence_threshold if spec is not None else 0.0
        self._jitted_verify = shared_jit(verify_step, (1, 8, 9), ("rounds", "plan"),
                                         ngram=ngram, draft_confidence=confidence, **static)
        self._jitted_forward = shared_jit(forward_step, (1, 7, 8), ("keep_hidden",), **static,
                                          pooling=engine_cfg.pooling)
        self._jitted_prompt = shared_jit(prompt_logprobs_step, (), (), rules=rules,
                                         kernels=self.kernels, num_top=self.num_top)
        self.max_pages = engine_cfg.max_pages_per_seq
        self._logits_sharding = (logits_sharding(params, rules, model_cfg.vocab_size)
                                 or self._replicated)
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
        self._jitted_sample = shared_jit(sample_step, (2,), ("plan",),
                                         page_size=cache.page_size, max_rows=self.max_rows,
                                         rules=rules, kernels=self.kernels, num_top=self.num_top)
        # a follower's (Runner.follow) forward half whose sampler half has not come yet
        self._follow_forward: ForwardHandle | None = None
        self._following = False  # this process follows another's steps (Runner.follow)
        self.last_tokens = jnp.zeros((self.max_rows,), jnp.int32, device=self._replicated)
        # after a verify step, each sequence's kept tokens - 1 (zeros after other steps):
        # how far a verify step planned before it was read moves its rows (verify_step)
        self.last_shift = self._no_shift = jnp.zeros((self.max_rows,), jnp.int32,
                                                     device=self._replicated)
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
        # LoRA (enable_lora): the one program writing an adapter slot, compiled now by
        # clearing slot 0 (which stays zeros), so that no load ever compiles
        pools = lora_pools(params)
        self._write_lora = None if pools is None else slot_writer(pools)
        if self._write_lora is not None:
            self._apply_lora(0, None)

    def write_lora(self, slot: int, adapter) -> None:
        """Write LoRA adapter `adapter` (a jaxserve.lora.LoraAdapter; None: clear) into
        slot `slot` of every pool in the params (jaxserve.model.lora): steps dispatched
        after this use it. Raises ValueError without LoRA pools or for an adapter the
        pools cannot hold."""
        if self._write_lora is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora is off)")
        with self._dispatch_lock:
            if self.mirror is not None:
                self.mirror.send(("lora", slot, adapter))
            self._apply_lora(slot, adapter)

    def _apply_lora(self, slot: int, adapter) -> None:
        arrays = adapter_arrays(adapter, self.model_cfg, self.engine_cfg.lora)
        pools = self._write_lora(lora_pools(self.params), np.int32(slot), arrays)
        self.params = with_pools(self.params, pools)

    def _zero_token_pool(self):
        return jnp.zeros((self.cache.num_pages * self.cache.page_size,), jnp.int32,
                         device=self._replicated)

    def _cached(self, name: str, size: int, make):
        """A device-resident neutral input (`make()`'s arrays, replicated), made once."""
        value = self._neutral.get((name, size))
        if value is None:
            value = self._neutral[(name, size)] = jax.device_put(make(), self._replicated)
        return value

    def _complete(self, key: StepKey, sampling: SamplingBatch) -> SamplingBatch:
        """`sampling` with its optional inputs the compiled step takes filled in: neutral
        logits controls and no prompt-logprob targets (cached device arrays), num_logprobs
        0; prompt_targets dropped from a step that is not mixed."""
        cached = self._cached
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
        pool = _abstract(self.token_pool)
        if key.kind == "sample":
            inputs = abstract_sample_inputs(key.S, self.max_pages, self._replicated,
                                            self._logits_sharding, self.max_logit_bias,
                                            self.model_cfg.vocab_size)
            logits, sampling, block_tables, num_context = inputs
            traced = self._jitted_sample.trace(logits, sampling, pool, block_tables,
                                               num_context, plan=key.plan)
            return self._compile_lowered(traced.lower()), time.perf_counter() - t0
        if key.kind == "prompt_logprobs":
            hidden = jax.ShapeDtypeStruct((key.T, self.model_cfg.hidden_size),
                                          jnp.dtype(self.model_cfg.dtype),
                                          sharding=self._replicated)
            targets = jax.ShapeDtypeStruct((key.T,), jnp.int32, sharding=self._replicated)
            traced = self._jitted_prompt.trace(_abstract(self.params), hidden, targets)
            return self._compile_lowered(traced.lower()), time.perf_counter() - t0
        batch, sampling, prev_index = abstract_inputs(key, self._replicated, self.max_logit_bias,
                                                      self.model_cfg.vocab_size, self.shapes.lora)
        params, cache = _abstract(self.params), _abstract(self.cache)
        draft = _abstract(self.draft_params), self._draft_cache_spec
        last = _abstract(self.last_tokens)
        if key.kind == "verify":
            traced = self._jitted_verify.trace(params, cache, batch, sampling, last, last,
                                               prev_index, *draft, pool, rounds=key.rounds,
                                               plan=key.plan)
        elif key.split:
            own = self._own_prompt_logprobs(key)  # then no conditional for them here
            traced = self._jitted_forward.trace(params, cache, batch,
                                                None if own else sampling.prompt_targets,
                                                last, prev_index, *draft, pool,
                                                keep_hidden=own)
        else:
            traced = self._jitted.trace(params, cache, batch, sampling, last, prev_index,
                                        *draft, pool, num_steps=key.n, plan=key.plan)
        return self._compile_lowered(traced.lower()), time.perf_counter() - t0

    def _compile_lowered(self, lowered):
        """`lowered` compiled with CompilationConfig.xla_compiler_options, through the
        executable cache when there is one. Raises ConfigError when XLA does not take one
        of the options (an unknown name, a value it refuses)."""
        if self.executable_cache is not None:
            return self.executable_cache.compile(lowered, self._compile_now,
                                                 self._compiler_options)
        return self._compile_now(lowered)

    def _compile_now(self, lowered):
        try:
            return lowered.compile(compiler_options=self._compiler_options)
        except jax.errors.JaxRuntimeError as e:  # an unknown name, or a value it refuses
            if "No such compile option" not in str(e) and "While setting option" not in str(e):
                raise
            raise ConfigError(f"CompilationConfig.xla_compiler_options: {e}") from None

    def _executable(self, key: StepKey):
        exe = self._compiled.get(key)
        if exe is None:
            exe = self._get_or_compile(key, on_demand=True)
        return exe

    def _get_or_compile(self, key: StepKey, on_demand: bool = False):
        """The executable for `key`, compiling it unless it is compiled or being compiled
        (then wait for that compilation: a shape is never compiled twice). A warm-up
        compile (not on_demand) also runs the step once on an all-padding batch: an
        executable's first run costs more than later ones on XLA:CPU (PERFORMANCE.md,
        "Measurements behind the code"), which a request should not pay."""
        with self._lock:
            future = self._futures.get(key)
            owner = future is None
            if owner:
                future = self._futures[key] = Future()
        if not owner:
            return future.result()
        if on_demand:
            log.warning("compiling step for unwarmed shape %s T=%d S=%d P=%d n=%d rounds=%d "
                        "plan=%s whole=%s", *key)
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
        if key.kind == "prompt_logprobs":  # run by its mixed steps' warm-up runs (below)
            return
        sampling = SamplingBatch.from_params([], [], [], key.S)
        if self._own_prompt_logprobs(key):  # targets (none asked), so that it runs too
            sampling = dataclasses.replace(sampling,
                                           prompt_targets=np.full(key.T, -1, np.int32))
        if key.kind == "sample":
            out = self._run_sample(exe, key, self._warmup_forward(key.S), sampling,
                                   keep_last=True).tokens
        else:
            batch = empty_batch(key.T, key.S, key.P, decode=key.kind == "decode",
                                verify=key.n if key.kind == "verify" else 0,
                                lora=self.shapes.lora)
            prev_index = np.full((key.T,), -1, np.int32)
            if key.split:
                out = self._run_forward(exe, key, batch, sampling, prev_index,
                                        warmup=True).logits
            else:
                out = self._call(exe, key, batch, sampling, prev_index, keep_last=True).tokens
        # wait for it here (not holding the lock): warm-up steps never pile up on the device
        # ahead of the engine's own
        out.block_until_ready()

    def _warmup_forward(self, S: int) -> "ForwardHandle":
        """A stand-in forward of S sequences for a warm-up run of a sampler program: zero
        logits on the host, placed by the call (a device_put to a mesh over several
        processes would wait for the others to check they are equal)."""
        return ForwardHandle(StepKey("sample", 0, S, 0, 1),
                             np.zeros((S, self.model_cfg.vocab_size), np.float32), {},
                             np.zeros((S, self.max_pages), np.int32), np.zeros((S,), np.int32),
                             warmup=True)

    def _call(self, exe, key: StepKey, batch: StepBatch, sampling: SamplingBatch,
              prev_index: np.ndarray, keep_last: bool = False) -> "StepHandle":
        """Run the whole-step `exe` (a multi-step decode, a verify step, or a whole
        one-token decode step: `_whole_decode`) on the pools
        (donated, replaced by its outputs) and return its handle; it also replaces
        `last_tokens` and `last_shift` unless `keep_last`."""
        with self._dispatch_lock:
            if self.mirror is not None:  # the other processes launch the same step (each
                # fills in the inputs left None from its own device-resident defaults)
                self.mirror.send(("call", key, jax.tree.map(np.asarray, batch),
                                  jax.tree.map(np.asarray, sampling), prev_index, keep_last))
            sampling = self._complete(key, sampling)
            if key.kind == "verify":
                (last, shift, tokens, logprobs, num, num_drafts, extra, self.cache,
                 self.draft_cache, self.token_pool) = exe(
                    self.params, self.cache, batch, sampling, self.last_tokens,
                    self.last_shift, prev_index, self.draft_params, self.draft_cache,
                    self.token_pool)
                if not keep_last:
                    self.last_tokens, self.last_shift = last, shift
                return StepHandle(tokens, logprobs, num, extra, num_drafts)
            last, tokens, logprobs, extra, self.cache, self.draft_cache, self.token_pool = exe(
                self.params, self.cache, batch, sampling, self.last_tokens, prev_index,
                self.draft_params, self.draft_cache, self.token_pool)
            if not keep_last:
                self.last_tokens, self.last_shift = last, self._no_shift
        return StepHandle(tokens, logprobs, None, extra)

    def _run_forward(self, exe, key: StepKey, batch: StepBatch, sampling: SamplingBatch,
                     prev_index: np.ndarray, warmup: bool = False) -> "ForwardHandle":
        """Run the forward half `exe` of a split step (the pools donated and replaced) and
        return its handle for `_run_sample`; of `sampling` only the prompt targets are
        read. warmup: a warm-up run (`_first_run`), whose logits no sampler reads."""
        given = sampling.prompt_targets if key.kind == "mixed" else None
        block_tables = np.asarray(batch.block_tables)
        if block_tables.shape[1] < self.max_pages:  # the sampler takes the widest table
            block_tables = np.pad(block_tables, ((0, 0), (0, self.max_pages - key.P)))
        num_context = np.asarray(batch.positions)[np.asarray(batch.logits_indices)] + 1
        with self._dispatch_lock:
            if self.mirror is not None:  # (each process fills in its own neutral targets)
                self.mirror.send(("forward", key, jax.tree.map(np.asarray, batch),
                                  None if given is None else np.asarray(given), prev_index,
                                  warmup))
            # (after the send: a first device_put waits for the others)
            own = self._own_prompt_logprobs(key)
            targets = None if own else self._complete(key, sampling).prompt_targets
            logits, extra, self.cache, self.draft_cache, self.token_pool = exe(
                self.params, self.cache, batch, targets, self.last_tokens, prev_index,
                self.draft_params, self.draft_cache, self.token_pool)
            hidden = extra.pop("hidden", None)
            if own and given is not None:  # some row asks: their program, after the forward
                pkey = StepKey("prompt_logprobs", key.T, 0, 0, 1)
                exe = self._followed(pkey) if self._following else self._executable(pkey)
                extra.update(exe(self.params, hidden, given))
        return ForwardHandle(key.sample_key, logits, extra, block_tables, num_context, warmup)

    def _own_prompt_logprobs(self, key: StepKey) -> bool:
        """Whether `key`'s (a split step's forward) prompt logprobs are a program of their
        own (`prompt_logprobs_step`, run when a row asks) rather than a conditional in the
        forward: a mixed step's, with host branches."""
        return self.kernels.host_branches and key.kind == "mixed"

    def _run_sample(self, exe, key: StepKey, fwd: "ForwardHandle", sampling: SamplingBatch,
                    keep_last: bool = False) -> "StepHandle":
        """Run the sampler half `exe` (of `key`: fwd.key with a plan) on a forward's logits;
        replaces `last_tokens` unless `keep_last`. Returns the step's handle (its extra:
        the forward's and the sampler's)."""
        with self._dispatch_lock:
            if self.mirror is not None:
                self.mirror.send(("sample", key, jax.tree.map(np.asarray, dataclasses.replace(
                                      sampling, prompt_targets=None)),
                                  fwd.block_tables, fwd.num_context, keep_last, fwd.warmup))
            sampling = self._complete(key, sampling)
            last, tokens, logprobs, extra, self.token_pool = exe(
                fwd.logits, sampling, self.token_pool, fwd.block_tables, fwd.num_context)
            if not keep_last:
                self.last_tokens, self.last_shift = last, self._no_shift
        return StepHandle(tokens, logprobs, None, {**fwd.extra, **extra})

    def _add(self, key, exe, dt):
        with self._lock:
            self._compiled[key] = exe
            self.num_compilations += 1
            self.compile_seconds += dt

    def _plans(self, key: StepKey) -> tuple[SamplerPlan, ...]:
        """The sampler plans `key`'s program is compiled for at warm-up
        (jaxserve.sample.plan): with the device deciding, ON_DEVICE; with host branches
        (Kernels.host_branches) every static plan for a sampler program; for a whole step
        (its forward compiled once per plan) FUSED_PLANS, and for a verify step ON_DEVICE
        too (a multi-step decode of other batches is not scheduled: the engine's
        Scheduler.plain_bursts); a forward program samples nothing."""
        if not key.samples or not self.kernels.host_branches:
            return (ON_DEVICE,)
        if key.kind == "sample":
            return sampler_plans(self.num_top)
        return FUSED_PLANS + ((ON_DEVICE,) if key.kind == "verify" else ())

    def _planned(self, key: StepKey, sampling: SamplingBatch) -> StepKey:
        """`key` with the plan its program runs `sampling` (host arrays) with: the batch's
        own (`plan_of`) where that program is compiled, else ON_DEVICE."""
        if not key.samples or not self.kernels.host_branches:
            return key
        plan = plan_of(sampling, self.num_top)
        return key._replace(plan=plan if plan in self._plans(key) else ON_DEVICE)

    def _warmup_keys(self, shapes) -> list[StepKey]:
        """The programs not compiled yet of `shapes` (None: every bucketed shape), each for
        its sampler plans (`_plans`), with a mixed step's own prompt-logprobs program
        (`_own_prompt_logprobs`) and, with fused_decode, a one-token decode shape's whole
        program beside its split one, most likely first (compilation.warmup_order)."""
        shapes = shapes if shapes is not None else self.shapes.warmup()
        keys = [StepKey(*shape) for shape in shapes]
        if self.fused_decode:
            keys += [k._replace(whole=True) for k in keys if k.kind == "decode" and k.split]
        keys = {key._replace(plan=plan) for key in keys for plan in self._plans(key)}
        keys |= {StepKey("prompt_logprobs", k.T, 0, 0, 1) for k in keys
                 if self._own_prompt_logprobs(k)}
        return warmup_order(keys - set(self._compiled))

    def warmup(self, shapes: list[tuple] | None = None, threads: int = 2) -> None:
        """Compile the step for every bucketed shape and wait (XLA compiles release the
        GIL, so `threads` compile side by side)."""
        todo = self._warmup_keys(shapes)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            list(pool.map(self._get_or_compile, todo))
        log.info("warm-up: %d step shapes compiled in %.1f s", len(todo), time.perf_counter() - t0)

    def warmup_in_background(self, shapes: list[tuple] | None = None,
                             first: int = 3) -> None:
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

    def dispatch(self, batch: StepBatch, sampling: SamplingBatch, num_steps: int = 1,
                 prev_index: np.ndarray | None = None) -> "StepHandle":
        """Launch one step without waiting for it (host numpy arrays in). prev_index: [T]
        int32, the rows whose token is the previous step's sampled token in that row, still
        on device (-1: batch.tokens' own; None = all from the host). num_steps > 1:
        multi-step decode (see `model_step`; the block tables must hold the pages of all
        num_steps new tokens). Returns a handle for `fetch`; the KV pool and `last_tokens`
        are replaced by the step's (future) outputs at once. A verify batch
        (logits_indices [S, J]: speculative decoding) runs the verify step (`verify_step`)
        with num_steps rounds: its `last_tokens` are each sequence's last kept token and
        `last_shift` how many more than one it kept, which a verify step planned before it
        is read moves its rows by. A one-token step is `dispatch_forward` then
        `dispatch_sample`, except a decode step with fused_decode whose sampler plan was
        compiled whole (`_whole_decode`): one program."""
        if prev_index is None:
            prev_index = np.full(batch.tokens.shape, -1, np.int32)
        key = StepKey.of(batch, num_steps)
        whole = self._whole_decode(key, sampling)
        if whole is not None:
            return self._call(self._executable(whole), whole, batch, sampling, prev_index)
        if key.split:
            return self.dispatch_sample(self.dispatch_forward(batch, sampling, prev_index),
                                        sampling)
        key = self._planned(key, sampling)
        return self._call(self._executable(key), key, batch, sampling, prev_index)

    def _whole_decode(self, key: StepKey, sampling: SamplingBatch) -> StepKey | None:
        """The key of `key`'s whole program (forward and sampler in one) when `key` is a
        one-token decode step that runs so: with fused_decode, and a sampler plan that
        program was compiled for at warm-up (with host branches FUSED_PLANS only: a batch
        with logits controls or top logprobs takes the split step's static sampler
        program, not an on-demand compilation); else None."""
        if not (self.fused_decode and key.split and key.kind == "decode"):
            return None
        whole = self._planned(key._replace(whole=True), sampling)
        return whole if whole.plan in self._plans(whole) else None

    def dispatch_forward(self, batch: StepBatch, sampling: SamplingBatch,
                         prev_index: np.ndarray | None = None) -> "ForwardHandle":
        """Launch the forward half of a one-token mixed or decode step (`forward_step`)
        without waiting: the KV pool is replaced at once; the logits stay on device in the
        returned handle until `dispatch_sample`. Of `sampling` only the prompt targets
        are read now, so the rest (a grammar's bitmask) may be filled in before the
        sampler half is dispatched. prev_index as `dispatch`. Raises ValueError for a
        multi-step or verify batch (`dispatch` runs those whole)."""
        if prev_index is None:
            prev_index = np.full(batch.tokens.shape, -1, np.int32)
        key = StepKey.of(batch)
        if not key.split:
            raise ValueError(f"a {key.kind} step runs whole (Runner.dispatch), not split")
        return self._run_forward(self._executable(key), key, batch, sampling, prev_index)

    def dispatch_sample(self, fwd: "ForwardHandle", sampling: SamplingBatch) -> "StepHandle":
        """Launch the sampler half (`sample_step`) of the step whose forward `fwd` is, with
        `sampling` (the same batch's, its controls now complete); replaces `last_tokens`
        (what the next step's prev_index reads). Dispatch every forward's sampler half
        before the next step's forward. Returns the step's handle for `fetch`."""
        key = self._planned(fwd.key, sampling)
        return self._run_sample(self._executable(key), key, fwd, sampling)

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
            self.last_shift = self._no_shift = jnp.zeros((self.max_rows,), jnp.int32,
                                                         device=self._replicated)
            self.token_pool = self._zero_token_pool()

    def follow(self, channel) -> None:
        """A follower process of a multi-process deployment: launch every step process 0
        launches, in its order, on this process's devices, until it says stop (returns)
        or is gone (jaxserve.distributed.multiprocess.DistributedError). Shapes compile on first use
        here (process 0's warm-up runs reach this process as steps too); each step is
        waited for before the next is read, so nothing piles up."""
        self._following = True
        while True:
            record = channel.recv()
            if record[0] == "stop":
                return
            if record[0] == "reset":
                self.reset_cache()
                continue
            if record[0] == "lora":
                self._apply_lora(record[1], record[2])
                continue
            if record[0] == "forward":
                _, key, batch, targets, prev_index, warmup = record
                sampling = SamplingBatch.from_params([], [], [], key.S)
                sampling = dataclasses.replace(sampling, prompt_targets=targets)
                fwd = self._run_forward(self._followed(key), key, batch, sampling, prev_index,
                                        warmup)
                if not warmup:  # process 0's warm-up runs interleave with its steps
                    self._follow_forward = fwd
                fwd.logits.block_until_ready()
                continue
            if record[0] == "sample":
                _, key, sampling, block_tables, num_context, keep_last, warmup = record
                if warmup:  # process 0's warm-up run of a sampler program
                    fwd = self._warmup_forward(block_tables.shape[0])
                else:
                    fwd, self._follow_forward = self._follow_forward, None
                self._run_sample(self._followed(key), key, fwd, sampling,
                                 keep_last).tokens.block_until_ready()
                continue
            _, key, batch, sampling, prev_index, keep_last = record
            self._call(self._followed(key), key, batch, sampling, prev_index,
                       keep_last).tokens.block_until_ready()

    def _followed(self, key: StepKey):
        """A follower's executable for `key`, compiled (or read from the executable cache)
        on first use."""
        exe = self._compiled.get(key)
        if exe is None:
            hits = self.executable_cache.hits if self.executable_cache else 0
            exe, dt = self._compile(key)
            self._add(key, exe, dt)
            read = self.executable_cache is not None and self.executable_cache.hits > hits
            log.info("step program %s T=%d S=%d P=%d n=%d rounds=%d plan=%s whole=%s %s in "
                     "%.2f s",
                     *key, "read from the executable cache" if read else "compiled", dt)
        return exe

    @staticmethod
    def fetch(handle: "StepHandle", logprobs: bool = False, pooled: bool = False
              ) -> "StepOutput":
        """Wait for a dispatched step: its sampled tokens [n, S] int32 and their logprobs
        [n, S] f32 (column b: sequence b of the batch, padding included; n: num_steps, or
        rounds x J for a verify step), and for a verify step num_tokens [rounds, S] int32,
        the tokens each round kept (column b's first num_tokens[:, b].sum() count: its
        accepted drafts and the token after them, round by round; the rest were rejected),
        and num_drafts [rounds, S] int32, the drafts each round verified (n-gram drafts
        proposed on device may be fewer than planned).
        logprobs: also read its top and prompt logprobs (`StepOutput.extra`; else {});
        pooled: also read its pooled hidden states (extra["pooled"] [S, D] f32, with
        EngineConfig.pooling)."""
        num = None if handle.num_tokens is None else np.asarray(handle.num_tokens)
        drafts = None if handle.num_drafts is None else np.asarray(handle.num_drafts)
        extra = {k: np.asarray(v) for k, v in handle.extra.items()
                 if (pooled if k == "pooled" else logprobs)}
        return StepOutput(np.asarray(handle.tokens), np.asarray(handle.logprobs), num, extra,
                          drafts)

    def run(self, batch: StepBatch, sampling: SamplingBatch, num_steps: int = 1,
            logprobs: bool = False, prev_index: np.ndarray | None = None) -> "StepOutput":
        """Run one step and wait: `fetch`'s output."""
        return self.fetch(self.dispatch(batch, sampling, num_steps, prev_index), logprobs)


@dataclasses.dataclass(frozen=True)
class ForwardHandle:
    """A dispatched forward half (`Runner.dispatch_forward`): key, its sampler program's
    ("sample", 0, S, 0, 1); logits [S, V] f32 on device; extra: the prompt logprobs of a
    mixed step (`StepHandle.extra`) (a warm-up run's logits may be host zeros); block_tables [S, max_pages] int32 and num_context [S]
    int32 (host), what the sampler reads each sequence's history by."""

    key: StepKey
    logits: jax.Array
    extra: dict
    block_tables: np.ndarray
    num_context: np.ndarray
    warmup: bool = False  # a warm-up run's: no sampler reads its logits / they are zeros


@dataclasses.dataclass(frozen=True)
class StepHandle:
    """A dispatched step's outputs, still on device: tokens [n, S] int32, logprobs [n, S]
    f32 (S: the batch's sequence bucket), for a verify step num_tokens [rounds, S] int32,
    and extra: top_ids / top_logprobs [n, S, max_logprobs] (with max_logprobs > 0) and,
    for a mixed step, prompt_logprobs [T] (and prompt_top_ids / prompt_top_logprobs [T,
    max_logprobs]): zeros unless a row asked."""

    tokens: jax.Array
    logprobs: jax.Array
    num_tokens: jax.Array | None = None
    extra: dict = dataclasses.field(default_factory=dict)
    num_drafts: jax.Array | None = None  # a verify step's drafts verified [rounds, S] int32


class StepOutput(NamedTuple):
    """A finished step's outputs on the host (see `Runner.fetch`)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    num_tokens: np.ndarray | None = None
    extra: dict = {}
    num_drafts: np.ndarray | None = None
