"""The distributed path from the command line: serve.py's model, load and parallel flags
(vLLM's names), the deployment errors they give, and big configs on simulated devices."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "serve.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_config_without_weights_says_how_to_get_them():
    proc = _serve("--config", "configs/llama70b.py", "--port", "1")
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert "Config 'llama70b' has no weights: give --model PATH" in err[-1]
    assert "--load-format dummy" in err[-1]


def test_bad_deployment_flags_are_one_line_errors(tmp_path):
    proc = _serve("--config", "configs/llama70b.py", "--tensor-parallel-size", "0")
    assert proc.returncode == 2 and "ParallelConfig.tensor_parallel_size must be > 0" in proc.stderr
    proc = _serve("--config", "configs/llama70b.py", "--num-layers", "81")
    assert proc.returncode == 2 and "Config.num_layers=81 exceeds the model's 80 layers" in proc.stderr
    proc = _serve("--config", "configs/llama70b.py", "--model", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "no such model directory or .gguf file" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_llama70b_two_layers_dummy_weights_tp8_serves_a_completion(tmp_path, cache_dir):
    """configs/llama70b.py itself (hidden 8192, 64 query / 8 KV heads, vocab 128256),
    shrunk to 2 layers, dummy weights made on 8 simulated devices and split over them
    (TP 8, one KV head per device), served by serve.py: a completion comes back, the
    placeholder tokenizer decoding the ids. ~8 GB of host memory (the weights)."""
    import httpx

    bench_serving = _tool("bench_serving")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "serve.log"
    proc, url, _ = bench_serving.launch(
        ROOT / "configs/llama70b.py", cache_dir, log_path=log, env=env,
        extra_args=["--load-format", "dummy", "--num-layers", "2",
                    "--kv-cache-memory-bytes", str(64 * 2**20), "--max-model-len", "256",
                    "--max-num-seqs", "4", "--max-num-batched-tokens", "64"])
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, f"serve.py exited:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(url.removesuffix("/v1") + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        r = httpx.post(url + "/completions", timeout=300, json={
            "model": "Meta-Llama-3.1-70B-Instruct", "prompt": "The capital of France is",
            "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["text"].strip()
        assert "tensor parallel 8 over cpu devices" in log.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_llama70b_tp8_step_lowers_for_cuda_without_gathering_weights_or_kv():
    """The whole TP 8 llama70b step (80 layers, Pallas attention, abstract shapes) lowered
    for CUDA on this machine: every weight and KV pool argument enters its shard_map on the
    sharding it has (nothing for the partitioner to gather), no all-gather, two
    all-reduces per layer (after wo and w_down) and one for the embedding. Compiled for 8
    CPU devices (2 layers, XLA kernels), the partitioner adds all-gathers only of the
    [rows, vocab] logits, for the sampler's top-k / top-p over whole rows."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_lowering_check.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 8 and r["control_mismatched"]  # the check can fail
    for kind, c in r["cuda"].items():
        assert c["layers"] == 80 and c["triton"] >= 1, (kind, c)
        assert c["args_checked"] >= 80 * 9 + 2 * 80 and c["mismatched"] == [], (kind, c)
        assert c["all_gather"] == 0 and c["all_reduce"] == 2 * 80 + 1, (kind, c)
    for kind, c in r["cpu"].items():
        assert c["all_gather_shapes"], kind
        for shape in c["all_gather_shapes"]:
            assert re.fullmatch(rf"f32\[\d+,{r['vocab']}\]", shape), (kind, shape)
