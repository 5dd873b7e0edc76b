"""Planning llama70b (tensor parallel 8) on this CPU machine: abstract params, their
shardings and the per-device memory plan, with nothing allocated."""

import gc
import subprocess
import sys
from pathlib import Path

import jax
from jax.sharding import PartitionSpec as P

from jaxserve.config import load_config
from jaxserve.memory_plan import GiB, plan_memory
from jaxserve.model.params import abstract_params
from jaxserve.sharding import ShardingRules, make_abstract_mesh

ROOT = Path(__file__).resolve().parent.parent


def test_llama70b_abstract_tree_and_shardings():
    cfg = load_config(ROOT / "configs/llama70b.py")
    gc.collect()  # arrays earlier tests left for the collector would vanish mid-test
    before = len(jax.live_arrays())
    rules = ShardingRules(make_abstract_mesh(cfg.parallel))
    params = abstract_params(cfg.model, rules)
    layer = params.layers[0]
    assert len(params.layers) == 80
    assert layer.wq.shape == (8192, 64, 128) and layer.wq.sharding.spec == P(None, "model", None)
    assert layer.wk.sharding.spec == P(None, "model", None)          # 8 KV heads over 8 devices
    assert layer.wo.sharding.spec == P("model", None, None)
    assert layer.w_gate.sharding.spec == P(None, "model")
    assert layer.w_down.sharding.spec == P("model", None)
    assert params.embed.sharding.spec == P("model", None)
    assert layer.wq.sharding.shard_shape(layer.wq.shape) == (8192, 8, 128)
    assert len(jax.live_arrays()) == before, "planning allocated device memory"


def test_llama70b_memory_plan():
    cfg = load_config(ROOT / "configs/llama70b.py")
    gc.collect()
    before = len(jax.live_arrays())
    plan = plan_memory(cfg)
    assert len(jax.live_arrays()) == before
    assert abs(plan.num_params - 70.55e9) / 70.55e9 < 0.005        # Llama 3.1 70B: 70.55 B
    assert plan.weights_total == plan.num_params * 2                 # bf16
    norms = (2 * 80 + 1) * 8192 * 2                                  # RMSNorm weights: replicated
    assert plan.weights == (plan.weights_total - norms) // 8 + norms  # every matrix divides by 8
    assert plan.kv_bytes_per_token_total == 2 * 80 * 8 * 128 * 2     # 320 KiB
    assert plan.kv_pool == cfg.engine.cache.kv_cache_memory_bytes // 8
    assert plan.kv_tokens == plan.kv_pages * 16
    assert not plan.replicated_leaves
    assert 0 < plan.activations < 8 * GiB
    assert plan.total < 80 * GiB                                     # fits an 80 GB H100
    assert "weights / device" in plan.table(80 * GiB)


def test_uneven_heads_fall_back_to_replication():
    cfg = load_config(ROOT / "configs/smollm2_135m.py")
    from jaxserve.config import ModelConfig, ParallelConfig
    model = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                        num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    plan = plan_memory(cfg.replace(parallel=ParallelConfig(tensor_parallel_size=4)), model)
    assert set(plan.replicated_leaves) == {"wq", "wk", "wv", "wo"}
    assert plan.weights < plan.weights_total


def test_plan_memory_tool_runs():
    out = subprocess.run([sys.executable, str(ROOT / "tools/plan_memory.py"), "--config",
                          str(ROOT / "configs/llama70b.py")], capture_output=True, text=True, check=True)
    assert "weights / device" in out.stdout and "16.43 GiB" in out.stdout
