"""Planning llama70b (tensor parallel 8) on this CPU machine: abstract params, their
shardings and the per-device memory plan, with nothing allocated."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.config import ConfigError, load_config, shipped_config_names
from jaxserve.worker.memory_plan import GiB, plan_memory
from jaxserve.model.params import abstract_params
from jaxserve.distributed.sharding import ShardingRules, make_abstract_mesh

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


# llama70b sizes its pool from each GPU's memory; these plans fix it at 40 GiB per device
FIXED_POOL = 8 * 40 * GiB


def test_llama70b_memory_plan():
    cfg = load_config(ROOT / "configs/llama70b.py").override(kv_cache_memory_bytes=FIXED_POOL)
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
    out = subprocess.run([sys.executable, "-m", "jaxserve", "plan-memory", "--config",
                          str(ROOT / "configs/llama70b.py")], capture_output=True, text=True, check=True)
    assert "weights / device" in out.stdout and "16.43 GiB" in out.stdout


@pytest.mark.parametrize("kernels", [dict(weight_quant="int8"),
                                     dict(weight_quant="int8", weight_quant_group_size=16),
                                     dict(weight_quant="fp8_e4m3"),
                                     dict(bf16_matmul_min_rows=8),   # f32 + bf16 copies
                                     dict(bf16_matmul_min_rows=1)])  # bf16 copies only
def test_prepared_weight_bytes_equal_the_prepared_arrays(kernels):
    """The plan traces prepare_params abstractly: its bytes are those of the real prepared
    tree (quantised values and scales, bf16 copies)."""
    from jaxserve.config import KernelConfig, ParallelConfig
    from jaxserve.worker.kernel_selection import prepare_params
    from jaxserve.worker.memory_plan import prepared_weight_bytes
    from jaxserve.model.params import init_params
    from jaxserve.model.transformer import Kernels
    from model_utils import tiny_config

    cfg = tiny_config(dtype="float32")
    kcfg = KernelConfig(**kernels)
    real = prepare_params(init_params(cfg, jax.random.key(0)), kcfg, Kernels())
    rules = ShardingRules(make_abstract_mesh(ParallelConfig()))
    per_device, total = prepared_weight_bytes(cfg, kcfg, rules)
    assert per_device == total == sum(x.nbytes for x in jax.tree.leaves(real))
    plain = sum(x.nbytes for x in jax.tree.leaves(init_params(cfg, jax.random.key(0))))
    assert total != plain  # the layout changed what is held


def test_fp8_kv_cache_holds_twice_the_bf16_pages():
    """--kv-cache-dtype fp8: one byte per K/V element, so the same pool bytes hold twice a
    bf16 pool's pages (the pages gained are what /health and the plan report)."""
    cfg = load_config(ROOT / "configs/llama70b.py")
    bf16 = plan_memory(cfg.override(kv_cache_memory_bytes=FIXED_POOL, cache_dtype="bfloat16"))
    fp8 = plan_memory(cfg.override(kv_cache_memory_bytes=FIXED_POOL, cache_dtype="fp8"))
    auto = plan_memory(cfg.override(kv_cache_memory_bytes=FIXED_POOL, cache_dtype="auto"))
    assert fp8.kv_pool // fp8.kv_pages * 2 == bf16.kv_pool // bf16.kv_pages
    assert fp8.kv_pages in (2 * bf16.kv_pages, 2 * bf16.kv_pages + 1)
    assert auto.kv_pages == bf16.kv_pages  # the model's dtype: llama70b's bf16
    assert fp8.weights == bf16.weights


def test_int8_kv_cache_pages_pay_for_their_scales():
    """--kv-cache-dtype int8: a (token, KV head) row is head_dim int8 values and a 4-byte
    scale, so the same pool bytes hold 2 * head_dim / (head_dim + 4) times a bf16 pool's
    pages (llama70b's head_dim 128: 1.94x); the per-token bytes say the same."""
    cfg = load_config(ROOT / "configs/llama70b.py")
    bf16 = plan_memory(cfg.override(kv_cache_memory_bytes=FIXED_POOL, cache_dtype="bfloat16"))
    int8 = plan_memory(cfg.override(kv_cache_memory_bytes=FIXED_POOL, cache_dtype="int8"))
    assert int8.kv_bytes_per_token_total * 256 == bf16.kv_bytes_per_token_total * 132
    want = bf16.kv_pages * 256 / 132
    assert abs(int8.kv_pages - want) <= 1 + want * 1e-6
    assert int8.weights == bf16.weights


def test_kv_pool_from_gpu_memory_utilization():
    cfg = load_config(ROOT / "configs/llama70b.py")
    assert cfg.engine.cache.kv_cache_memory_bytes is None, "the config sizes from memory"
    fixed = plan_memory(cfg.override(kv_cache_memory_bytes=FIXED_POOL))
    auto = cfg.replace(engine=cfg.engine.override(gpu_memory_utilization=0.8))
    plan = plan_memory(auto, device_bytes=80 * GiB)
    free = int(0.8 * 80 * GiB) - plan.weights - plan.activations
    page = plan.kv_pool // plan.kv_pages
    assert free - page < plan.kv_pool <= free                        # the pool fills the rest
    assert plan.weights == fixed.weights and plan.total <= 0.8 * 80 * GiB
    with pytest.raises(ConfigError, match="device memory is unknown: give kv_cache_memory_bytes"):
        plan_memory(auto)
    with pytest.raises(ConfigError, match="leaves no room for the KV pool: the weights take 16.43 GiB"):
        plan_memory(auto, device_bytes=16 * GiB)
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be in"):
        cfg.engine.override(gpu_memory_utilization=1.5)


@pytest.mark.parametrize("tp", [1, pytest.param(3, marks=pytest.mark.full)])
def test_plan_matches_the_built_engine_on_this_machine(tp, smollm2_checkpoint, cache_dir):
    """configs/smollm2_135m.py (Q4_1 blocks in the C++ kernel's panels, bf16 KV) planned
    for CPU against the engine built on 4 simulated devices: weights and KV pool per device
    exactly, and the plan's total within 10% of the largest compiled step's own peak
    (arguments, temporaries, outputs not aliased). Measured: 2.9% over (TP 1), 0.5% under
    (TP 3); with bf16 weight copies (configs/smollm2_135m_bf16.py) 0.3% and 5.6% under."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "memory_check.py"), str(tp),
                           str(cache_dir)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    plan, got = r["plan"], r["measured"]
    assert plan["weights"] == got["weights"] and plan["kv_pool"] == got["kv_pool"], r
    assert abs(plan["total"] - got["step_peak"]) <= 0.10 * got["step_peak"], r


def test_tp16_repeats_llama70b_kv_heads_in_the_plan():
    """8 KV heads over 16 devices: each repeated over 2 (one per device), so the KV bytes
    per token double and every device holds one head's share of the pool."""
    cfg = load_config(ROOT / "configs/llama70b.py").override(tensor_parallel_size=16,
                                                             kv_cache_memory_bytes=FIXED_POOL)
    plan = plan_memory(cfg)
    assert plan.kv_bytes_per_token_total == 2 * 80 * 16 * 128 * 2
    assert plan.kv_pool == plan.kv_pages * 16 * plan.kv_bytes_per_token_total // 16
    assert not plan.replicated_leaves


# --- the plan against what the devices have (issue: memory that is planned) -------------------

def _llama70b_2_layers(**fields):
    """configs/llama70b.py at 2 layers (TP 8), as `--load-format dummy --num-layers 2`."""
    cfg = load_config(ROOT / "configs/llama70b.py").override(num_layers=2, **fields)
    return cfg, cfg.model.replace(num_layers=2)


def test_a_pool_that_does_not_fit_is_refused_with_the_largest_that_does():
    from jaxserve.worker.memory_plan import check_fits
    device = 2 * GiB  # each CPU device's share of the host
    cfg, model = _llama70b_2_layers(kv_cache_memory_bytes=8 * 40 * GiB)
    plan = plan_memory(cfg, model, "cpu", device)
    with pytest.raises(ConfigError) as e:
        check_fits(plan, device, "each of the 8 CPU devices' share of the host")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("--kv-cache-memory-bytes asks for a KV pool of 343597383680 bytes")
    assert f"has {device} bytes (2.00 GiB) available" in msg
    largest = int(msg.rsplit("the largest --kv-cache-memory-bytes that fits is ", 1)[1])
    fits = plan_memory(cfg.override(kv_cache_memory_bytes=largest), model, "cpu", device)
    check_fits(fits, device)  # the value named fits ...
    assert fits.kv_pages > 0 and fits.total <= device
    over = plan_memory(cfg.override(kv_cache_memory_bytes=largest + plan.page_bytes_total),
                       model, "cpu", device)
    with pytest.raises(ConfigError):  # ... and is the largest: one more page does not
        check_fits(over, device)
    # weights and activations alone over the memory: no pool size helps
    with pytest.raises(ConfigError, match="the model does not fit: .* leaving no room for one KV page"):
        check_fits(plan, plan.weights)


def test_cpu_pool_sizing_without_an_explicit_size():
    from jaxserve.worker.memory_plan import CPU_AUTO_KV_FRACTION, check_fits, round_page_count
    device = 4 * GiB
    cfg, model = _llama70b_2_layers()
    assert cfg.engine.cache.kv_cache_memory_bytes is None
    auto = plan_memory(cfg, model, "cpu", device)
    check_fits(auto, device)
    share = CPU_AUTO_KV_FRACTION * (device - auto.weights - auto.activations)
    per_page = auto.page_bytes_total / auto.kv_split  # one page's bytes on one device
    assert auto.kv_sized_by == "cpu_auto"
    # the share's pages, rounded down to 5 significant bits: at most 1/16 fewer
    whole = int(share // per_page)
    assert auto.kv_pages == round_page_count(whole) and auto.kv_pages.bit_length() > 5
    assert whole * 15 / 16 < auto.kv_pages <= whole
    assert [round_page_count(n) for n in (0, 31, 32, 33, 1000, 2**20 + 2**16 + 1)] == \
        [0, 31, 32, 32, 992, 2**20 + 2**16]
    assert auto.kv_pool + auto.draft_pool <= share
    # a restart finding memory for 100 pages more or less sizes the same pool (its
    # programs' shapes), where the unrounded share's page count moves with it (here
    # `whole` is mid-bucket: 4,096 pages a step of 5 significant bits at this size)
    assert whole - 100 > auto.kv_pages and round_page_count(whole + 100) == auto.kv_pages
    for moved in (-100, 100):
        near = plan_memory(cfg, model, "cpu", int(device + moved * per_page / CPU_AUTO_KV_FRACTION))
        assert near.kv_pages == auto.kv_pages, moved
    # --cpu-kv-cache-space GiB: the pool of all devices together, as vLLM's
    # VLLM_CPU_KVCACHE_SPACE; ignored on GPU, where gpu_memory_utilization sizes it
    space = plan_memory(cfg.override(cpu_kv_cache_space=1.5), model, "cpu", device)
    assert space.kv_sized_by == "cpu_kv_cache_space"
    assert 1.5 * GiB - space.page_bytes_total < space.kv_pages * space.page_bytes_total <= 1.5 * GiB
    gpu = plan_memory(cfg.override(cpu_kv_cache_space=1.5), model, "gpu", 80 * GiB)
    assert gpu.kv_sized_by == "gpu_memory_utilization"
    big = plan_memory(cfg.override(cpu_kv_cache_space=64), model, "cpu", device)
    with pytest.raises(ConfigError, match=r"^--cpu-kv-cache-space 64.00 \(GiB\) does not fit: .* "
                                          r"the largest that fits is \d+\.\d\d$"):
        check_fits(big, device)
    with pytest.raises(ConfigError, match="cpu_kv_cache_space must be > 0"):
        cfg.override(cpu_kv_cache_space=0)


def _cgroup_files(d: Path, limit_file: str, limit: str, usage_file: str, usage: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / limit_file).write_text(limit + "\n")
    (d / usage_file).write_text(usage + "\n")


def test_host_memory_is_the_smaller_of_meminfo_and_the_cgroup_limit(tmp_path, monkeypatch):
    from jaxserve.worker import device_memory as dm
    membership = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    membership.write_text("0::/job\n")
    _cgroup_files(v2 / "job", "memory.max", "3000000000", "memory.current", "1000000000")
    assert dm._cgroup_headroom(v2, membership) == 2_000_000_000
    _cgroup_files(v2 / "job", "memory.max", "max", "memory.current", "1000000000")
    assert dm._cgroup_headroom(v2, membership) is None
    # v1, and a container that sees its own cgroup at the hierarchy's root
    v1 = tmp_path / "v1"
    membership.write_text("4:memory:/outside/path\n1:cpu:/\n")
    v1_files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    _cgroup_files(v1 / "memory", v1_files[0], "5000000000", v1_files[1], "4000000000")
    assert dm._cgroup_headroom(v1, membership) == 1_000_000_000
    _cgroup_files(v1 / "memory", v1_files[0], "9223372036854771712", v1_files[1], "4000000000")
    assert dm._cgroup_headroom(v1, membership) is None
    # the smaller of the two where both are known (fixed readings: MemAvailable read twice
    # moves between the reads while another test process allocates)
    assert 0 < dm.host_available_bytes()
    for meminfo, headroom, want in ((8_000, 3_000, 3_000), (2_000, 3_000, 2_000),
                                    (2_000, None, 2_000), (None, 3_000, 3_000)):
        monkeypatch.setattr(dm, "_meminfo_available", lambda v=meminfo: v)
        monkeypatch.setattr(dm, "_cgroup_headroom", lambda v=headroom: v)
        assert dm.host_available_bytes() == want


def test_plan_memory_prints_the_decision_or_the_refusal(capsys):
    """`jaxserve plan-memory --platform cpu` gives the engine's decision for a memory
    size: the pool it would allocate, or its one-line refusal and exit status 2."""
    from jaxserve.cli.plan_memory import main
    args = ["--config", "llama70b", "--platform", "cpu", "--device-gib", "2",
            "--load-format", "dummy", "--num-layers", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    cfg, model = _llama70b_2_layers()
    plan = plan_memory(cfg, model, "cpu", 2 * GiB)
    assert f"decision: a KV page pool of {plan.kv_pages} pages" in out
    assert main(args + ["--kv-cache-memory-bytes", str(8 * 40 * GiB)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxserve plan-memory: error: --kv-cache-memory-bytes")


def test_plan_memory_agrees_with_the_built_engine(small_llm, capsys):
    """The small test config planned for this machine's CPU by `jaxserve plan-memory`
    has the pool the engine built (the same config, the same decision)."""
    from conftest import SMALL_CONFIG

    from jaxserve.cli.plan_memory import main
    assert main(["--config", str(SMALL_CONFIG), "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"decision: a KV page pool of {small_llm.engine.runner.cache.num_pages} pages" in out


@pytest.mark.parametrize("name", shipped_config_names())
def test_every_shipped_config_gets_a_decision_on_this_machine(name, capsys, smollm2_checkpoint):
    """Each shipped config, as `jaxserve serve --config NAME` on this machine's CPU would
    decide: a pool, or (a GPU config's explicit pool larger than this host) the one-line
    refusal naming the flag. Never a traceback."""
    from jaxserve.cli.plan_memory import main
    code = main(["--config", name, "--platform", "cpu"])  # a config's own shape: no weights
    out, err = capsys.readouterr()
    assert (code, "decision: a KV page pool of" in out) in ((0, True), (2, False)), (out, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err
        assert "does not fit" in err or "leaves no room for the KV pool" in err, err
