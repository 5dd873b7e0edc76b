"""GPTQ / AWQ / compressed-tensors checkpoints read as GGML blocks
(jaxserve.checkpoint.hf_quantized): every format variant written by the tests' own packers
(tests/quantized_checkpoints.py) reads back to blocks that dequantise to the tests' own
s * (u - z); the real model's quantised directories convert and serve; unsupported
schemes fail in one line naming the field before any weight is read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.checkpoint import CheckpointError
from jaxserve.checkpoint import hf_quantized as hq
from jaxserve.model.ggml_weight import dequantize
from quantized_checkpoints import (Variant, dequantized, float_tensors, group_index, pack,
                                   quantization_config, rtn, write_quantized_dir)

VARIANTS = [
    Variant("gptq", 4, 128, sym=True, v1=True),
    Variant("gptq", 4, 64, sym=False, v1=False),
    Variant("gptq", 4, None, sym=True, v1=False),
    Variant("gptq", 8, 32, sym=True, v1=True),
    Variant("awq", 4, 128, sym=False),
    Variant("awq", 4, 32, sym=False),
    Variant("compressed-tensors", 4, 128, sym=True, scale_dtype="bfloat16"),
    Variant("compressed-tensors", 4, 32, sym=False, scale_dtype="bfloat16"),
    Variant("compressed-tensors", 8, None, sym=True, scale_dtype="float32"),
]
FORMAT = {(4, True): "q4_0", (4, False): "q4_1", (8, True): "q8_0"}


def _bound(u, z, s, group: int | None, scale_dtype: str) -> np.ndarray:
    """The reader's allowed difference from s * (u - z) per element. d = s is exact for
    f16 and bf16 scales (these are in f16's normal range) and rounds an f32 scale to f16
    (<= 2^-11 relative: on d * u (Q4_1) or d * (u - z) (Q4_0, Q8_0)); Q4_1 also rounds m = -(s*z) to f16
    once (<= 2^-11 |s*z|) and sums d*u + m in f32 (half an f32 ulp of the result)."""
    gi = group_index(u.shape[1], group)
    s32 = np.asarray(s, np.float32)[:, gi]
    codes = np.maximum(u, np.abs(u.astype(np.int32) - z[:, gi]))
    d_err = 0 if scale_dtype in ("float16", "bfloat16") else s32 * codes * 2.0 ** -11
    return d_err + np.abs(s32 * z[:, gi]) * 2.0 ** -11


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.id)
def test_blocks_dequantise_to_the_tests_own_unpacking(variant):
    rng = np.random.default_rng(0)
    out, n_in = 48, 320  # 2.5 groups of 128: a shorter last group, as SmolLM2 has
    w = rng.standard_normal((out, n_in)).astype(np.float32) * 0.05
    w[3] += 0.04  # a row whose groups are all positive: zero points at the range's edge
    u, z, s = rtn(w, variant.bits, variant.group, variant.sym, variant.scale_dtype)
    stored = pack(variant, "layer", u, z, s)
    hf_config = {"quantization_config": quantization_config(variant)}
    scheme = hq.quant_scheme(hf_config)
    assert (scheme.method, scheme.bits, scheme.group_size) == (variant.method, variant.bits,
                                                                variant.group)
    assert hq.linear_shape(scheme, "layer", lambda n: stored[n].shape) == (out, n_in)
    blocks = hq.read_blocks(scheme, "layer", stored.__getitem__, stored.__contains__)
    assert blocks.fmt == FORMAT[variant.bits, variant.sym]
    assert hq.block_format(scheme, "layer", stored.__getitem__, stored.__contains__) == blocks.fmt
    got = np.asarray(dequantize(blocks))
    want = dequantized(u, z, s, variant.group)
    tol = _bound(u, z, s, variant.group, variant.scale_dtype) + np.spacing(np.abs(want))
    if variant.sym and variant.scale_dtype != "float32":  # Q4_0 / Q8_0 with f16-exact scales
        np.testing.assert_array_equal(got, want)
    else:
        assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) - tol)
    # and the tests' quantiser is within half a step of the weights it quantised (the
    # scale's own rounding to its dtype, <= 2^-8 relative, aside); asymmetric: a step, as
    # rounding the zero point shifts the grid by up to half a step
    step = np.asarray(s, np.float32)[:, group_index(n_in, variant.group)]
    assert np.all(np.abs(want - w) <= (step / 2 * (1 + 2.0 ** -7) if variant.sym else step))


def test_awq_order_and_gptq_v1_offset_matter():
    """The reader applies AWQ's interleaving and GPTQ v1's zero - 1: reading a v1 file
    as v2, or AWQ codes as naturally ordered, gives other weights."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    for variant, wrong in [(Variant("gptq", 4, 32, sym=False, v1=True),
                            {"checkpoint_format": "gptq_v2"}),
                           (Variant("awq", 4, 32, sym=False), None)]:
        u, z, s = rtn(w, 4, 32, False, "float16")
        z = np.maximum(z, 1)  # v1 cannot store a zero point of 0
        stored = pack(variant, "l", u, z, s)
        scheme = hq.quant_scheme({"quantization_config": quantization_config(variant)})
        want = dequantized(u, z, s, 32)
        right = np.asarray(dequantize(hq.read_blocks(scheme, "l", stored.__getitem__,
                                                      stored.__contains__)))
        assert np.allclose(right, want, atol=1e-3)
        if wrong is not None:
            scheme = hq.quant_scheme({"quantization_config": quantization_config(variant) | wrong})
            codes = hq.read_codes(scheme, "l", stored.__getitem__, stored.__contains__)
            np.testing.assert_array_equal(codes[1], z - 1)
        else:
            natural = hq.unpack_int32(stored["l.qweight"], 4, 1).T
            assert not np.array_equal(natural, u)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3 is not served \(only \[4, 8\]\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, r"group_size 16 is not served"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"checkpoint_format 'marlin' is not served"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"AWQ version 'gemv' is not served"),
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not served"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group"}}}},
     r"config group 'g': float-quantized weights are served as fp8 .* only"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     r"format 'nvfp4-pack-quantized' of config group 'g' is not served"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                              "input_activations": {"num_bits": 8}}}},
     r"quantises activations \(W8A8\)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     r"strategy 'tensor'"),
])
def test_unsupported_scheme_is_one_line_naming_it(qc, message):
    with pytest.raises(CheckpointError, match=message) as e:
        hq.quant_scheme({"quantization_config": qc})
    assert "\n" not in str(e.value)


def test_activation_ordered_groups_dequantise_exactly_and_8bit_asymmetric_is_refused():
    """GPTQ desc_act (a layer's groups over a permuted input order, g_idx stored): no block
    of 32 inputs shares a scale, so read_blocks refuses it and dequantize_linear gives
    the tests' own s[g_idx] * (u - z[g_idx]) exactly; in-order layers dequantise to their
    blocks' values. Asymmetric 8-bit codes have no GGML block: refused."""
    from quantized_checkpoints import group_index
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 320)).astype(np.float32)
    variant = Variant("gptq", 4, 128, sym=False, v1=False, act_order=True)
    gi = group_index(320, 128, rng.permutation(320))
    u, z, s = rtn(w, 4, 128, False, "float16", gi)
    stored = pack(variant, "l", u, z, s, gi)
    scheme = hq.quant_scheme({"quantization_config": quantization_config(variant)
                              | {"desc_act": True}})
    assert hq.act_order(scheme, "l", 320, stored.__getitem__, stored.__contains__) is not None
    with pytest.raises(CheckpointError, match=r"l\.g_idx is not in group order"):
        hq.read_blocks(scheme, "l", stored.__getitem__, stored.__contains__)
    got = hq.dequantize_linear(scheme, "l", stored.__getitem__, stored.__contains__)
    np.testing.assert_array_equal(got, dequantized(u, z, s, 128, gi))
    assert np.abs(got - w).max() <= np.asarray(s, np.float32).max()  # really w, quantised
    u, z, s = rtn(w, 4, 128, False, "float16")
    in_order = pack(variant, "m", u, z, s)
    assert hq.act_order(scheme, "m", 320, in_order.__getitem__, in_order.__contains__) is None
    exact = hq.dequantize_linear(scheme, "m", in_order.__getitem__, in_order.__contains__)
    np.testing.assert_array_equal(exact, dequantized(u, z, s, 128))
    blocks = np.asarray(dequantize(hq.read_blocks(scheme, "m", in_order.__getitem__,
                                                  in_order.__contains__)))
    assert np.all(np.abs(blocks - exact) <= _bound(u, z, s, 128, "float16") + np.spacing(exact))
    variant = Variant("gptq", 8, 32, sym=False, v1=False)
    stored = pack(variant, "l", *rtn(w[:, :64], 8, 32, False, "float16"))
    scheme = hq.quant_scheme({"quantization_config": quantization_config(variant)})
    with pytest.raises(CheckpointError, match=r"asymmetric 8-bit weights"):
        hq.block_format(scheme, "l", stored.__getitem__, stored.__contains__)


def test_act_ordered_directory_converts_those_layers_to_floats(tmp_path, caplog):
    """A GPTQ desc_act directory of a tiny model (hidden size 32: one group, so only
    down_proj's 64 inputs are really reordered): those layers are float leaves equal to
    the tests' dequantisation (f32 model: exactly), counted in the warning; the other
    projections stay blocks."""
    from hf_reference import save_hf_dir, tiny_hf_model
    from jaxserve.checkpoint import convert, load_model_config, load_params
    from jaxserve.model.params import PROJECTIONS
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM", intermediate_size=64), tmp_path / "f",
                      max_shard_size=None)
    variant = Variant("gptq", 4, 32, sym=False, v1=False, act_order=True)
    codes = write_quantized_dir(src, tmp_path / "q", variant)
    with caplog.at_level("WARNING"):
        ckpt = convert(tmp_path / "q", tmp_path / "ckpt", progress=False)
    assert "2 of 14 quantised linear layers have activation-ordered groups" in caplog.text
    cfg = load_model_config(ckpt)
    assert dict(cfg.weight_formats) == {n: "q4_1" for n in PROJECTIONS if n != "w_down"}
    params = load_params(ckpt, cfg)
    u, z, s, gi = codes["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(np.asarray(params.layers[1].w_down).T,
                                  dequantized(u, z, s, 32, gi))


@pytest.fixture
def tiny_awq(tmp_path):
    """A tiny random Llama quantised by the tests (AWQ, group 32), with its float source."""
    from hf_reference import save_hf_dir, tiny_hf_model
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM", intermediate_size=64), tmp_path / "f",
                      max_shard_size=None)
    write_quantized_dir(src, tmp_path / "q", Variant("awq", 4, 32, sym=False))
    return src, tmp_path / "q"


@pytest.mark.parametrize("damage, message", [
    ("drop", r"missing tensor model\.layers\.1\.mlp\.down_proj\.scales"),
    ("reshape", r"tensor model\.layers\.1\.mlp\.down_proj\.scales has shape \(1, 32\), "
                r"expected \(2, 32\)"),
])
def test_missing_or_misshaped_part_fails_at_open_before_any_weight_is_read(tiny_awq, damage,
                                                                          message, monkeypatch):
    from safetensors.numpy import load_file, save_file
    from jaxserve.checkpoint import convert
    from jaxserve.checkpoint.hf import HFSource
    _, q = tiny_awq
    tensors = load_file(q / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.scales"
    if damage == "drop":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:1].copy()
    save_file(tensors, q / "model.safetensors")
    monkeypatch.setattr(HFSource, "_read_stored", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match=message) as e:
        convert(q, q.parent / "out", progress=False)
    assert "\n" not in str(e.value) and not (q.parent / "out").exists()


def test_method_must_match_the_directory(tiny_awq, tmp_path):
    from jaxserve.checkpoint import convert
    src, q = tiny_awq
    with pytest.raises(CheckpointError, match=r"quantization 'gptq': .*/f has no quantization_config"):
        convert(src, tmp_path / "a", progress=False, quantization="gptq")
    with pytest.raises(CheckpointError, match=r"quantization 'compressed-tensors': .*/q is awq"):
        convert(q, tmp_path / "b", progress=False, quantization="compressed-tensors")
    with pytest.raises(CheckpointError, match=r"quantization 'gguf' serves a GGUF file's own"):
        convert(q, tmp_path / "c", progress=False, quantization="gguf")


def test_dummy_weights_with_an_hf_method_get_its_default_blocks(tmp_path):
    from jaxserve.config import Config
    from jaxserve.engine.builder import resolve_model_config
    from jaxserve.model.params import PROJECTIONS
    from model_utils import tiny_config
    for method, fmt in (("gptq", "q4_0"), ("awq", "q4_1"), ("compressed-tensors", "q4_0")):
        cfg, ckpt = resolve_model_config(Config(name="t", model=tiny_config(), load_format="dummy",
                                                quantization=method), tmp_path)
        assert ckpt is None and dict(cfg.weight_formats) == {n: fmt for n in PROJECTIONS}


# --- the real model -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def float_dir(smollm2_gguf, smollm2_checkpoint, tmp_path_factory):
    """The real model as a float32 HF directory (transformers' dequantisation of the GGUF;
    its config.json given the architecture transformers leaves out of a GGUF's) with the
    tokenizer jaxserve built from the GGUF (the converted checkpoint's files)."""
    from hf_reference import float_hf_dir
    d = tmp_path_factory.mktemp("smollm2-float")
    src = float_hf_dir(smollm2_gguf)
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]} | cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).symlink_to(smollm2_checkpoint / f)
    return d


def quantized_dir(float_dir, tmp_path_factory, variant):
    d = tmp_path_factory.mktemp(variant.id) / "model"
    return d, write_quantized_dir(float_dir, d, variant)


CHECKED_LAYERS = (0, 14, 29)  # first, middle, last: every layer goes through one code path


def _check_converted(ckpt, codes, variant):
    """Every projection of CHECKED_LAYERS of converted checkpoint `ckpt` is the tests' own
    dequantisation of its codes (within _bound), in the format the table gives (every
    layer's, by the config); the embedding float."""
    from jaxserve.checkpoint import load_model_config, load_params
    from jaxserve.model.ggml_weight import GGMLWeight
    from jaxserve.model.params import PROJECTIONS
    cfg = load_model_config(ckpt)
    fmt = FORMAT[variant.bits, variant.sym]
    assert dict(cfg.weight_formats) == {n: fmt for n in PROJECTIONS}
    params = load_params(ckpt, cfg)
    assert not isinstance(params.embed, GGMLWeight)
    hf_names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
                "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
                "w_down": "mlp.down_proj"}
    for i in CHECKED_LAYERS:
        lp = params.layers[i]
        for name, hf in hf_names.items():
            u, z, s, _ = codes[f"model.layers.{i}.{hf}.weight"]
            w = getattr(lp, name)
            assert isinstance(w, GGMLWeight) and w.fmt == fmt
            got, want = np.asarray(dequantize(w)), dequantized(u, z, s, variant.group)
            tol = _bound(u, z, s, variant.group, variant.scale_dtype) + np.spacing(np.abs(want))
            assert np.all(np.abs(got - want) <= tol), (i, name)


def test_real_model_awq_dir_converts_to_blocks_of_its_codes(float_dir, tmp_path_factory, tmp_path):
    """The real model quantised by the tests (AWQ GEMM, 4-bit, group 128, zero points)
    converts with the method read from config.json (vLLM's detection): every projection a
    Q4_1 block weight equal to the tests' own s * (u - z), the embedding float; asking for
    another method is a one-line error naming both."""
    from jaxserve.checkpoint import convert
    variant = Variant("awq", 4, 128, sym=False)
    d, codes = quantized_dir(float_dir, tmp_path_factory, variant)
    with pytest.raises(CheckpointError, match=r"quantization 'gptq': .* is awq"):
        convert(d, tmp_path / "wrong", progress=False, quantization="gptq")
    _check_converted(convert(d, tmp_path / "ckpt", progress=False), codes, variant)


@pytest.mark.full  # fast tier: the AWQ directory above and every variant's packing above
@pytest.mark.parametrize("variant", [Variant("gptq", 4, 128, sym=True, v1=True),
                                     Variant("compressed-tensors", 4, 32, sym=False,
                                             scale_dtype="bfloat16")], ids=lambda v: v.id)
def test_real_model_gptq_and_compressed_tensors_dirs_convert(float_dir, tmp_path_factory,
                                                             tmp_path, variant):
    from jaxserve.checkpoint import convert
    d, codes = quantized_dir(float_dir, tmp_path_factory, variant)
    _check_converted(convert(d, tmp_path / "ckpt", progress=False, quantization=variant.method),
                     codes, variant)


@pytest.mark.full  # fast tier: the AWQ directory's conversion above (the served kernel is
# test_gguf_serving's, on the same Q4_1 blocks)
def test_real_model_awq_dir_serves_the_distributions_of_its_dequantised_weights(
        float_dir, tmp_path_factory, cache_dir):
    """`LLM(model=<AWQ dir>)` (no --quantization: detected) on the default CPU engine
    (Q4_1 blocks in the C++ kernel, x rounded per block to int8) against the f32 model
    whose linear layers are the tests' own s * (u - z) of the same codes (XLA, f32 K/V):
    teacher-forced next-token distributions within test_gguf_serving's one-rounding KL,
    confident positions unflipped. A misread nibble, order or zero point gives KL of O(1)."""
    import jaxserve
    from safetensors.numpy import save_file
    from served_formats import (ONE_ROUNDING_KL, XLA_F32, accuracy_window,
                                assert_close_distributions)
    from tools import quant_accuracy
    from jaxserve.checkpoint import convert
    variant = Variant("awq", 4, 128, sym=False)
    d, codes = quantized_dir(float_dir, tmp_path_factory, variant)
    ref = tmp_path_factory.mktemp("awq-dequantised")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (ref / f).symlink_to(float_dir / f)
    tensors = float_tensors(float_dir)
    tensors.update({n: dequantized(u, z, s, variant.group) for n, (u, z, s, _) in codes.items()})
    save_file(tensors, ref / "model.safetensors")
    del tensors
    # converted here, not into the shared cache (whose entries are keyed by source path)
    f32 = jaxserve.LLM("smollm2_135m_bf16", model=convert(ref, ref / "ckpt", progress=False),
                       cache_dir=cache_dir, **XLA_F32)
    float_outputs = (None, quant_accuracy.next_token_logprobs(f32, [accuracy_window(f32)]))
    del f32
    # the method detected from config.json, as `--model DIR` does
    llm = jaxserve.LLM("smollm2_135m_bf16", model=convert(d, d.parent / "ckpt", progress=False),
                       cache_dir=cache_dir, warmup=False, max_num_seqs=8)
    assert dict(llm.engine.runner.model_cfg.weight_formats) == {
        n: "q4_1" for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    assert_close_distributions(llm, float_outputs, ONE_ROUNDING_KL)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_weights_read_dequantised(tmp_path, strategy, caplog):
    """compressed-tensors float-quantized (fp8 e4m3 `weight` times `weight_scale`, per
    output channel or per tensor, with static fp8 activation scales, as llm-compressor's
    FP8 schemes write): safetensors' numpy API cannot return fp8 (its issue #682), so the
    tensors are read from the file's bytes; every projection converts to floats equal to
    the tests' own fp8 value x scale, the activation scales are consumed, not warned
    about, and the scheme needs no blocks."""
    import ml_dtypes
    from safetensors.numpy import save_file
    from hf_reference import save_hf_dir, tiny_hf_model
    from jaxserve.checkpoint import convert, load_model_config, load_params
    from quantized_checkpoints import LINEARS, float_tensors
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM", intermediate_size=64), tmp_path / "f",
                      max_shard_size=None)
    out = tmp_path / "fp8"
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_text((src / f).read_text())
    cfg = json.loads((src / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
              "dynamic": False}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme,
                                      "input_activations": dict(scheme, strategy="tensor")}},
        "ignore": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    tensors, want = {}, {}
    for name, w in float_tensors(src).items():
        prefix = name[:-len(".weight")]
        if not (name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS):
            tensors[name] = w
            continue
        w = np.asarray(w, np.float32)
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max()
        scale = np.asarray(amax / 448.0, np.float32).reshape(-1, 1 if strategy == "channel" else 1)
        scale = scale if strategy == "channel" else scale.reshape(1)
        broadcast = scale if strategy == "channel" else scale[0]
        q = (w / broadcast).astype(ml_dtypes.float8_e4m3fn)
        tensors.update({name: q, f"{prefix}.weight_scale": scale,
                        f"{prefix}.input_scale": np.ones(1, np.float32)})
        want[name] = q.astype(np.float32) * broadcast
    save_file(tensors, out / "model.safetensors")
    with caplog.at_level("WARNING"):
        ckpt = convert(out, tmp_path / "ckpt", progress=False)
    assert "ignored" not in caplog.text
    cfg = load_model_config(ckpt)
    assert cfg.weight_formats == ()
    params = load_params(ckpt, cfg)
    np.testing.assert_array_equal(np.asarray(params.layers[1].w_down).T,
                                  want["model.layers.1.mlp.down_proj.weight"])
    wq = want["model.layers.0.self_attn.q_proj.weight"]  # [heads * head_dim, embed]
    np.testing.assert_array_equal(np.asarray(params.layers[0].wq).reshape(wq.shape[1], -1).T, wq)
    assert np.abs(wq - float_tensors(src)["model.layers.0.self_attn.q_proj.weight"]).max() > 0
