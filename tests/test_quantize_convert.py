"""--quantization int8 / int4 / fp8: a float source's weights quantised by jaxserve, int8 /
int4 into llama.cpp's Q8_0 / Q4_1 blocks when converted (gguf-py's reference quantisers),
fp8 (e4m3, per output channel) when loaded."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.checkpoint import CheckpointError, convert, load_model_config, load_params
from jaxserve.model.ggml_weight import GGMLWeight, dequantize
from jaxserve.model.params import PROJECTIONS

HF_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (untied LM head; every matrix's inputs whole blocks of 32)."""
    from hf_reference import save_hf_dir, tiny_hf_model
    return save_hf_dir(tiny_hf_model("LlamaForCausalLM", intermediate_size=64,
                                     tie_word_embeddings=False),
                       tmp_path_factory.mktemp("tiny") / "hf", max_shard_size=None)


def _round_to_nearest_bound(x: np.ndarray, fmt: str, group: int = 32) -> np.ndarray:
    """How far each element of x [out, in] may land from its value after llama.cpp's
    quantiser: half a step of its block (q4_1: of its group of `group` inputs, the last
    one possibly shorter), plus the f16 rounding of the stored d (and m), which the quants
    were computed without (<= 2^-11 relative, times the largest quant)."""
    out, n = x.shape
    cols = np.arange(n) // group  # each input's group
    b = x.astype(np.float64)
    if fmt == "q8_0":
        d = np.abs(b.reshape(out, -1, 32)).max(-1) / 127
        bound = np.repeat(d / 2 + d * 127 * 2.0 ** -11, 32, axis=1)
    else:  # q4_1
        lo = np.stack([b[:, cols == g].min(-1) for g in range(cols[-1] + 1)], -1)
        hi = np.stack([b[:, cols == g].max(-1) for g in range(cols[-1] + 1)], -1)
        d = (hi - lo) / 15
        bound = (d / 2 + d * 15 * 2.0 ** -11 + np.abs(lo) * 2.0 ** -11)[:, cols]
    return bound * (1 + 1e-6) + 1e-12


@pytest.mark.parametrize("quantization, layers_fmt, group", [
    ("int8", "q8_0", 32), ("int4", "q4_1", 32), ("int4_g64", "q4_1", 64),
    ("int4_g128", "q4_1", 128)])
def test_float_source_quantised_into_blocks_when_converted(tiny_dir, tmp_path, quantization,
                                                           layers_fmt, group):
    """Every projection in the layers' format, the embedding and LM head Q8_0; each
    block's values within half a step (plus the f16 rounding of its scales) of the float
    weight it replaces: round to nearest over the block's own range, or (int4_g64 /
    int4_g128) its group's, whose blocks repeat the group's d and m."""
    from safetensors.numpy import load_file
    ckpt = convert(tiny_dir, tmp_path / "ckpt", progress=False, quantization=quantization)
    cfg = load_model_config(ckpt)
    assert dict(cfg.weight_formats) == {"embed": "q8_0", "lm_head": "q8_0",
                                        **{n: layers_fmt for n in PROJECTIONS}}
    params = load_params(ckpt, cfg)
    hf = load_file(tiny_dir / "model.safetensors")
    pairs = [(params.embed, "model.embed_tokens.weight", "q8_0"),
             (params.lm_head, "lm_head.weight", "q8_0")]
    pairs += [(getattr(lp, n), f"model.layers.{i}.{HF_NAMES[n]}.weight", layers_fmt)
              for i, lp in enumerate(params.layers) for n in PROJECTIONS]
    for w, name, fmt in pairs:
        assert isinstance(w, GGMLWeight) and w.fmt == fmt, name
        x = hf[name].astype(np.float32)
        g = group if name.startswith("model.layers.") else 32
        err = np.abs(np.asarray(dequantize(w)) - x)
        assert np.all(err <= _round_to_nearest_bound(x, fmt, g)), (name, err.max())
        assert err.max() > 0, "the weights were quantised"
        if g > 32:  # a group's blocks share its d and m (the last group may be shorter)
            d = np.asarray(w.d)
            starts = np.arange(0, d.shape[1], g // 32)
            np.testing.assert_array_equal(d, np.repeat(d[:, starts], np.diff(
                np.append(starts, d.shape[1])), axis=1))


def test_int4_groups_follow_llama_cpps_q4_1_quantiser():
    """The group quantiser is quantize_row_q4_1_ref's arithmetic over a group: with groups
    of 32 it gives gguf-py's Q4_1 blocks bit for bit (d, m and every nibble); groups of 128
    over 576 inputs (4.5 groups, SmolLM2's width) end in a group of 64; another format with
    groups is refused."""
    from jaxserve.checkpoint.convert import _q4_1_groups, quantize_blocks
    x = np.random.default_rng(3).standard_normal((16, 576)).astype(np.float32)
    x[3, :32] = 0.25  # a constant block: d 0
    ours, ref = _q4_1_groups(x, 32), quantize_blocks(x, "q4_1")
    for f in ("qs", "d", "m"):
        np.testing.assert_array_equal(np.asarray(getattr(ours, f)), np.asarray(getattr(ref, f)))
    g128 = quantize_blocks(x, "q4_1", 128)
    d = np.asarray(g128.d)
    assert d.shape == (16, 18) and (d[:, 16] == d[:, 17]).all() and (d[:, 0] == d[:, 3]).all()
    assert (d[:, 3] != d[:, 4]).any()
    err = np.abs(np.asarray(dequantize(g128)) - x)
    assert np.all(err <= _round_to_nearest_bound(x, "q4_1", 128)) and err.max() > 0
    with pytest.raises(CheckpointError, match="groups of 128 inputs are written as q4_1"):
        quantize_blocks(x, "q8_0", 128)


def test_matrices_of_partial_blocks_are_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    from hf_reference import save_hf_dir, tiny_hf_model
    from jaxserve.checkpoint.hf import HFSource
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM", intermediate_size=48), tmp_path / "f",
                      max_shard_size=None)
    monkeypatch.setattr(HFSource, "read", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(CheckpointError, match=r"quantization 'int4': tensor model\.layers\.0\."
                                              r"mlp\.down_proj\.weight has 48 inputs"):
        convert(src, tmp_path / "out", progress=False, quantization="int4")


def test_int8_int4_refuse_an_already_quantised_directory(tmp_path):
    from hf_reference import save_hf_dir, tiny_hf_model
    from quantized_checkpoints import Variant, write_quantized_dir
    src = save_hf_dir(tiny_hf_model("LlamaForCausalLM", intermediate_size=64), tmp_path / "f",
                      max_shard_size=None)
    write_quantized_dir(src, tmp_path / "q", Variant("awq", 4, 32, sym=False))
    with pytest.raises(CheckpointError, match=r"quantization 'int4' quantises float weights; "
                                              r".*/q is already quantised \(awq\)"):
        convert(tmp_path / "q", tmp_path / "out", progress=False, quantization="int4")


@pytest.mark.full  # fast tier: the tiny model's int4 conversion above (gguf-py's quantiser)
def test_real_model_int4_of_the_q4_1_file_gives_back_its_own_blocks(smollm2_gguf, tmp_path):
    """The Q4_1 file's projections dequantised and quantised again to Q4_1 by llama.cpp's
    quantiser (through gguf-py) are the file's blocks again: each block's min and max are
    its m and m + 15 d, so the requantised d and m are the stored ones and every quant
    rounds back to itself (up to the f16 rounding of a recomputed d: tested as at most one
    f16 ulp of d and m). The embedding, Q8_0 in the file, requantises to itself too."""
    from jaxserve.checkpoint.gguf import GGUFSource
    from jaxserve.model.ggml_weight import unpack_nibbles
    ckpt = convert(smollm2_gguf, tmp_path / "int4", progress=False, quantization="int4")
    cfg = load_model_config(ckpt)
    params = load_params(ckpt, cfg)
    src = GGUFSource(smollm2_gguf)
    checked = 0
    for i in (0, 17, 29):
        for n in PROJECTIONS:
            want = src.read_blocks(f"model.layers.{i}.{HF_NAMES[n]}.weight")
            got = getattr(params.layers[i], n)
            assert got.fmt == want.fmt == "q4_1"
            np.testing.assert_array_equal(np.asarray(unpack_nibbles(got.qs)),
                                          np.asarray(unpack_nibbles(want.qs)))
            for field in ("d", "m"):
                a = np.asarray(getattr(got, field), np.float32)
                b = np.asarray(getattr(want, field), np.float32)
                assert np.all(np.abs(a - b) <= np.spacing(np.abs(b).astype(np.float16))), field
            checked += 1
    emb = src.read_blocks("model.embed_tokens.weight")
    np.testing.assert_array_equal(np.asarray(params.embed.qs), np.asarray(emb.qs))
    assert checked == 21


def test_fp8_quantises_the_projections_when_loaded():
    """quantization="fp8" resolves the kernels to weight_quant fp8_e4m3 (per output
    channel) in place of the preset's bf16 copies; the source converts as unquantised."""
    from jaxserve.config import KernelConfig
    from jaxserve.worker.kernel_selection import resolve_kernel_config
    preset = KernelConfig(bf16_matmul_min_rows=1, matmul_impl="cpu",
                          bf16_matmul_round_x_min_rows=16)
    k = resolve_kernel_config(preset, "cpu", "float32", "fp8")
    assert (k.weight_quant, k.bf16_matmul_min_rows, k.bf16_matmul_round_x_min_rows,
            k.matmul_impl) == ("fp8_e4m3", None, None, "auto")
    assert resolve_kernel_config(preset, "cpu", "float32", "int4") == preset


@pytest.mark.full  # fast tier: the blocks' round trip above, the engine over blocks in
# test_gguf_serving, fp8 weights in test_engine_kernels
def test_real_model_int8_and_fp8_serve_close_to_the_float_model(smollm2_gguf, cache_dir,
                                                                float_outputs):
    """`LLM(--quantization int8)` (the Q4_1 file's values requantised to Q8_0 when
    converted, the C++ kernel) within twice test_gguf_serving's one-rounding KL of the f32
    model (two 8-bit roundings: the weights' and x's); `--quantization fp8` (e4m3 per
    output channel at load, XLA's reference matmul on CPU) within three: e4m3's 3
    mantissa bits round each weight by up to 2^-4 of itself, about an int8 half-step of
    the channel's largest for a weight at a quarter of it (typical) and up to 4x that
    for the largest, which matter most (measured 0.016: PERFORMANCE.md)."""
    import jaxserve
    from jaxserve.model.weight_layouts import QuantizedWeight
    from served_formats import ONE_ROUNDING_KL, assert_close_distributions
    llm = jaxserve.LLM("smollm2_135m_bf16", model=smollm2_gguf, quantization="int8",
                       warmup=False, cache_dir=cache_dir, max_num_seqs=8)
    assert dict(llm.engine.runner.model_cfg.weight_formats)["w_down"] == "q8_0"
    assert_close_distributions(llm, float_outputs, 2 * ONE_ROUNDING_KL)
    del llm
    llm = jaxserve.LLM("smollm2_135m_bf16", model=smollm2_gguf, quantization="fp8",
                       warmup=False, cache_dir=cache_dir, max_num_seqs=8)
    wq = llm.engine.runner.params.layers[0].wq
    assert isinstance(wq, QuantizedWeight) and wq.fmt == "fp8_e4m3"
    assert_close_distributions(llm, float_outputs, 3 * ONE_ROUNDING_KL)
