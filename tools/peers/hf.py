"""The HF transformers peer: generate() with static batching, run in a subprocess (its
memory and threads go away after) through `bench_peers.py --hf-worker`."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.peers.common import HF_ENV, ROOT, SetupError, log_tail


def hf_tokenizer(gguf_path: Path):
    """The model's tokenizer, read by transformers from the GGUF file at `gguf_path`."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def hf_worker(spec: dict) -> dict:
    """Measure transformers generate() (greedy, static batching) on CPU; run in a fresh
    process (see run_hf_peer). `spec`: gguf (path), dtype ('bfloat16'/'float32'), threads,
    prompts (texts), single_prompts (count), output_len, concurrency, max_prompt_tokens,
    ttft (token-id prompts, first one a warm-up). Returns metrics (tok/s, ms) and raw
    timings. min_new_tokens = max_new_tokens, so EOS never stops a sequence early."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(spec["threads"])
    gguf_path = Path(spec["gguf"])
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    kw = {}
    try:  # transformers >= 5.x can keep GGUF blocks packed; ask for plain dense weights
        from transformers import GgufConfig
        kw["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=getattr(torch, spec["dtype"]), **kw)
    model.eval()
    linear = model.get_submodule("model.layers.0.self_attn.q_proj")
    if type(linear) is not torch.nn.Linear or linear.weight.dtype != getattr(torch, spec["dtype"]):
        raise RuntimeError(f"expected dense {spec['dtype']} weights, got {type(linear).__name__} "
                           f"{getattr(linear, 'weight', None) is not None and linear.weight.dtype}")
    load_s = time.perf_counter() - t0
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"

    class Clock(BaseStreamer):
        """Arrival time of each generated step (the first put() is the prompt)."""
        def __init__(self):
            self.times, self.calls = [], 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(ids, mask, n, clock=None):
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, pad_token_id=tok.pad_token_id,
                                  streamer=clock)

    def encode(texts):
        enc = tok(texts, return_tensors="pt", padding=True, truncation=True,
                  max_length=spec["max_prompt_tokens"], add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]

    n, prompts = spec["output_len"], spec["prompts"]
    generate(*encode(["Warm-up: tell me about the sea."]), 8)
    # (i) single stream
    single = []
    for text in prompts[:spec["single_prompts"]]:
        ids, mask = encode([text])
        clock, t = Clock(), time.perf_counter()
        out = generate(ids, mask, n, clock)
        e2e = time.perf_counter() - t
        got = out.shape[1] - ids.shape[1]
        single.append({"prompt_tokens": ids.shape[1], "output_tokens": got, "e2e_s": e2e,
                       "ttft_s": clock.times[0] - t,
                       "tpot_s": (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)})
    # (ii) TTFT of the 512-token prompt
    ttfts = []
    for k, p in enumerate(spec["ttft"]):
        ids = torch.tensor([p])
        t = time.perf_counter()
        generate(ids, torch.ones_like(ids), 1)
        if k:  # the first one is a warm-up
            ttfts.append(time.perf_counter() - t)
    # (iii) static batches of `concurrency` prompts
    batches, c = [], spec["concurrency"]
    generate(*encode(prompts[:c]), 2)  # warm-up at this batch size
    for i in range(0, len(prompts), c):
        ids, mask = encode(prompts[i:i + c])
        clock, t = Clock(), time.perf_counter()
        out = generate(ids, mask, n, clock)
        wall = time.perf_counter() - t
        batches.append({"batch": ids.shape[0], "padded_prompt_tokens": ids.shape[1],
                        "output_tokens": ids.shape[0] * (out.shape[1] - ids.shape[1]),
                        "wall_s": wall, "ttft_s": clock.times[0] - t,
                        "tpot_s": (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)})
    single_tokens = sum(s["output_tokens"] for s in single)
    metrics = {
        "single_decode_tok_s": 1.0 / statistics.mean(s["tpot_s"] for s in single),
        "single_output_tok_s": single_tokens / sum(s["e2e_s"] for s in single),
        "single_ttft_ms": 1000 * statistics.median(s["ttft_s"] for s in single),
        "ttft_512_ms": 1000 * statistics.median(ttfts),
        "concurrent_output_tok_s": sum(b["output_tokens"] for b in batches) / sum(b["wall_s"] for b in batches),
        "concurrent_mean_tpot_ms": 1000 * statistics.mean(b["tpot_s"] for b in batches),
        "concurrent_median_ttft_ms": 1000 * statistics.median(b["ttft_s"] for b in batches),
    }
    return {"metrics": metrics, "raw": {"load_s": load_s, "single": single, "ttft_512_s": ttfts,
                                         "batches": batches, "torch_threads": torch.get_num_threads(),
                                         "attn_implementation": model.config._attn_implementation}}


def run_hf_peer(spec: dict, log: Path, timeout_s: float = 3600) -> dict:
    """hf_worker(spec) in a subprocess (its memory and threads go away after). Raises
    SetupError with the log's tail if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "tools.bench_peers", "--hf-worker", str(spec_path), str(out_path)]
        print(f"[{spec.get('peer', 'hf')}] running generate() in a subprocess (log {log})", flush=True)
        with open(log, "wb") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT,
                                    env=HF_ENV | dict(os.environ)).returncode
            except subprocess.TimeoutExpired:
                raise SetupError(f"HF worker timed out after {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")
        if rc != 0 or not out_path.is_file():
            raise SetupError(f"HF worker failed with exit code {rc}; log {log}:\n{log_tail(log)}")
        return json.loads(out_path.read_text())
