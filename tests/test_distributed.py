"""The distributed path from the command line: serve.py's model, load and parallel flags
(vLLM's names), the deployment errors they give, and big configs on simulated devices."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


# Runs `jaxserve serve`'s main on each argv of a JSON list in one process (one JAX import for
# all the cases); prints [[exit status, stderr], ...] as JSON.
_MAIN_PER_ARGV = """
import contextlib, io, json, sys
from jaxserve.cli.serve import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_bad_deployment_flags_are_one_line_errors(tmp_path):
    """Each refused before anything is built, in one line (argparse's usage, then the
    error naming the field or flag), exit status 2."""
    cases = [
        (["--tensor-parallel-size", "0"], "ParallelConfig.tensor_parallel_size must be > 0"),
        (["-pp", "0"], "ParallelConfig.pipeline_parallel_size must be > 0"),
        (["--num-layers", "81"], "Config.num_layers=81 exceeds the model's 80 layers"),
        (["--model", str(tmp_path / "nothing")], "no such model directory or .gguf file"),
        (["--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1"],
         "--node-rank must be in 0..1"),
        (["--nnodes", "2", "--dist-init-addr", "nohost"], "--dist-init-addr must be HOST:PORT"),
    ]
    argvs = [["--config", "configs/llama70b.py", *args] for args, _ in cases]
    proc = subprocess.run([sys.executable, "-c", _MAIN_PER_ARGV, json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (args, want), (code, err) in zip(cases, json.loads(proc.stdout.strip().splitlines()[-1]),
                                         strict=True):
        assert code == 2 and "Traceback" not in err, (args, code, err[-2000:])
        assert err.strip().splitlines()[-1].startswith("jaxserve serve: error: "), (args, err)
        assert want in err.strip().splitlines()[-1], (args, err)


def test_a_pool_larger_than_the_host_is_refused_before_anything_is_allocated(tmp_path):
    """configs/llama70b.py's former 40 GiB per device, asked for on 8 simulated CPU devices
    of this host: one line naming the flag, the bytes asked and available and the largest
    that fits; exit status 2; refused before the weights are made (no OOM kill)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "serve.py"), "--config", "llama70b",
                           "--load-format", "dummy", "--num-layers", "2",
                           "--kv-cache-memory-bytes", str(8 * 40 * 2**30)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxserve serve: error: --kv-cache-memory-bytes asks for a KV pool "
                           "of 343597383680 bytes (320.00 GiB over all devices) that does not "
                           "fit: each of the 8 CPU devices' share of the host has "), last
    assert re.search(r"the largest --kv-cache-memory-bytes that fits is \d+$", last), last
    assert "dummy weights" not in proc.stderr and "KV page pool" not in proc.stderr


@pytest.mark.full  # fast tier: two processes serve and stop (SIGTERM)
def test_llama70b_two_layers_dummy_weights_tp8_serves_a_completion(tmp_path, cache_dir, capsys):
    """configs/llama70b.py itself (hidden 8192, 64 query / 8 KV heads, vocab 128256),
    shrunk to 2 layers, dummy weights made on 8 simulated devices and split over them
    (TP 8, one KV head per device), served by serve.py: a completion comes back, the
    placeholder tokenizer decoding the ids. ~8 GB of host memory (the weights), and a KV
    pool sized from what the host has left (no --kv-cache-memory-bytes: the config sizes
    it from memory), as `jaxserve plan-memory --platform cpu` plans it for the memory the
    server found. Without the huge-page advice (KernelConfig.cpu_huge_pages, a speed hint
    tested in tests/test_huge_pages.py): collapsing these 8 GiB of dummy weights took 16 s
    of the test's 38."""
    from jaxserve.cli.plan_memory import main as plan_memory_main
    import httpx

    from jaxserve.bench import serve as bench_serving
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "serve.log"
    config = tmp_path / "llama70b.py"
    config.write_text("from jaxserve.config import load_config\n"
                      "CONFIG = load_config('llama70b').override(cpu_huge_pages=False)\n")
    proc, url, _ = bench_serving.launch(
        config, cache_dir, log_path=log, env=env,
        extra_args=["--load-format", "dummy", "--num-layers", "2", "--max-model-len", "256",
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
        text = log.read_text()
        assert "tensor parallel 8 x pipeline parallel 1 over cpu devices" in text
        pages = int(re.search(r"KV page pool: (\d+) pages of 16 tokens \(\d+ MiB, sized by "
                              r"cpu_auto\)", text).group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # the plan of the same flags for the memory the server found (logged to 0.01 GiB; the
    # host's available memory moves with what other tests hold, so it is not re-measured)
    available = float(re.search(r"GiB per device planned of ([\d.]+) GiB available",
                                text).group(1))

    def planned(device_gib):
        capsys.readouterr()
        assert plan_memory_main([
            "--config", "llama70b", "--platform", "cpu", "--device-gib", str(device_gib),
            "--load-format", "dummy", "--num-layers", "2", "--max-model-len", "256",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]) == 0
        return int(re.search(r"decision: a KV page pool of (\d+) pages",
                             capsys.readouterr().out).group(1))

    assert planned(available - 0.005) <= pages <= planned(available + 0.005), pages


@pytest.mark.full  # fast tier: two processes serve and stop (SIGTERM)
def test_llama70b_tp8_step_lowers_for_cuda_without_gathering_weights_or_kv():
    """The whole TP 8 llama70b step (80 layers, Pallas attention, abstract shapes) lowered
    for CUDA on this machine: every weight and KV pool argument enters its shard_map on the
    sharding it has (nothing for the partitioner to gather), no all-gather, two
    all-reduces per layer (after wo and w_down) and one for the embedding. Compiled for 8
    CPU devices (2 layers, XLA kernels), the partitioner adds all-gathers only of the
    [rows, vocab] logits, for the sampler's top-k / top-p over whole rows. At TP 8 x PP 2
    (16 devices) the decode step's stage-stacked weights and pool enter likewise, with
    one loop body of 40 layers (two all-reduces each), the stage hand-off a
    collective permute."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=16",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_lowering_check.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["devices"] == 16 and r["control_mismatched"]  # the check can fail
    for kind, c in r["cuda"].items():
        assert c["layers"] == 80 and c["triton"] >= 1, (kind, c)
        assert c["args_checked"] >= 80 * 9 + 2 * 80 and c["mismatched"] == [], (kind, c)
        assert c["all_gather"] == 0 and c["all_reduce"] == 2 * 80 + 1, (kind, c)
    pp = r["cuda_pp"]
    assert pp["args_checked"] >= 40 * 9 + 2 * 40 and pp["mismatched"] == [], pp
    # 40 local layers x 2, the embedding's, and the sum of the last stage's outputs
    assert pp["all_gather"] == 0 and pp["all_reduce"] == 2 * 40 + 2, pp
    assert pp["collective_permute"] >= 1 and pp["triton"] >= 1, pp
    for kind, c in r["cpu"].items():
        assert c["all_gather_shapes"], kind
        for shape in c["all_gather_shapes"]:
            assert re.fullmatch(rf"f32\[\d+,{r['vocab']}\]", shape), (kind, shape)


# --- several processes (jax.distributed over gloo, the step channel) ------------------------

SMALL = ROOT / "tests" / "configs" / "smollm2_two_shapes.py"  # 2 step shapes per process
PROMPTS = ["The capital of France is", "Write a haiku about rain.",
           "List three prime numbers and explain why each is prime.", "def fibonacci(n):"]


def _launch_pair(tmp_path, cache_dir, parallel=("--tensor-parallel-size", "4"), config=SMALL):
    """serve.py as 2 processes x 2 simulated CPU devices (default TP 4 over both) on
    localhost; returns (processes, API base URL, logs) once process 0 is ready."""
    import httpx

    from jaxserve.bench import serve as bench_serving
    port, coord = bench_serving.free_port(), bench_serving.free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    for rank in (0, 1):
        logs.append(tmp_path / f"rank{rank}.log")
        with logs[-1].open("w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "serve.py"), "--config", str(config), "--port",
                 str(port), "--cache-dir", str(cache_dir), *parallel,
                 "--dist-init-addr", f"127.0.0.1:{coord}", "--nnodes", "2", "--node-rank",
                 str(rank)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        for p, log in zip(procs, logs):
            assert p.poll() is None, f"a process exited:\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(base + "/ready", timeout=5).status_code == 200:
                return procs, base + "/v1", logs
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready:\n{logs[0].read_text()[-4000:]}"
        time.sleep(0.5)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _exit_within(proc, seconds: float) -> int | None:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def _complete_all(url: str) -> list[str]:
    """Greedy completions of PROMPTS, sent concurrently."""
    import concurrent.futures

    import httpx

    def complete(prompt):
        r = httpx.post(url + "/completions", timeout=300, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 24,
            "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(complete, PROMPTS))


@pytest.mark.full  # fast tier: two processes serve and stop (SIGTERM)
def test_two_processes_serve_the_real_model_tp4_and_stop_when_a_follower_dies(
        tmp_path, cache_dir, small_llm):
    """2 processes x 2 devices, TP 4 over all of them: process 0 serves HTTP and schedules,
    process 1 runs each step process 0 sends it, here with GPUs' defaults: the sampler's
    branches decided on the host (KernelConfig.branches "host": each step's sampler
    program is its plan's, the prompt logprobs a program of their own, on both processes)
    and a plain one-token decode step in one program (CompilationConfig.fused_decode).
    Greedy completions of a batch of concurrent requests equal one process's
    (jaxserve.LLM, TP 1, the device deciding); when process 1 is killed process 0 exits
    within seconds, saying which process is gone."""
    from jaxserve.sampling_params import SamplingParams

    want = [c.text for c in small_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    config = tmp_path / "host_branches.py"
    config.write_text("from jaxserve.config import load_config\n"
                      f"CONFIG = load_config({str(SMALL)!r}).override(branches='host', "
                      "fused_decode=True)\n")
    procs, url, logs = _launch_pair(tmp_path, cache_dir, config=config)
    try:
        assert _complete_all(url) == want
        assert "step channel: 1 followers connected" in logs[0].read_text()
        assert "n=1 rounds=1 plan=" in logs[1].read_text()  # (the follower's programs)
        assert " whole=True " in logs[1].read_text()
        procs[1].kill()
        t0 = time.monotonic()
        assert _exit_within(procs[0], 15) == 3, logs[0].read_text()[-2000:]
        assert time.monotonic() - t0 < 15
        assert "process 1 of 2 is gone: stopping" in logs[0].read_text()
    finally:
        _stop(procs)


@pytest.mark.full  # fast tier: two processes serve and stop (SIGTERM)
def test_two_processes_tp2_pp2_serve_and_a_follower_exits_when_process_0_dies(
        tmp_path, cache_dir, small_llm):
    """TP 2 x PP 2 over 2 processes x 2 devices: one pipeline stage per process (15
    layers and their pool each), as on 2 hosts; the greedy completions equal one
    process's. Then process 0 dies. It hosts jax.distributed's coordination service too:
    whichever notices first, the step channel's EOF (our error, status 3) or the
    coordination service's health check (JAX aborts the process: "another task died"),
    the follower is gone within seconds with a message that says why."""
    from jaxserve.sampling_params import SamplingParams

    want = [c.text for c in small_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))]
    procs, url, logs = _launch_pair(tmp_path, cache_dir, ("-tp", "2", "-pp", "2"))
    try:
        assert _complete_all(url) == want
        assert "tensor parallel 2 x pipeline parallel 2" in logs[0].read_text()
        procs[0].kill()
        code = _exit_within(procs[1], 15)
        text = logs[1].read_text()
        assert code is not None and code != 0, text[-2000:]
        assert ("process 0 closed the step channel" in text
                or "This most likely indicates that another task died" in text), text[-2000:]
    finally:
        _stop(procs)


def test_sigterm_to_process_0_stops_both_cleanly(tmp_path, cache_dir, smollm2_checkpoint):
    """And the follower compiled its step programs through its executable cache (JAX's
    persistent cache serves process 0 only; jaxserve.worker.executable_cache), where each
    is kept for its next start."""
    import signal

    procs, url, logs = _launch_pair(tmp_path, cache_dir)
    try:
        procs[0].send_signal(signal.SIGTERM)
        codes = (_exit_within(procs[0], 30), _exit_within(procs[1], 30))
        assert codes == (0, 0), (codes, logs[0].read_text()[-1500:], logs[1].read_text()[-1500:])
        follower = logs[1].read_text()
        assert "process 1: process 0 stopped; exiting" in follower
    finally:
        _stop(procs)
    kept = cache_dir / "xla" / "followers" / "process-1"
    assert f"step programs kept in {kept}" in follower
    programs = re.findall(r"step program \w+ .* (?:compiled|read from the executable cache) "
                          r"in [\d.]+ s", follower)
    assert len(programs) >= 2, follower[-3000:]
    assert len(list(kept.glob("*.bin"))) >= len(programs)


@pytest.mark.full  # fast tier: two processes serve and stop (SIGTERM)
def test_loading_onto_a_mesh_streams_group_by_group(tmp_path):
    """tools/measure_loading.py on a 0.9 GiB bf16 Llama (6 layers of 0.11 GiB; embedding +
    LM head 0.24 GiB, the largest group): loading onto 4 devices holds about one layer on
    the host beside what ends up on the devices (at most two), never the model; the
    conversion about its largest group and orbax's copy of it (at most three groups)."""
    proc = subprocess.run([sys.executable, "-m", "tools.measure_loading",
                           "--hidden", "2048", "--intermediate", "8192", "--layers", "6",
                           "--heads", "16", "--kv-heads", "4", "--vocab", "32000", "--tp", "4",
                           "--workdir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    top = 2 * 32000 * 2048 * 2
    assert r["load_resident"] >= r["model_bytes"]  # the weights landed (all 4 devices are local)
    assert r["load_overhead"] <= 2 * r["layer_bytes"], r
    assert r["convert_overhead"] <= 3 * max(top, r["layer_bytes"]), r
    assert r["load_overhead"] < r["model_bytes"] / 4 and r["convert_overhead"] < r["model_bytes"], r


@pytest.mark.full  # fast tier: the adapters on one device (tests/test_lora_real.py)
def test_two_processes_serve_lora_adapters(tmp_path, cache_dir, smollm2_checkpoint):
    """TP 4 over 2 processes x 2 devices with --enable-lora: an adapter from --lora-modules
    and one loaded at run time (POST /v1/load_lora_adapter) are written into both
    processes' slots (the step channel carries each write); greedy completions naming
    them, and the base's, equal one process's (jaxserve.LLM with the same adapters)."""
    import concurrent.futures

    import httpx

    from jaxserve.api import LLM
    from jaxserve.config import load_config
    from jaxserve.engine.builder import resolve_model_config
    from jaxserve.lora import LoRARequest
    from jaxserve.lora.dummy import write_peft_adapter
    from jaxserve.sampling_params import SamplingParams

    base = load_config(SMALL)
    cfg, _ = resolve_model_config(base, cache_dir)
    a1 = write_peft_adapter(tmp_path / "a1", cfg, r=8, alpha=16, seed=41, b_std=0.02)
    a2 = write_peft_adapter(tmp_path / "a2", cfg, r=4, alpha=8, seed=42, b_std=0.03,
                            modules=["q_proj", "o_proj", "down_proj"])
    models = ["a1", "a2", "SmolLM2-135M-Instruct", "a1"]
    llm = LLM(base.replace(engine=base.engine.override(enable_lora=True, max_lora_rank=8,
                                                       max_loras=2)),
              cache_dir=cache_dir, warmup=False)
    lora = {"a1": LoRARequest("a1", 1, str(a1)), "a2": LoRARequest("a2", 2, str(a2))}
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [c.text for c in llm.generate(PROMPTS, sp, lora_request=[lora.get(m) for m in models])]
    del llm
    procs, url, logs = _launch_pair(tmp_path, cache_dir, (
        "--tensor-parallel-size", "4", "--enable-lora", "--max-lora-rank", "8",
        "--max-loras", "2", "--lora-modules", f"a1={a1}"))
    try:
        r = httpx.post(url + "/load_lora_adapter", timeout=60,
                       json={"lora_name": "a2", "lora_path": str(a2)})
        assert r.status_code == 200, r.text

        def complete(i):
            r = httpx.post(url + "/completions", timeout=300, json={
                "model": models[i], "prompt": PROMPTS[i], "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, range(4))) == want
    finally:
        _stop(procs)
