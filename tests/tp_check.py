"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N: the paged
forward (a prefill, then decode steps) under tensor parallel sizes TPS over the same
weights, with the kernels of VARIANT (each device runs them on its shard, in shard_map);
prints JSON {"diff": {tp: max |logits - reference|}, "max_abs_logit",
"noise_floor": max |diff| of the reference against itself with the sequence batched
beside others (f32 reduction order alone), "sharded": {tp: names of the weights split
across devices}, "feature_diff": {tp: max |features - reference's|} of the residual
streams entering layers 0 and L - 1 (not for pipeline meshes), "max_abs_feature",
"num_layers", "max_reduction": the longest sum of a layer's or the head's products}. The
reference is REFERENCE's kernels (default VARIANT's) at TP 1.
A mesh "TPxPP" or "TPxPPmM" (e.g. 2x2, 1x4m4) runs PP pipeline stages (M microbatches
for prefill and decode steps alike; default ParallelConfig's) with TP devices each, on the sequence batched beside the others (so that a
step splits into microbatches, the prompt cut between two), against the reference run
the same way.

    python tests/tp_check.py SRC VARIANT TPS CACHE_DIR [REFERENCE]
    SRC: "tiny" (random weights, every axis divisible by 4), "tiny-gqa" (8 query / 2 KV
    heads: at TP 4 each KV head repeated over 2 devices), "tiny-gguf" (tiny's shape, its
    matrices in GGUF blocks of every format, untied head) or a jaxserve checkpoint
    VARIANT: xla | cpu (C++ attention and packed bf16 matmuls) | int8 (quantised weights,
    XLA) | pallas (Pallas attention and int8 matmul, interpret mode); TPS: e.g. 1,2,4,2x2
"""

import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxserve.config import KernelConfig, ParallelConfig
from jaxserve.worker.kernel_selection import prepare_params, select_kernels
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.params import init_params, param_shardings
from jaxserve.model.pipeline import StagedLayers, stage_params
from jaxserve.model.tensor_parallel import expand_kv_heads
from jaxserve.model.inputs import StepBatch
from jaxserve.model.transformer import compute_logits, forward_features
from jaxserve.distributed.sharding import ShardingRules, make_mesh

VARIANTS = {
    "xla": KernelConfig(attention_impl="xla", matmul_impl="xla", sampling_impl="xla"),
    "cpu": KernelConfig(attention_impl="cpu", matmul_impl="cpu", sampling_impl="xla",
                        bf16_matmul_min_rows=1),
    "fused": KernelConfig(attention_impl="xla", matmul_impl="xla", sampling_impl="xla",
                          fuse_projections=True),
    "int8_fused": KernelConfig(attention_impl="xla", matmul_impl="xla", sampling_impl="xla",
                               weight_quant="int8", weight_quant_group_size=16,
                               fuse_projections=True),
    "int8_g16": KernelConfig(attention_impl="xla", matmul_impl="xla", sampling_impl="xla",
                             weight_quant="int8", weight_quant_group_size=16),
    "int8": KernelConfig(attention_impl="xla", matmul_impl="xla", sampling_impl="xla",
                         weight_quant="int8"),
    "pallas": KernelConfig(attention_impl="pallas_interpret", matmul_impl="pallas_interpret",
                           sampling_impl="xla", weight_quant="int8"),
}


def run(params, cfg, rules, kernels, ids, n_decode, others=()):
    """Logits [len(ids) + n_decode, vocab] of `ids` (one prefill step, then n_decode greedy
    decode steps), and the residual streams entering layers 0 and L - 1 at its prefill rows
    [2, len(ids), D] (forward_features: what an EAGLE-3 head reads; None under a pipeline,
    which does not export them); `others`: token lists prefilled and decoded in the same
    batch after it."""
    ps, per_seq = 16, 4
    rows = [list(ids)] + [list(o) for o in others]
    B = len(rows)
    T = max(64, sum(len(r) for r in rows))  # token rows of the packed prefill
    rng = np.random.default_rng(7)
    tables = rng.permutation(np.arange(1, 1 + B * per_seq)).reshape(B, per_seq).astype(np.int32)
    cache = init_kv_cache(cfg, 1 + B * per_seq, ps, cfg.dtype, rules, kernels.attention.kv_layout)
    layers = () if isinstance(params.layers, StagedLayers) else (0, cfg.num_layers - 1)

    @functools.partial(jax.jit, donate_argnums=1)
    def fwd(p, c, b):
        h, feats, c = forward_features(p, c, b, cfg, rules, kernels, layers)
        return compute_logits(p, h, rules, kernels.matmul), feats, c

    def batch(chunks, starts, T, decode=False):
        z = lambda: np.zeros(T, np.int32)  # noqa: E731
        b = StepBatch(tokens=z(), positions=z(), slot_mapping=z(), block_tables=tables,
                      seq_lens=np.zeros(B, np.int32), query_start=np.zeros(B + 1, np.int32),
                      logits_indices=np.zeros(B, np.int32), decode=decode)
        row = 0
        for r, (toks, start) in enumerate(zip(chunks, starts)):
            pos = np.arange(start, start + len(toks))
            b.tokens[row:row + len(toks)] = toks
            b.positions[row:row + len(toks)] = pos
            b.slot_mapping[row:row + len(toks)] = tables[r][pos // ps] * ps + pos % ps
            b.seq_lens[r] = start + len(toks)
            row += len(toks)
            b.query_start[r + 1:] = row
        return b

    lens = [len(r) for r in rows]
    logits, feats, cache = fwd(params, cache, batch(rows, [0] * B, T))
    feats = np.stack([np.asarray(f)[:len(ids)] for f in feats]) if feats else None
    logits = np.asarray(logits)
    ends = np.cumsum(lens)
    outs = [logits[:len(ids)]]
    toks = [[int(logits[ends[r] - 1].argmax())] for r in range(B)]
    for _ in range(n_decode):
        logits, _, cache = fwd(params, cache, batch(toks, lens, B, decode=True))
        logits = np.asarray(logits)
        outs.append(logits[:1])
        lens = [n + 1 for n in lens]
        toks = [[int(row.argmax())] for row in logits]
    return np.concatenate(outs), feats


def sharded_weights(params) -> list[str]:
    """Names of the weights of layer 0 (and the embedding) split across devices (a
    pipeline's: of every stage's local layer 0, stacked)."""
    layer0 = params.layers.layers[0] if isinstance(params.layers, StagedLayers) else params.layers[0]
    named = {"embed": params.embed, **{f"layers.0.{k}": v for k, v in
                                        vars(layer0).items() if v is not None}}
    return sorted(k for k, v in named.items()
                  if any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(v)))


def main():
    src, variant, tps, cache_dir = sys.argv[1:5]
    reference = sys.argv[5] if len(sys.argv) > 5 else variant
    if src in ("tiny", "tiny-gqa", "tiny-gguf"):
        from jaxserve.config import ModelConfig
        formats = (("embed", "q8_0"), ("lm_head", "q8_0"), ("wq", "q4_1"), ("wk", "q4_0"),
                   ("wv", "q8_0"), ("wo", "q4_1"), ("w_gate", "q4_1"), ("w_up", "q4_0"),
                   ("w_down", "q4_1"))
        cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                          num_heads=8, num_kv_heads=2 if src == "tiny-gqa" else 4, head_dim=16,
                          attention_bias=True,
                          weight_formats=formats if src == "tiny-gguf" else ())
        host = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0), scale=0.2))
    else:
        from jaxserve.checkpoint import load_model_config, load_params
        cfg = load_model_config(src)
        host = jax.tree.map(np.asarray, load_params(src, cfg))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 40)
    rng = np.random.default_rng(1)
    others = [rng.integers(0, cfg.vocab_size, n) for n in (30, 7, 3)]

    def logits_of(name, mesh, **kw):
        tp, _, rest = mesh.partition("x")
        pp, _, m = rest.partition("m")
        par = ParallelConfig(tensor_parallel_size=int(tp), pipeline_parallel_size=int(pp or 1),
                             pipeline_microbatches=int(m) if m else None,
                             pipeline_decode_microbatches=int(m) if m else 1)
        tp = par.tensor_parallel_size
        rules = ShardingRules(make_mesh(par)) if par.num_devices > 1 else None
        params, served = expand_kv_heads(host, cfg, tp)  # KV heads fewer than devices
        if rules is not None:
            params = jax.tree.map(jax.device_put, params, param_shardings(served, rules))
        kernels = select_kernels(VARIANTS[name], "cpu", par.num_devices, cfg.dtype,
                                 Path(cache_dir) / "kernels")
        params = prepare_params(params, VARIANTS[name], kernels, rules)
        if par.pipeline_parallel_size > 1:
            params = stage_params(params, rules, par.microbatches,
                                  par.pipeline_decode_microbatches)
        return run(params, served, rules, kernels, ids, n_decode=2, **kw), params

    (base, base_feats), _ = logits_of(reference, "1")
    (beside, _), _ = logits_of(reference, "1", others=others)
    diff, sharded, feature_diff = {}, {}, {}
    for mesh in tps.split(","):
        if "x" in mesh:
            (logits, _), params = logits_of(variant, mesh, others=others)
            diff[mesh] = float(np.abs(logits - beside).max())
            sharded[mesh] = sharded_weights(params)
            continue
        (logits, feats), params = logits_of(variant, mesh)
        diff[mesh] = float(np.abs(logits - base).max())
        feature_diff[mesh] = float(np.abs(feats - base_feats).max())
        sharded[mesh] = sharded_weights(params) if int(mesh) > 1 else []
    print(json.dumps({"diff": diff, "max_abs_logit": float(np.abs(base).max()),
                      "feature_diff": feature_diff,
                      "max_abs_feature": float(np.abs(base_feats).max()),
                      "noise_floor": float(np.abs(beside - base).max()), "sharded": sharded,
                      "num_layers": cfg.num_layers,
                      "max_reduction": max(cfg.hidden_size, cfg.intermediate_size,
                                           cfg.num_heads * cfg.head_dim),
                      "devices": len(jax.devices())}))


if __name__ == "__main__":
    main()
