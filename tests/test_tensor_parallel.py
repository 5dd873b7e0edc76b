"""Tensor parallel 2 and 4 on 4 simulated CPU devices (a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4) give the logits of tensor parallel 1.

tests/tp_check.py runs the paged forward (prefill + decode) under each mesh and reports the
largest logit difference, which weights were really split, and the f32 noise floor: TP 1
against itself with the sequence batched beside others (only the reduction order changes).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TP_CHECK = Path(__file__).resolve().parent / "tp_check.py"


def on_4_devices(script: Path, *args: str) -> dict:
    """The JSON last line of `script args` run in a subprocess on 4 simulated CPU devices."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    return result


def tp_check(source: str, variant: str, tps: str, cache_dir, reference: str | None = None) -> dict:
    return on_4_devices(TP_CHECK, source, variant, tps, str(cache_dir), *([reference] if reference else []))


def reordered_f32_bound(r: dict) -> float:
    """How far, relative to the largest |value|, TP's reordered f32 sums may move a deep
    model's residual stream and logits: a dot product of k terms summed in another order
    changes by ~sqrt(k) u of its terms' scale (u = 2^-24; Higham & Mary, "A new approach to
    probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019), and each of
    the L layers adds its change to the residual stream: L sqrt(k) u. For SmolLM2 (30
    layers, k = 1,536) 7.0e-5. A wrong shard moves values by whole units."""
    return r["num_layers"] * math.sqrt(r["max_reduction"]) * 2.0 ** -24


@pytest.mark.full  # fast tier: the real model under TP 3 (test_real_model_cpp_kernels_per_device_under_tp3)
@pytest.mark.parametrize("variant", ["xla", "cpu", "int8"])
def test_tiny_model_tp2_tp4_and_pipeline_stages_match_tp1(variant, cache_dir):
    """Each kernel family under shard_map (XLA; the C++ attention and packed bf16 matmuls,
    fused per shard; int8 weights) on 8 query / 4 KV heads, every axis divisible by 4.
    And TP 2 x PP 2 on the 3 layers (stage 1's second slot a zero layer) with 1 and 4
    microbatches for every step (the 80-row prefill in 20-row pieces cuts the 40-token
    prompt; decode splits the 4 sequences) and the defaults (4 for the prefill, 1 for
    decode), against TP 1 running the same batch."""
    pipelines = ("2x2m1", "2x2", "2x2m4")
    r = tp_check("tiny", variant, ",".join(("2", "4") + pipelines), cache_dir)
    for tp in ("2", "4"):
        for name in ("wq", "wo", "w_gate", "w_down"):
            assert f"layers.0.{name}" in r["sharded"][tp], (tp, name)
        # f32 reduction order only (YNNPACK's split of a dot over threads can vary run to
        # run, TP adds partial sums): measured up to 1.1e-5 on logits of |5.5|, i.e. a few
        # ulp; a sharding bug moves them by O(1)
        assert r["diff"][tp] <= 1e-5 * max(1.0, r["max_abs_logit"]), r
        assert r["feature_diff"][tp] <= 1e-5 * max(1.0, r["max_abs_feature"]), r
    for mesh in pipelines:
        assert {"layers.0.wo", "layers.0.w_down"} <= set(r["sharded"][mesh])  # by stage
        assert r["diff"][mesh] <= 1e-5 * max(1.0, r["max_abs_logit"]), r


@pytest.mark.full  # fast tier: the GGUF blocks on one device (test_gguf_serving.py)
def test_gguf_block_weights_split_over_devices_in_whole_blocks(cache_dir):
    """Every projection, the embedding and the LM head in GGUF blocks (each format): rows
    of column-parallel weights and whole 32-wide blocks of row-parallel ones (wo, w_down)
    per device, the vocab-parallel lookup and head over block rows; TP 2 / 4 and TP 2 x
    PP 2 give TP 1's logits."""
    r = tp_check("tiny-gguf", "xla", "2,4,2x2,2x2m4", cache_dir)
    for mesh in ("2", "4", "2x2", "2x2m4"):
        assert {"embed", "layers.0.wq", "layers.0.wo", "layers.0.w_down"} <= set(r["sharded"][mesh])
        assert r["diff"][mesh] <= 1e-5 * max(1.0, r["max_abs_logit"]), r


@pytest.mark.full  # fast tier: the real model under TP 3 (test_real_model_cpp_kernels_per_device_under_tp3)
@pytest.mark.parametrize("variant", ["xla", "cpu"])
def test_fewer_kv_heads_than_devices_are_repeated(variant, cache_dir):
    """8 query / 2 KV heads at TP 4: each KV head repeated over the 2 devices whose query
    heads read it (vLLM's replication), so wk / wv and the KV pool split one head per
    device; at TP 2 they split as usual. Both give TP 1's logits."""
    r = tp_check("tiny-gqa", variant, "2,4", cache_dir)
    for tp in ("2", "4"):
        assert {"layers.0.wo", "layers.0.w_down"} <= set(r["sharded"][tp])
        assert r["diff"][tp] <= 1e-5 * max(1.0, r["max_abs_logit"]), r
    if variant == "xla":  # unfused: the KV projections are their own leaves
        assert {"layers.0.wk", "layers.0.wv"} <= set(r["sharded"]["4"])


@pytest.mark.full  # fast tier: the fused projections on one device (test_model.py)
@pytest.mark.parametrize("variant,reference", [("fused", "xla"), ("int8_fused", "int8_g16")])
def test_fused_projections_split_per_shard_give_the_unfused_logits(variant, reference,
                                                                    cache_dir):
    """wq | wk | wv and w_gate | w_up fused (KernelConfig.fuse_projections, the GPU
    default), their columns grouped per shard, in the model dtype and quantised after
    fusing (int8, groups of 16 input rows): at TP 1, 2 and 4 (8 query / 2 KV heads, the
    KV heads repeated at TP 4) the logits of the unfused model on one device, and the
    fused matrices split over the devices."""
    r = tp_check("tiny-gqa", variant, "1,2,4", cache_dir, reference=reference)
    for tp in ("1", "2", "4"):
        assert r["diff"][tp] <= 1e-5 * max(1.0, r["max_abs_logit"]), r
    for tp in ("2", "4"):
        assert {"layers.0.wq", "layers.0.w_gate", "layers.0.wo"} <= set(r["sharded"][tp]), r
        assert "layers.0.wk" not in r["sharded"][tp]  # fused into wq


@pytest.mark.full  # fast tier: the XLA path under shard_map
def test_pallas_kernels_in_interpret_mode_under_shard_map_equal_the_xla_path(cache_dir):
    """Pallas attention (flash prefill, paged decode) and the Pallas int8 matmul, in
    interpret mode, each device on its own heads and columns, against the XLA path (int8
    reference matmul) on one device."""
    r = tp_check("tiny", "pallas", "2,4", cache_dir, reference="int8")
    for tp in ("2", "4"):
        assert "layers.0.wq" in r["sharded"][tp] and "layers.0.w_down" in r["sharded"][tp]
        assert r["diff"][tp] <= 1e-5 * max(1.0, r["max_abs_logit"]), r


@pytest.mark.full  # fast tier: the real model under TP 3 with the C++ kernels
def test_real_model_tp2_tp3_tp4_match_tp1(smollm2_checkpoint, cache_dir):
    """And 4 pipeline stages (TP 1 x PP 4, 4 microbatches) on the batch of 4 sequences."""
    r = tp_check(str(smollm2_checkpoint), "xla", "2,3,4,1x4m4", cache_dir)
    # SmolLM2's 9 query / 3 KV heads split over 3 devices and stay replicated over 2 or 4;
    # the MLP, the embedding and the LM head split over all three sizes.
    assert {"layers.0.wq", "layers.0.wo"} <= set(r["sharded"]["3"])
    for tp in ("2", "3", "4"):
        assert {"embed", "layers.0.w_gate", "layers.0.w_up", "layers.0.w_down"} <= set(r["sharded"][tp])
        # |logits| reach ~32 here, where one f32 ulp is 3.8e-6: TP's changed reduction order
        # moves logits by f32 rounding alone, how far depending on the CPU's code (2.2e-4 on
        # Zen 4); a wrong shard moves them by whole units.
        assert r["diff"][tp] <= reordered_f32_bound(r) * r["max_abs_logit"], r
    # the pipeline splits the batch differently, which is the noise floor's own change
    assert r["diff"]["1x4m4"] <= reordered_f32_bound(r) * r["max_abs_logit"], r


def test_real_model_cpp_kernels_per_device_under_tp3(smollm2_checkpoint, cache_dir):
    """The C++ attention kernel and packed bf16 matmuls, each device running its own 3
    query heads / KV head and MLP columns, against the same kernels on one device. They
    are batch-invariant (noise floor 0); TP 3's partial sums of wo and w_down change the
    order of the f32 sums, so the bound is the XLA test's, reordered_f32_bound (measured:
    3.2e-4 on |logits| of 32 on an AMX Xeon, 1.0e-5 of them)."""
    r = tp_check(str(smollm2_checkpoint), "cpu", "3", cache_dir)
    assert {"layers.0.wq", "layers.0.wo", "layers.0.w_down"} <= set(r["sharded"]["3"])
    assert r["diff"]["3"] <= reordered_f32_bound(r) * r["max_abs_logit"], r
    # the residual streams entering layers 0 and 29 (what an EAGLE-3 head reads) come out
    # of the shard_map replicated and TP 1's, to the same relative bound (measured: 0.080
    # in the massive-activation channel, 6,888, of |features| up to 7,563 on that Xeon)
    assert r["feature_diff"]["3"] <= reordered_f32_bound(r) * r["max_abs_feature"], r


@pytest.mark.full  # fast tier: the real model under TP 3 with the C++ kernels
def test_real_model_engine_greedy_is_the_same_under_tp2_tp3_and_pipeline_stages(smollm2_checkpoint, cache_dir):
    """The whole engine (jaxserve.LLM: scheduler, runner, sampler) on 4 simulated devices:
    TP 3 splits SmolLM2's 9 query / 3 KV heads and the KV pool over the devices, TP 2
    replicates the heads (3 KV heads do not split over 2) and splits the MLP and the
    vocabulary (TP 4 serves in tests/test_distributed.py); all give TP 1's greedy tokens
    for a batch of prompts, TP 2 with XLA kernels and TP 3 with the config's (the C++
    attention kernel, each device on its own heads, and the C++ matmul on each device's
    f32 panels; XLA's at TP 3:
    test_real_model_tp2_tp3_tp4_match_tp1's logits). Pipeline stages: TP 1 x PP 4 (the
    default kernels; 30 layers as 4 stages of 8 slots, the last two zero layers; the
    default microbatches: a prefill split in 4 or 8, the prompts cut between them, decode
    whole) gives the same tokens, each device holding its stage's layers and pool (TP 2 x
    PP 2: over two processes in tests/test_distributed.py, and with XLA kernels on the
    tiny model in test_tiny_model_tp2_tp4_and_pipeline_stages_match_tp1). Embeddings (mean
    pooling) equal in every run (f32 reduction order: 1e-4)."""
    r = on_4_devices(TP_CHECK.parent / "tp_engine_check.py", str(cache_dir))
    t = r["tokens"]
    assert all(t["xla-1"]) and sum(map(len, t["xla-1"])) >= 48
    assert t["xla-2"] == t["xla-1"]
    assert t["auto-3"] == t["auto-1"]
    assert r["attention"]["auto-3"] == "cpu" and r["attention"]["xla-2"] == "xla"
    assert "model" in r["wq"]["auto-3"] and "model" in r["kv"]["auto-3"]  # heads and pool split
    for name in ("xla-2",):  # replicated heads
        assert "model" not in r["wq"][name] and "model" not in r["kv"][name]
    # (TP 1 x PP 4 with XLA kernels: tp_check's logits, test_real_model_tp2_tp3_tp4_match_tp1;
    # TP 2 x PP 2: test_distributed's two processes, and the tiny model's here)
    assert t["auto-1x4"] == t["auto-1"]
    assert r["wq"]["auto-1x4"].startswith("P('stage'"), r["wq"]
    assert r["kv"]["auto-1x4"].startswith("P('stage'"), r["kv"]
    assert r["attention"]["auto-1x4"] == "cpu"
    # loaded on its stage's device only (layer i on device i // 8), and after stacking
    # device 0 holds the embedding and its 8 layer slots, not all 30 layers
    assert r["loaded_on"] == [[i // 8] for i in range(30)]
    b = r["device0_bytes"]
    assert b["auto-1x4"] == b["auto-1"] - (30 - 8) * r["layer_bytes"], (b, r["layer_bytes"])
    ref = np.array(r["embeddings"]["xla-1"])
    assert ref.shape == (4, 576)
    for name, got in r["embeddings"].items():
        np.testing.assert_allclose(np.array(got), ref, atol=1e-4, err_msg=name)


@pytest.mark.full  # fast tier: the real model under TP 3 with the C++ kernels
def test_real_model_eagle_speculation_under_tp3_gives_tp1_greedy_tokens(smollm2_checkpoint,
                                                                         cache_dir):
    """Speculative decoding with the EAGLE head at TP 3 (its layer, KV pool, embedding
    lookup and draft LM head per device): TP 1's greedy tokens, drafts accepted."""
    r = on_4_devices(TP_CHECK.parent / "tp_spec_check.py", str(cache_dir))
    assert r["tokens"]["3"] == r["tokens"]["1"] and sum(map(len, r["tokens"]["1"])) == 48
    assert r["accepted"]["3"] > 0 and r["accepted"]["1"] > 0


@pytest.mark.full  # fast tier: the adapters' exactness on one device (tests/test_lora_real.py)
def test_lora_adapters_under_tp2_tp3_give_tp1_tokens(smollm2_checkpoint, cache_dir, tmp_path):
    """Two adapters and the base in one batch on the real model at TP 1, 2 and 3 (XLA
    kernels), and TP 3 with the default kernels: the same greedy tokens, logprobs within
    the f32 reduction-order noise (TP adds partial sums: 1e-4), and the adapters matter;
    the pools split as the base weights: wq's B over its output heads and wo's A over its
    input heads at TP 3 (replicated at TP 2, where the heads are), w_down's A over the MLP
    at TP 2 and 3, the column-parallel A (wq) replicated."""
    import numpy as np
    r = on_4_devices(TP_CHECK.parent / "lora_tp_check.py", str(cache_dir), str(tmp_path))
    t, lp, s = r["tokens"], r["logprobs"], r["specs"]
    for run in ("xla-2", "xla-3", "auto-3"):
        assert t[run] == t["xla-1"], run
        for a, b in zip(lp[run], lp["xla-1"]):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    base_t, base_lp = r["base_tokens"]["xla-1"], r["base_logprobs"]["xla-1"]
    assert t["xla-1"][2] == base_t[2]  # the base row
    for i in (0, 1, 3):  # the adapters matter: other tokens, or the same with other logprobs
        assert t["xla-1"][i] != base_t[i] or np.abs(np.subtract(lp["xla-1"][i], base_lp[i])).max() > 1e-2
    for run in ("xla-3", "auto-3"):
        assert "model" in s[run]["wq.b"] and "model" in s[run]["wo.a"], s[run]
        assert "model" in s[run]["w_down.a"] and "model" not in s[run]["wq.a"], s[run]
    assert "model" not in s["xla-2"]["wq.b"] and "model" in s["xla-2"]["w_down.a"], s["xla-2"]
