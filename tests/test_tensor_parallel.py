"""Tensor parallel 2 and 4 on 4 simulated CPU devices (a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4) give the logits of tensor parallel 1.

tests/tp_check.py runs the paged forward (prefill + decode) under each mesh and reports the
largest logit difference, which weights were really split, and the f32 noise floor: TP 1
against itself with the sequence batched beside others (only the reduction order changes).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TP_CHECK = Path(__file__).resolve().parent / "tp_check.py"


def on_4_devices(script: Path, arg: str) -> dict:
    """The JSON last line of `script arg` run in a subprocess on 4 simulated CPU devices."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), arg], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    return result


def tp_check(source: str) -> dict:
    return on_4_devices(TP_CHECK, source)


@pytest.mark.slow
def test_tiny_model_tp2_tp4_match_tp1():
    r = tp_check("tiny")  # 8 query / 4 KV heads, every axis divisible by 4
    for tp in ("2", "4"):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            assert f"layers.0.{name}" in r["sharded"][tp], (tp, name)
        # f32 reduction order only (YNNPACK's split of a dot over threads can vary run to
        # run): measured up to 1.1e-5 on logits of |5.5|, i.e. a few ulp; a sharding bug
        # moves them by O(1)
        assert r["diff"][tp] <= 1e-5 * max(1.0, r["max_abs_logit"]), r


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_tp2_tp4_match_tp1(smollm2_checkpoint):
    r = tp_check(str(smollm2_checkpoint))
    # SmolLM2's 9 query / 3 KV heads do not split over 2 or 4 devices (replicated); the MLP,
    # the embedding and the LM head do.
    for tp in ("2", "4"):
        assert {"embed", "layers.0.w_gate", "layers.0.w_up", "layers.0.w_down"} <= set(r["sharded"][tp])
        # |logits| reach ~32 here, where one f32 ulp is 3.8e-6: TP's changed reduction order
        # moves logits as much as batching the sequence beside others does on one device.
        assert r["diff"][tp] <= 1e-5 * r["max_abs_logit"], r
        assert r["diff"][tp] <= 2 * max(r["noise_floor"], 1e-6), r


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_engine_greedy_is_the_same_under_tp2_and_tp3(cache_dir):
    """The whole engine (jaxserve.LLM: scheduler, runner, sampler) on 4 simulated devices:
    TP 3 splits SmolLM2's 9 query / 3 KV heads and the KV pool over the devices, TP 2
    replicates the heads (3 KV heads do not split over 2) and splits the MLP; both give TP
    1's greedy tokens for a batch of prompts."""
    r = on_4_devices(TP_CHECK.parent / "tp_engine_check.py", str(cache_dir))
    assert all(r["tokens"]["1"]) and sum(map(len, r["tokens"]["1"])) >= 48
    assert r["tokens"]["2"] == r["tokens"]["1"] and r["tokens"]["3"] == r["tokens"]["1"]
    assert "model" in r["wq"]["3"] and "model" in r["kv"]["3"]   # heads and pool split
    assert "model" not in r["wq"]["2"] and "model" not in r["kv"]["2"]  # replicated
