"""HF safetensors -> jaxserve checkpoint: every leaf against the HF weight under its layout,
ModelConfig fields, logits against transformers, the store round trip, and error messages."""

import importlib
import json
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from safetensors.numpy import load_file, save_file

from hf_reference import (assert_checkpoint_equals_hf, expected_leaves, flat_leaves, save_hf_dir,
                          tiny_hf_model)
from jaxserve.checkpoint import (CheckpointError, convert, is_checkpoint, load_model_config,
                                 load_params, model_config_from_hf, save_checkpoint)
from jaxserve.config import load_config
from jaxserve.config import ModelSource, ParallelConfig, RopeScaling
from jaxserve.model.params import init_params
from jaxserve.checkpoint.sources import resolve_checkpoint, source_fingerprint
from jaxserve.distributed.sharding import ShardingRules, make_mesh
from model_utils import dense_reference_logits, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name: (architecture, config overrides, expected ModelConfig fields)
CASES = {
    "llama3_rope": ("LlamaForCausalLM", dict(rope_scaling=LLAMA3_ROPE, rope_theta=50000.0,
                                             eos_token_id=[2, 3]),
                    dict(family="llama", rope_theta=50000.0, eos_token_ids=(2, 3), num_kv_heads=2,
                         rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32), tie_word_embeddings=False)),
    "llama_tied_mha": ("LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True),
                       dict(num_kv_heads=4, tie_word_embeddings=True, rope_scaling=None)),
    "mistral_head_dim_window": ("MistralForCausalLM", dict(head_dim=16, sliding_window=64),
                                dict(family="mistral", head_dim=16, max_position_embeddings=64)),
    "qwen2_bias_tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True),
                        dict(family="qwen2", attention_bias=True, tie_word_embeddings=True)),
    "qwen2_bias_untied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False),
                          dict(attention_bias=True, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(case name, HF model, checkpoint dir) for each case, converted once."""
    arch, overrides, _ = CASES[request.param]
    model = tiny_hf_model(arch, seed=len(request.param), **overrides)
    tmp = tmp_path_factory.mktemp(request.param)
    src = save_hf_dir(model, tmp / "hf")
    return request.param, model, convert(src, tmp / "ckpt", progress=False)


def test_source_is_sharded_with_index(converted):
    _, model, ckpt = converted
    src = ckpt.parent / "hf"
    assert (src / "model.safetensors.index.json").is_file()
    assert len(list(src.glob("*.safetensors"))) >= 3


def test_model_config_fields(converted):
    name, model, ckpt = converted
    cfg = load_model_config(ckpt)
    hf = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads) == \
        (hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_attention_heads)
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.bos_token_id == 1 and cfg.dtype == "float32"
    for field, value in CASES[name][2].items():
        assert getattr(cfg, field) == value, field


def test_every_leaf_equals_hf_weight(converted):
    _, model, ckpt = converted
    assert_checkpoint_equals_hf(ckpt, model)


def test_logits_match_transformers(converted):
    _, model, ckpt = converted
    cfg = load_model_config(ckpt)
    ids = [1, 5, 9, 33, 2, 63, 17, 40, 8, 8, 21, 60]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = dense_reference_logits(load_params(ckpt, cfg), cfg, ids)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_bf16_source_stays_bf16_unless_asked(tmp_path):
    model = tiny_hf_model("LlamaForCausalLM", seed=7).to(torch.bfloat16)
    src = save_hf_dir(model, tmp_path / "hf", max_shard_size=None)
    want = expected_leaves(model.state_dict(), 2, 4, 2, 8, tied=False)
    for dtype, expect in ((None, "bfloat16"), ("float32", "float32")):
        ckpt = convert(src, tmp_path / f"ckpt_{dtype}", dtype=dtype, progress=False)
        cfg = load_model_config(ckpt)
        params = load_params(ckpt, cfg)
        assert cfg.dtype == expect and params.layers[1].wq.dtype == np.dtype(expect)
        got = flat_leaves(params)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_generation_config_eos_and_chat_template_jinja_are_kept(tmp_path):
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM"), tmp_path / "hf", max_shard_size=None)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    ckpt = convert(src, tmp_path / "ckpt", progress=False)
    assert load_model_config(ckpt).eos_token_ids == (2, 7)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == "{{ messages }}" and tok_cfg["eos_token"] == "t2"
    assert (ckpt / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


def test_transformers4_config_json_of_llama31_8b():
    """Llama 3.1 8B's published config.json (rope_theta + rope_scaling, torch_dtype) gives
    the hand-written preset configs/llama3_8b.py."""
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
          "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
          "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
          "rope_theta": 500000.0, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
          "torch_dtype": "bfloat16", "tie_word_embeddings": False, "attention_bias": False}
    assert model_config_from_hf(hf) == load_config(os.path.join(ROOT, "configs", "llama3_8b.py")).model


# --- the store ---------------------------------------------------------------------------

def _tiny_saved(tmp_path, **kw):
    cfg = tiny_config(**kw)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(3), scale=0.5))
    out = save_checkpoint(tmp_path / "ckpt", cfg, params, '{"x": 1}', {"eos_token": "e"}, {"kind": "test"})
    return cfg, params, out


def test_store_round_trip_cast_and_rules(tmp_path):
    cfg, params, out = _tiny_saved(tmp_path, attention_bias=True, tie_word_embeddings=True)
    assert is_checkpoint(out) and load_model_config(out) == cfg
    header = json.loads((out / "config.json").read_text())
    assert (header["format"], header["version"], header["source"]) == \
        ("jaxserve-checkpoint", 2, {"kind": "test"})
    back = load_params(out, cfg, ShardingRules(make_mesh(ParallelConfig())))
    assert back.lm_head is None and isinstance(back.layers[0].bq, jax.Array)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    bf = load_params(out, cfg.replace(dtype="bfloat16"))
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(bf))
    np.testing.assert_allclose(np.asarray(bf.embed, np.float32), params.embed, rtol=1e-2)


def test_store_overwrites_checkpoint_refuses_other_dirs_and_shape_mismatch(tmp_path):
    cfg, params, out = _tiny_saved(tmp_path)
    save_checkpoint(out, cfg, params, "{}", {}, {"kind": "again"})
    assert json.loads((out / "config.json").read_text())["source"] == {"kind": "again"}
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a jaxserve checkpoint"):
        save_checkpoint(other, cfg, params, "{}", {}, {})
    with pytest.raises(CheckpointError, match=r"layers\[0\].wq.*\(32, 8, 8\)"):
        save_checkpoint(tmp_path / "c2", cfg.replace(num_heads=8), params, "{}", {}, {})
    with pytest.raises(CheckpointError, match="other param shapes"):
        load_params(out, cfg.replace(intermediate_size=64))
    assert not is_checkpoint(other) and (other / "a.txt").read_text() == "mine"


def test_convert_saves_group_by_group_never_holding_all_layers(tmp_path, monkeypatch):
    """With one layer per group, conversion hands orbax the top leaves and then each layer
    as its own item, and by each save every earlier group but the one still being written
    has been dropped: at most 2 layers' arrays are alive, never all 6."""
    import orbax.checkpoint as ocp
    conv = importlib.import_module("jaxserve.checkpoint.convert")
    monkeypatch.setattr(importlib.import_module("jaxserve.checkpoint.groups"), "GROUP_BYTES", 1)
    model = tiny_hf_model("LlamaForCausalLM", seed=5, num_hidden_layers=6)
    src = save_hf_dir(model, tmp_path / "hf")
    layer_arrays, saves = [], []
    real_convert_tensor, real_save = conv.convert_tensor, ocp.StandardCheckpointer.save

    def convert_tensor(source, t, dtype):
        x = real_convert_tensor(source, t, dtype)
        if t.path[0] == "layers":
            layer_arrays.append(weakref.ref(x))
        return x

    def save(self, path, item, *a, **k):
        saves.append((path.name, sum(r() is not None for r in layer_arrays)))
        return real_save(self, path, item, *a, **k)

    monkeypatch.setattr(conv, "convert_tensor", convert_tensor)
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", save)
    ckpt = convert(src, tmp_path / "ckpt", progress=False)
    assert [name for name, _ in saves] == ["top"] + [f"layers_{i:03d}-{i:03d}" for i in range(6)]
    assert len(layer_arrays) == 6 * 9 and max(n for _, n in saves) <= 2 * 9, saves
    assert json.loads((ckpt / "config.json").read_text())["param_groups"] == [[i, i + 1] for i in range(6)]
    assert sorted(p.name for p in (ckpt / "params").iterdir()) == sorted(name for name, _ in saves)
    assert load_model_config(ckpt).num_layers == 6
    assert_checkpoint_equals_hf(ckpt, model)


def test_old_version_or_bad_groups_refused_old_version_replaced(tmp_path):
    cfg, params, out = _tiny_saved(tmp_path)
    header = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**header, "param_groups": [[0, 1]]}))
    with pytest.raises(CheckpointError, match=r"invalid param_groups.*do not cover the 2 layers"):
        load_params(out, cfg)
    (out / "config.json").write_text(json.dumps({**header, "version": 1}))
    assert not is_checkpoint(out)
    for load in (load_model_config, lambda d: load_params(d, cfg)):
        with pytest.raises(CheckpointError, match=r"checkpoint version 1 is not supported \(expected 2\); "
                                                  r"convert the model again"):
            load(out)
    save_checkpoint(out, cfg, params, "{}", {}, {})  # converting again over it is allowed
    assert is_checkpoint(out) and load_model_config(out) == cfg


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        _tiny_saved(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_model_store_converts_hf_dir_once(tmp_path, caplog):
    src = save_hf_dir(tiny_hf_model("Qwen2ForCausalLM"), tmp_path / "my model", max_shard_size=None)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        first = resolve_checkpoint(ModelSource(hf_dir=str(src)), tmp_path / "cache")
        assert "converting" in caplog.text
        caplog.clear()
        assert resolve_checkpoint(ModelSource(hf_dir=str(src)), tmp_path / "cache") == first
        assert "using cached checkpoint" in caplog.text
    assert first.parent == tmp_path / "cache" / "checkpoints" and first.name.startswith("my_model-")
    # the cache key covers the format version: an old-format cached checkpoint is not reused
    assert first.name == f"my_model-{source_fingerprint(src)}" != f"my_model-{source_fingerprint(src, 1)}"
    assert resolve_checkpoint(ModelSource(checkpoint=str(first)), tmp_path) == first
    with pytest.raises(CheckpointError, match="not a jaxserve checkpoint"):
        resolve_checkpoint(ModelSource(checkpoint=str(src)), tmp_path)


@pytest.mark.full  # fast tier: conversion into the cache, one process
def test_processes_sharing_a_cache_convert_once(tmp_path):
    """Two processes resolving one source into one fresh cache at the same time (two
    servers, two test workers): one converts, the other waits on the cache's lock and
    reuses the result; neither reads a half-written or replaced directory."""
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM"), tmp_path / "hf", max_shard_size=None)
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
            "import time\n"
            "from jaxserve.checkpoint import sources\n"
            "from jaxserve.config import ModelSource\n"
            "convert = sources.convert\n"  # slowed, so that the two overlap
            "sources.convert = lambda *a, **k: (time.sleep(3), convert(*a, **k))[1]\n"
            "print('RESULT', sources.resolve_checkpoint(ModelSource(hf_dir=sys.argv[1]), sys.argv[2]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(src), str(tmp_path / "cache")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = {line for out in outs for line in out.splitlines() if line.startswith("RESULT")}
    assert len(results) == 1, outs
    assert sum(out.count("(once; cached for later runs)") for out in outs) == 1, outs
    assert sum(out.count("using cached checkpoint") for out in outs) == 1, outs
    assert [p.name for p in (tmp_path / "cache" / "checkpoints").iterdir()] == [
        results.pop().split("/")[-1]]


# --- errors --------------------------------------------------------------------------------

@pytest.fixture
def hf_src(tmp_path):
    return save_hf_dir(tiny_hf_model("LlamaForCausalLM"), tmp_path / "hf")


def _shard_of(src, name):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src / index["weight_map"][name]


@pytest.mark.parametrize("edit, message", [
    ({"architectures": ["GPT2LMHeadModel"]},
     r"unsupported architecture GPT2LMHeadModel; supported: "
     r"\['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type 'yarn'"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_config(hf_src, tmp_path, edit, message):
    cfg = json.loads((hf_src / "config.json").read_text())
    (hf_src / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(CheckpointError, match=message):
        convert(hf_src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    ("missing", r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"),
    ("misshaped", r"tensor model\.layers\.1\.self_attn\.k_proj\.weight has shape \(16, 31\), "
                  r"expected \(16, 32\)"),
])
def test_missing_or_misshaped_tensor(hf_src, tmp_path, damage, message):
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = _shard_of(hf_src, name)
    tensors = load_file(shard)
    if damage == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :31].copy()
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=message):
        convert(hf_src, tmp_path / "out", progress=False)


def test_truncated_safetensors_names_the_file(hf_src, tmp_path):
    shard = _shard_of(hf_src, "model.layers.0.mlp.up_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard}: unreadable safetensors file"):
        convert(hf_src, tmp_path / "out", progress=False)


def test_corrupt_gguf_and_unknown_file_name_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(300))
    with pytest.raises(CheckpointError, match=f"{bad}: unreadable GGUF file"):
        convert(bad, tmp_path / "out", progress=False)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="neither an HF model directory nor a GGUF file"):
        convert(other, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "weights.bin"]


def test_cli_one_line_error_and_success(hf_src, tmp_path):
    cli = [sys.executable, "-m", "jaxserve", "convert"]
    bad = subprocess.run(cli + [str(tmp_path / "nope"), str(tmp_path / "out")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == f"error: {tmp_path / 'nope'} does not exist"
    ok = subprocess.run(cli + [str(hf_src), str(tmp_path / "out"), "--dtype", "bfloat16", "--quiet"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert load_model_config(tmp_path / "out").dtype == "bfloat16"


def test_load_params_first_layers_only(tmp_path, monkeypatch):
    """Config.num_layers with real weights: the checkpoint's first layers, and the groups
    past them are not read."""
    from jaxserve.checkpoint import groups as groups_mod
    monkeypatch.setattr(groups_mod, "GROUP_BYTES", 1)  # one layer per group
    cfg, params, out = _tiny_saved(tmp_path, num_layers=3)
    read = []
    real_restore = ocp.StandardCheckpointer.restore
    monkeypatch.setattr(ocp.StandardCheckpointer, "restore",
                        lambda self, path, *a, **k: read.append(Path(path).name)
                        or real_restore(self, path, *a, **k))
    two = load_params(out, cfg.replace(num_layers=2))
    assert len(two.layers) == 2 and read == ["top", "layers_000-000", "layers_001-001"]
    for a, b in zip(jax.tree.leaves(params.layers[:2]), jax.tree.leaves(two.layers), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    with pytest.raises(CheckpointError, match="other param shapes"):
        load_params(out, cfg.replace(num_layers=4))


def test_source_from_path_tells_the_kinds_apart(tmp_path):
    from jaxserve.checkpoint.sources import source_from_path
    cfg, params, ckpt = _tiny_saved(tmp_path)
    assert source_from_path(ckpt) == ModelSource(checkpoint=str(ckpt))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert source_from_path(hf) == ModelSource(hf_dir=str(hf))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert source_from_path(tmp_path / "m.gguf") == ModelSource(gguf=str(tmp_path / "m.gguf"))
    with pytest.raises(CheckpointError, match="neither a jaxserve checkpoint nor a Hugging Face"):
        source_from_path(tmp_path / "ckpt" / "params")
    with pytest.raises(CheckpointError, match="no such model directory or .gguf file"):
        source_from_path(tmp_path / "missing")
