"""Device side of the engine: holds the params and the KV pool, runs the jitted step.

The step (forward -> last-token logits -> sample) is compiled ahead of time once per
bucketed shape (kind, B, Q, P); the executables are kept here, so a shape outside the
buckets is a visible compilation (`num_compilations`), never a silent retrace. The KV
pool is donated to every step and replaced by the returned one.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig, ModelConfig, resolve_impl
from jaxserve.engine.buckets import warmup_shapes
from jaxserve.kv_cache import KVCache
from jaxserve.model.params import Params
from jaxserve.model.transformer import Kernels, StepBatch, forward, last_token_logits
from jaxserve.sampling import SamplingBatch, sample
from jaxserve.sharding import ShardingRules

log = logging.getLogger(__name__)


def _step(params: Params, cache: KVCache, batch: StepBatch, sampling: SamplingBatch, *,
          cfg: ModelConfig, rules: ShardingRules | None, kernels: Kernels):
    hidden, cache = forward(params, cache, batch, cfg, rules, kernels)
    logits = last_token_logits(params, hidden, batch.logits_indices, rules)
    tokens, logprobs = sample(logits, sampling)
    return tokens, logprobs, cache


def _abstract_inputs(B: int, Q: int, P: int, sharding) -> tuple[StepBatch, SamplingBatch]:
    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    i32, f32 = jnp.int32, jnp.float32
    batch = StepBatch(tokens=s((B, Q), i32), positions=s((B, Q), i32),
                      slot_mapping=s((B, Q), i32), block_tables=s((B, P), i32),
                      seq_lens=s((B,), i32), logits_indices=s((B,), i32))
    sampling = SamplingBatch(temperature=s((B,), f32), top_k=s((B,), i32), top_p=s((B,), f32),
                             min_p=s((B,), f32), seed=s((B,), jnp.uint32), step=s((B,), i32))
    return batch, sampling


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Runner:
    """Params + KV pool on device, and one compiled step per bucketed shape."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, params: Params,
                 cache: KVCache, rules: ShardingRules | None = None):
        self.model_cfg = model_cfg
        self.engine_cfg = engine_cfg
        self.params = params
        self.cache = cache
        self.rules = rules
        self._replicated = NamedSharding(rules.mesh, PartitionSpec()) if rules else None
        platform = (rules.mesh.devices.flat[0] if rules else jax.devices()[0]).platform
        self.kernels = Kernels(attention=resolve_impl(engine_cfg.attention_impl, platform),
                               matmul=resolve_impl(engine_cfg.matmul_impl, platform))
        self._jitted = jax.jit(
            functools.partial(_step, cfg=model_cfg, rules=rules, kernels=self.kernels),
            donate_argnums=(1,))
        self._compiled: dict[tuple[int, int, int], object] = {}
        self.num_compilations = 0
        self.compile_seconds = 0.0

    def _compile(self, B: int, Q: int, P: int):
        t0 = time.perf_counter()
        batch, sampling = _abstract_inputs(B, Q, P, self._replicated)
        exe = self._jitted.trace(_abstract(self.params), _abstract(self.cache), batch,
                                 sampling).lower().compile()
        dt = time.perf_counter() - t0
        return (B, Q, P), exe, dt

    def _executable(self, B: int, Q: int, P: int):
        exe = self._compiled.get((B, Q, P))
        if exe is None:
            log.warning("compiling step for unwarmed shape B=%d Q=%d P=%d", B, Q, P)
            key, exe, dt = self._compile(B, Q, P)
            self._add(key, exe, dt)
        return exe

    def _add(self, key, exe, dt):
        self._compiled[key] = exe
        self.num_compilations += 1
        self.compile_seconds += dt

    def warmup(self, shapes: list[tuple[str, int, int, int]] | None = None, threads: int = 2) -> None:
        """Compile the step for every bucketed shape (XLA compiles release the GIL, so
        `threads` compile side by side)."""
        shapes = shapes if shapes is not None else warmup_shapes(self.engine_cfg)
        todo = sorted({(B, Q, P) for _, B, Q, P in shapes} - set(self._compiled))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            for key, exe, dt in pool.map(lambda k: self._compile(*k), todo):
                self._add(key, exe, dt)
        log.info("warm-up: %d step shapes compiled in %.1f s", len(todo), time.perf_counter() - t0)

    def run(self, batch: StepBatch, sampling: SamplingBatch) -> tuple[np.ndarray, np.ndarray]:
        """Run one step; returns sampled tokens [B] int32 and their logprobs [B] f32 (host)."""
        B, Q = batch.tokens.shape
        exe = self._executable(B, Q, batch.block_tables.shape[1])
        tokens, logprobs, self.cache = exe(self.params, self.cache, batch, sampling)
        return np.asarray(tokens), np.asarray(logprobs)
