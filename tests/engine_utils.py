"""Driving an Engine in tests: requests arriving over engine steps; a tiny random model's
engine (byte-level test tokenizer, vocab 258, XLA kernels) for engine-logic tests."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from model_utils import tiny_config

TINY_CFG = tiny_config(vocab_size=258, hidden_size=32, intermediate_size=48, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
TINY_PAGE = 4
TINY_ECFG = EngineConfig(max_model_len=64).override(
    page_size=TINY_PAGE, kv_cache_memory_bytes=65 * 2 * 2 * TINY_PAGE * 2 * 8 * 4,
    max_num_seqs=4, max_num_batched_tokens=64, seq_buckets=(1, 4), token_buckets=(16, 64),
    page_buckets=(16,))


def tiny_params():
    """TINY_CFG's random params; scale 1: a model whose greedy text varies (small weights
    repeat one token)."""
    import jax
    from jaxserve.model.params import init_params
    return init_params(TINY_CFG, jax.random.key(3), scale=1.0)


def tiny_engine(params, draft_params=None, eagle=None, kernels=None, executable_cache=None,
                num_pages=65, **engine_config):
    """An Engine over `params` (tiny_params()) with TINY_ECFG (fields set by
    `EngineConfig.override(**engine_config)`), a `num_pages`-page pool (65: room for every
    sequence; 20: preemptions) and the byte-level test tokenizer. kernels: the Kernels
    (default XLA's, the device deciding branches).
    draft_params: a draft model (speculative decoding, method "draft_model"): tiny params
    of any number of layers, with its own 65-page pool. eagle: (head config, EagleParams)
    of an EAGLE head (method "eagle"), with its pool and feature pool. executable_cache:
    the Runner's (jaxserve.worker.executable_cache; None: JAX compiles)."""
    from fake_engine import tiny_tokenizer
    from jaxserve.engine.engine import Engine
    from jaxserve.worker.runner import Runner
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.model.transformer import Kernels
    ecfg = TINY_ECFG.override(**engine_config)
    cache = init_kv_cache(TINY_CFG, num_pages, TINY_PAGE, TINY_CFG.dtype, layout="head_major")
    draft = None
    if draft_params is not None:
        dcfg = TINY_CFG.replace(num_layers=len(draft_params.layers))
        from jaxserve.spec_decode.draft_model import DraftModel
        draft = (DraftModel(dcfg), draft_params,
                 init_kv_cache(dcfg, 65, TINY_PAGE, TINY_CFG.dtype, layout="head_major"))
    if eagle is not None:
        import jax.numpy as jnp
        from jaxserve.spec_decode.eagle import EagleHead
        hcfg, hp, *layers = eagle   # (config, params[, feature layers of an EAGLE-3 head])
        draft = (EagleHead(hcfg, tuple(layers[0]) if layers else ()), hp,
                 (init_kv_cache(hcfg, 65, TINY_PAGE, TINY_CFG.dtype, layout="head_major"),
                  jnp.zeros((65 * TINY_PAGE, TINY_CFG.hidden_size), jnp.float32)))
    if ecfg.lora.enable_lora:  # the adapter slots, as build_engine attaches them
        from jaxserve.model.lora import attach_pools
        params = attach_pools(params, TINY_CFG, ecfg.lora)
    runner = Runner(TINY_CFG, ecfg, params, cache, kernels or Kernels("xla", "xla", "xla"),
                    draft=draft, executable_cache=executable_cache)
    return Engine(TINY_CFG, ecfg, runner, tiny_tokenizer())


def run_staggered(engine, requests, arrivals, check=None, max_steps=5000):
    """Add request i = (id, prompt ids, SamplingParams[, LoRA adapter name]) at engine step
    arrivals[i]; step
    until all of them finish. `check`, if given, is called on every RequestOutput of theirs.
    Returns ({id: the final RequestOutput}, the largest number of running sequences seen).
    Fails the test if they have not finished after max_steps steps."""
    done, step, max_running = {}, 0, 0
    ids = {r[0] for r in requests}
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    while len(done) < len(requests):
        while pending and arrivals[pending[0]] <= step:
            rid, prompt, params, *lora = requests[pending.pop(0)]
            engine.add_request(rid, prompt, params, *lora)
        for out in engine.step():
            if out.request_id not in ids:
                continue
            if check is not None:
                check(out)
            if out.finished:
                done[out.request_id] = out
        max_running = max(max_running, len(engine.scheduler.running))
        step += 1
        assert step < max_steps, "engine made no progress"
    return done, max_running


def outputs(engine, requests, arrivals, max_steps=2000):
    """`run_staggered`'s final outputs as {id: (token_ids, text, finish_reason)}."""
    done, _ = run_staggered(engine, requests, arrivals, max_steps=max_steps)
    return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in done.items()}
