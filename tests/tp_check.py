"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N: the paged
forward (a prefill, then decode steps) under tensor parallel 1, 2 and 4 over the same
weights; prints JSON {tp: max |logits - logits_tp1|}.

    python tests/tp_check.py tiny          # random weights, every axis divisible
    python tests/tp_check.py CHECKPOINT    # a jaxserve checkpoint (the real model)
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import MeshConfig
from jaxserve.kv_cache import init_kv_cache
from jaxserve.model.params import init_params, param_shardings
from jaxserve.model.transformer import StepBatch, compute_logits, forward
from jaxserve.sharding import ShardingRules, make_mesh


def run(params, cfg, rules, ids, n_decode):
    ps, pages = 16, np.array([7, 3, 11, 1, 9, 4, 2, 8], np.int32)
    cache = init_kv_cache(cfg, 12, ps, cfg.dtype, rules)
    fwd = jax.jit(lambda p, c, b: (lambda h, c: (compute_logits(p, h, rules), c))(
        *forward(p, c, b, cfg, rules)), donate_argnums=1)
    n, Q = len(ids), 64
    slots = lambda pos: pages[pos // ps] * ps + pos % ps
    b = StepBatch(tokens=np.pad(ids, (0, Q - n))[None].astype(np.int32),
                  positions=np.pad(np.arange(n), (0, Q - n))[None].astype(np.int32),
                  slot_mapping=np.pad(slots(np.arange(n)), (0, Q - n))[None].astype(np.int32),
                  block_tables=pages[None], seq_lens=np.array([n], np.int32),
                  logits_indices=np.array([n - 1], np.int32))
    logits, cache = fwd(params, cache, b)
    outs = [np.asarray(logits)[0, :n]]
    tok = int(outs[-1][-1].argmax())
    for i in range(n_decode):
        pos = n + i
        b = StepBatch(tokens=np.array([[tok]], np.int32), positions=np.array([[pos]], np.int32),
                      slot_mapping=np.array([[slots(pos)]], np.int32), block_tables=pages[None],
                      seq_lens=np.array([pos + 1], np.int32), logits_indices=np.array([0], np.int32))
        logits, cache = fwd(params, cache, b)
        outs.append(np.asarray(logits)[0])
        tok = int(outs[-1][-1].argmax())
    return np.concatenate(outs)


def main():
    src = sys.argv[1]
    if src == "tiny":
        from jaxserve.config import ModelConfig
        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=8, num_kv_heads=4, head_dim=16, attention_bias=True)
        host = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), scale=0.2))
    else:
        from jaxserve.checkpoint import load_model_config, load_params
        cfg = load_model_config(src)
        host = jax.tree.map(np.asarray, load_params(src, cfg))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)
    results, base = {}, None
    for tp in (1, 2, 4):
        rules = ShardingRules(make_mesh(MeshConfig(tensor_parallel=tp))) if tp > 1 else None
        params = host if rules is None else jax.tree.map(jax.device_put, host, param_shardings(cfg, rules))
        logits = run(params, cfg, rules, ids, n_decode=4)
        base = logits if base is None else base
        results[tp] = float(np.abs(logits - base).max())
        results["max_abs_logit"] = float(np.abs(base).max())
    results["devices"] = len(jax.devices())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
