"""Peak host memory of getting a big model's weights onto a tensor-parallel mesh.

    python -m tools.measure_loading [--hidden 4096 --intermediate 14336 --layers 8
        --heads 32 --kv-heads 8 --vocab 128256] [--tp 4] [--workdir DIR]

Writes a synthetic Hugging Face Llama directory of that shape (bf16 safetensors, one
shard per layer, zeros: the values do not matter here), then measures in fresh
processes: (1) converting it into a jaxserve checkpoint (jaxserve.checkpoint.convert,
group by group) and (2) loading that checkpoint onto TP simulated CPU devices
(jaxserve.checkpoint.load_params: each group restored straight onto its shardings).
Simulated devices live in host memory, so the loading overhead is the peak RSS less the
RSS before loading and less the weights that end up resident. Prints each against the
size of one layer and of the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, resource, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
step, src, out, tp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
import jax
jax.numpy.zeros(1).block_until_ready()
from jaxserve.checkpoint import convert, load_model_config, load_params
base = rss()
if step == "convert":
    convert(src, out)
    print(json.dumps({"base": base, "peak": peak(), "resident": 0}))
else:
    from jaxserve.config import ParallelConfig
    from jaxserve.distributed.sharding import ShardingRules, make_mesh
    cfg = load_model_config(out)
    rules = ShardingRules(make_mesh(ParallelConfig(tensor_parallel_size=tp))) if tp > 1 else None
    params = load_params(out, cfg, rules)
    jax.block_until_ready(params)
    resident = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    print(json.dumps({"base": base, "peak": peak(), "resident": resident}))
"""


def write_hf_dir(d: Path, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int, vocab: int) -> tuple[int, int]:
    """A Llama HF directory of zeros in bf16; returns (bytes of one layer, of the model)."""
    import torch
    from safetensors.torch import save_file

    from jaxserve.tokenization.tokenizer import placeholder_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    z = lambda *shape: torch.zeros(shape, dtype=torch.bfloat16)  # noqa: E731
    index, layer_bytes, total = {}, 0, 0

    def save(name: str, tensors: dict) -> int:
        save_file(tensors, str(d / name))
        index.update({k: name for k in tensors})
        return sum(t.numel() * 2 for t in tensors.values())

    total += save("top.safetensors", {"model.embed_tokens.weight": z(vocab, hidden),
                                      "model.norm.weight": z(hidden),
                                      "lm_head.weight": z(vocab, hidden)})
    for i in range(layers):
        p = f"model.layers.{i}."
        layer_bytes = save(f"layer{i}.safetensors", {
            p + "input_layernorm.weight": z(hidden), p + "post_attention_layernorm.weight": z(hidden),
            p + "self_attn.q_proj.weight": z(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": z(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": z(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": z(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": z(intermediate, hidden),
            p + "mlp.up_proj.weight": z(intermediate, hidden),
            p + "mlp.down_proj.weight": z(hidden, intermediate)})
        total += layer_bytes
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    placeholder_tokenizer(vocab, 1, (2,)).backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>",
                                                         "eos_token": "<|eos|>"}))
    return layer_bytes, total


def measure(step: str, src: Path, out: Path, tp: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={max(tp, 1)}")
    proc = subprocess.run([sys.executable, "-c", _CHILD, step, str(src), str(out), str(tp)],
                          env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{step} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--workdir", help="where the HF directory and checkpoint go (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, out = Path(tmp) / "hf", Path(tmp) / "ckpt"
        layer, total = write_hf_dir(src, args.hidden, args.intermediate, args.layers,
                                    args.heads, args.kv_heads, args.vocab)
        conv = measure("convert", src, out, 1)
        load = measure("load", src, out, args.tp)
    result = {"layer_bytes": layer, "model_bytes": total,
              "convert_overhead": conv["peak"] - conv["base"],
              "load_overhead": load["peak"] - load["base"] - load["resident"],
              "load_resident": load["resident"], "tp": args.tp}
    if args.json:
        print(json.dumps(result))
        return 0
    gib = 2**30
    print(f"model {total / gib:.2f} GiB, one layer {layer / gib:.3f} GiB, TP {args.tp}")
    for name in ("convert_overhead", "load_overhead"):
        v = result[name]
        print(f"{name:17s} {v / gib:6.2f} GiB = {v / layer:5.2f} layers = {v / total:5.1%} of the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
