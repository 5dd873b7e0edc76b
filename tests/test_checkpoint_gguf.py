"""GGUF -> jaxserve checkpoint: tiny GGUFs written the way llama.cpp's converter writes them
(q/k rows permuted for `llama`, not for `qwen2`; Llama 3.1 scaling as a rope_freqs tensor),
and the real SmolLM2 Q4_1 GGUF against transformers' own dequantised load of it."""

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from hf_reference import assert_checkpoint_equals_hf, expected_leaves, flat_leaves, tiny_hf_model
from jaxserve.checkpoint import CheckpointError, convert, load_model_config, load_params
from model_utils import dense_reference_logits

# HF name suffix -> llama.cpp tensor name (llama.cpp gguf-py constants.py TENSOR_NAMES).
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (rows to interleaved RoPE pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def write_gguf(path, model, arch: str, rope_freqs: np.ndarray | None = None):
    """`model` as an F32 GGUF of architecture `arch`, as llama.cpp's converter lays it out."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet())[:c.vocab_size])
    w.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.numpy().copy()
        if arch == "llama" and "q_proj" in name:
            x = llamacpp_permute(x, c.num_attention_heads)
        elif arch == "llama" and "k_proj" in name:
            x = llamacpp_permute(x, c.num_key_value_heads)
        w.add_tensor(gguf_name(name), x)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_rope_freqs(model) -> np.ndarray:
    """What llama.cpp writes for Llama 3.1 scaling: default inv_freq / scaled inv_freq,
    from transformers' own rope init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    c = model.config
    dim = c.hidden_size // c.num_attention_heads
    default = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).double() / dim))
    return (default / scaled.double()).numpy()


CASES = {  # name: (HF architecture, GGUF architecture, config overrides)
    "llama_untied_gqa": ("LlamaForCausalLM", "llama", dict(tie_word_embeddings=False)),
    "llama_tied_mha": ("LlamaForCausalLM", "llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3_rope_freqs": ("LlamaForCausalLM", "llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                                                            max_position_embeddings=1024)),
    "qwen2_bias_tied": ("Qwen2ForCausalLM", "qwen2", dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def gguf_converted(request, tmp_path_factory):
    hf_arch, arch, overrides = CASES[request.param]
    model = tiny_hf_model(hf_arch, seed=11, **overrides)
    tmp = tmp_path_factory.mktemp(request.param)
    freqs = llama3_rope_freqs(model) if "rope_scaling" in overrides else None
    write_gguf(tmp / "m.gguf", model, arch, freqs)
    return model, convert(tmp / "m.gguf", tmp / "ckpt", progress=False)


def test_gguf_leaves_equal_hf_weights_after_unpermute(gguf_converted):
    model, ckpt = gguf_converted
    cfg = load_model_config(ckpt)
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    assert cfg.attention_bias == (model.config.model_type == "qwen2")
    assert_checkpoint_equals_hf(ckpt, model)


def test_gguf_logits_match_transformers(gguf_converted):
    model, ckpt = gguf_converted
    cfg = load_model_config(ckpt)
    if model.config.rope_parameters.get("rope_type") == "llama3":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 16.0
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 35, 63, 0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(dense_reference_logits(load_params(ckpt, cfg), cfg, ids), want,
                               atol=2e-4, rtol=1e-4)


def test_gguf_unsupported_architecture_and_rope_freqs(tmp_path):
    model = tiny_hf_model("LlamaForCausalLM")
    write_gguf(tmp_path / "a.gguf", model, "gemma")
    with pytest.raises(CheckpointError,
                       match=r"unsupported GGUF architecture 'gemma'; supported: \['llama', 'qwen2'\]"):
        convert(tmp_path / "a.gguf", tmp_path / "out", progress=False)
    write_gguf(tmp_path / "b.gguf", model, "llama", rope_freqs=np.linspace(1, 3, 4))
    with pytest.raises(CheckpointError, match="rope_freqs.weight is not Llama 3.1 RoPE scaling"):
        convert(tmp_path / "b.gguf", tmp_path / "out", progress=False)


def test_truncated_gguf_names_the_file(tmp_path):
    write_gguf(tmp_path / "m.gguf", tiny_hf_model("LlamaForCausalLM"), "llama")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "m.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'm.gguf'}: unreadable GGUF file"):
        convert(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# --- the real model ----------------------------------------------------------------------

def test_real_gguf_config(smollm2_checkpoint, hf_smollm2_model):
    cfg = load_model_config(smollm2_checkpoint)
    hf = hf_smollm2_model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == (30, 576, 1536, 9, 3, 64, 49152)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.num_key_value_heads)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (1e-5, 8192, True)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.dtype) == (1, (2,), "float32")


def test_real_gguf_every_tensor_equals_transformers_dequantised(smollm2_checkpoint, hf_smollm2_model):
    cfg = load_model_config(smollm2_checkpoint)
    got = flat_leaves(load_params(smollm2_checkpoint, cfg))
    want = expected_leaves(hf_smollm2_model.state_dict(), cfg.num_layers, cfg.num_heads,
                           cfg.num_kv_heads, cfg.head_dim, tied=True)
    assert sorted(got) == sorted(want)
    for key in ["layers.0.wq", "layers.0.wk", "layers.29.wq", "layers.29.wk"] + sorted(want):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_real_gguf_logits_match_transformers(smollm2_checkpoint, hf_smollm2_model):
    cfg = load_model_config(smollm2_checkpoint)
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2]
    with torch.no_grad():
        want = hf_smollm2_model(torch.tensor([ids])).logits[0].numpy()
    got = dense_reference_logits(load_params(smollm2_checkpoint, cfg), cfg, ids)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
