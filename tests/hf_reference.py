"""Hugging Face transformers as the reference implementation (test-only dependency).

transformers reads a GGUF itself (`from_pretrained(dir, gguf_file=name)`): dequantised
float32 weights with llama.cpp's q/k permutation undone, and a tokenizer rebuilt from the
vocabulary. Reading the GGUF takes ~14 s for the model and ~4 s for the tokenizer; both are
kept beside it after the first time (`_keep`). conftest.py wraps both in session fixtures
(`hf_smollm2_model`, `hf_smollm2_tokenizer`).

HF's greedy decoding (`hf_greedy`, ~60 ms a token on the 2-core VM: ~4 s for 64 tokens)
is memoised on disk beside the kept model, per machine and inputs (`_memo`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np


@functools.lru_cache(maxsize=None)
def load_gguf_model(gguf_path: str | Path):
    """`AutoModelForCausalLM` of a GGUF file in float32, eval mode: transformers' own
    dequantisation of it, read from GGUF the first time (~14 s) and kept beside it as
    float32 safetensors for the next sessions (~0.3 s; the directory is named by the
    transformers version, which does the dequantising, and written whole or not at all)."""
    import copy

    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM
    p = Path(gguf_path)
    kept = p.parent / f"{p.stem}.hf-float32-transformers-{transformers.__version__}"
    if kept.is_dir():
        return _with_memo_dir(
            AutoModelForCausalLM.from_pretrained(kept, dtype=torch.float32).eval(), kept)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name,
                                                 dtype=torch.float32).eval()

    def write(d: Path) -> None:
        config = copy.deepcopy(model.config)  # the weights are saved dequantised
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(d)
        save_model(model, str(d / "model.safetensors"))  # tied embedding / LM head kept once

    _keep(kept, write)
    return _with_memo_dir(model, kept)


def _keep(kept: Path, write) -> None:
    """`write(d)` into a fresh directory beside `kept`, then renamed to `kept`: whole or
    absent, and the first of several processes writing it wins."""
    import os
    import shutil
    import uuid
    tmp = kept.with_name(f"{kept.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    write(tmp)
    try:
        os.rename(tmp, kept)
    except OSError:  # another process kept it first
        shutil.rmtree(tmp, ignore_errors=True)


def float_hf_dir(gguf_path: str | Path) -> Path:
    """The HF directory (config.json, model.safetensors float32) `load_gguf_model` keeps
    beside the GGUF file, written on first use."""
    import transformers
    p = Path(gguf_path)
    kept = p.parent / f"{p.stem}.hf-float32-transformers-{transformers.__version__}"
    if not kept.is_dir():
        load_gguf_model(gguf_path)
    return kept


def _with_memo_dir(model, kept: Path):
    """`model` with the directory of its memoised outputs (`_memo`) beside its kept
    weights."""
    model.jaxserve_memo_dir = kept.with_name(kept.name + ".memo")
    return model


def _memo(model, name: str, inputs, compute):
    """compute() (JSON-able), stored on disk for `model` (a `load_gguf_model` model; any
    other model computes every time) and remembered by everything its value depends on:
    `name`, `inputs`, the torch version, torch's thread count (its reductions split by
    threads) and the CPU's flags (this project's machines vary: AMD EPYC, Intel Xeon with
    AMX). The weights' transformers version names the directory."""
    import hashlib
    import os
    import uuid

    import torch

    from jaxserve.kernels.cpu.build import _cpu_flags  # what the kernels' build key uses
    directory = getattr(model, "jaxserve_memo_dir", None)
    if directory is None:
        return compute()
    key = hashlib.sha256(json.dumps([name, inputs, torch.__version__, torch.get_num_threads(),
                                     _cpu_flags()]).encode()).hexdigest()
    path = Path(directory) / f"{name}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)  # whole or not at all
    return value


@functools.lru_cache(maxsize=None)
def load_gguf_tokenizer(gguf_path: str | Path):
    """`AutoTokenizer` of a GGUF file: transformers' conversion of its vocabulary, made
    from the GGUF the first time (~4 s) and kept beside it with `save_pretrained` for the
    next sessions (~0.2 s; named by the transformers version, which converts, and written
    whole or not at all, as `load_gguf_model`'s weights)."""
    import transformers
    from transformers import AutoTokenizer
    p = Path(gguf_path)
    kept = p.parent / f"{p.stem}.hf-tokenizer-transformers-{transformers.__version__}"
    if kept.is_dir():
        return AutoTokenizer.from_pretrained(kept)
    tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    _keep(kept, tokenizer.save_pretrained)
    return tokenizer


# --- tiny random HF models (for conversion tests) -------------------------------------

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A transformers `arch` ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    of the TINY shape (+ overrides) with every weight random: N(0, 0.2) matrices and
    biases, norms 1 + N(0, 0.1) (so a swapped norm or a dropped bias shows)."""
    import torch
    import transformers
    cls = getattr(transformers, arch)
    model = cls(cls.config_class(**{**TINY, **overrides})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def write_tiny_tokenizer(d: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json (tokens t0..tN) and a tokenizer_config.json into `d`."""
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")).save(
        str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))


def save_hf_dir(model, d: Path, max_shard_size: str | None = "24KB") -> Path:
    """`model.save_pretrained(d)` in shards of `max_shard_size` (several + an index) plus a
    tiny tokenizer; returns `d`."""
    model.save_pretrained(d, max_shard_size=max_shard_size) if max_shard_size else model.save_pretrained(d)
    write_tiny_tokenizer(d, model.config.vocab_size)
    return d


def expected_leaves(state_dict, n_layers: int, heads: int, kv_heads: int, head_dim: int,
                    tied: bool) -> dict[str, np.ndarray]:
    """Our documented layouts (jaxserve.model.params) computed from an HF state dict:
    {"embed": ..., "layers.0.wq": ..., "lm_head": ...} as float32 numpy."""
    sd = {k: v.detach().float().numpy() if v.dtype.is_floating_point else v.numpy()
          for k, v in state_dict.items()}
    D = sd["model.embed_tokens.weight"].shape[1]
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not tied:
        out["lm_head"] = sd["lm_head.weight"].T
    for i in range(n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out |= {
            f"layers.{i}.attn_norm": sd[p + "input_layernorm.weight"],
            f"layers.{i}.mlp_norm": sd[p + "post_attention_layernorm.weight"],
            f"layers.{i}.wq": sd[a + "q_proj.weight"].T.reshape(D, heads, head_dim),
            f"layers.{i}.wk": sd[a + "k_proj.weight"].T.reshape(D, kv_heads, head_dim),
            f"layers.{i}.wv": sd[a + "v_proj.weight"].T.reshape(D, kv_heads, head_dim),
            f"layers.{i}.wo": sd[a + "o_proj.weight"].T.reshape(heads, head_dim, D),
            f"layers.{i}.w_gate": sd[p + "mlp.gate_proj.weight"].T,
            f"layers.{i}.w_up": sd[p + "mlp.up_proj.weight"].T,
            f"layers.{i}.w_down": sd[p + "mlp.down_proj.weight"].T,
        }
        for b, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            if a + f"{b}_proj.bias" in sd:
                out[f"layers.{i}.b{b}"] = sd[a + f"{b}_proj.bias"].reshape(h, head_dim)
    return out


def flat_leaves(params) -> dict[str, np.ndarray]:
    """A Params tree as {"embed": ..., "layers.0.wq": ...} float32 numpy (None leaves absent)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = ".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path)
        out[key] = np.asarray(x).astype(np.float32)
    return out


def assert_checkpoint_equals_hf(ckpt, model) -> None:
    """Every leaf of the jaxserve checkpoint `ckpt` equals the HF `model`'s weight under
    our layout (exactly), and neither side has a leaf the other lacks."""
    from jaxserve.checkpoint import load_model_config, load_params

    cfg = load_model_config(ckpt)
    got = flat_leaves(load_params(ckpt, cfg))
    want = expected_leaves(model.state_dict(), cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.tie_word_embeddings)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def hf_greedy(hf_model, ids, n):
    """HF greedy loop (KV cache): n tokens and the top-2 logit margin at each step
    (memoised on disk for a `load_gguf_model` model: `_memo`)."""
    import torch

    def compute():
        tokens, margins = [], []
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), use_cache=True)
            for _ in range(n):
                logits = out.logits[0, -1]
                top2 = torch.topk(logits, 2).values
                margins.append(float(top2[0] - top2[1]))
                tokens.append(int(logits.argmax()))
                out = hf_model(torch.tensor([[tokens[-1]]]),
                               past_key_values=out.past_key_values, use_cache=True)
        return tokens, margins

    tokens, margins = _memo(hf_model, "greedy", [[int(t) for t in ids], int(n)], compute)
    return tokens, margins
