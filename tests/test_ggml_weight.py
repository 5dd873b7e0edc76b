"""jaxserve.model.ggml_weight: GGUF Q4_0 / Q4_1 / Q8_0 blocks split into their fields and
dequantised on the device, bit for bit as llama.cpp's dequantize_row_* (through gguf-py's
port of them, gguf.quants), on random matrices and on every quantised tensor of the real
model's GGUF; the nibble order checked on a block built by hand."""

from __future__ import annotations

import gguf
import jax
import numpy as np
import pytest

from jaxserve.model.ggml_weight import (GGUF_TYPES, GGMLWeight, dequantize, from_gguf_bytes,
                                        to_gguf_bytes)

SEED = 20261126
QTYPES = {fmt: gguf.GGMLQuantizationType[name] for name, fmt in GGUF_TYPES.items()}


def _bits(x) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("fmt", sorted(QTYPES))
def test_random_blocks_dequantise_as_llama_cpp(fmt):
    rng = np.random.default_rng(SEED)
    # rows with a wide spread of scales, a constant block (d = 0 in q4_1) and zeros
    x = (rng.standard_normal((48, 256)) * np.exp(rng.uniform(-6, 3, (48, 1)))).astype(np.float32)
    x[3, :32] = 0.7
    x[5] = 0.0
    raw = gguf.quants.quantize(x, QTYPES[fmt])
    w = from_gguf_bytes(raw, fmt)
    assert w.matrix_shape == (48, 256) and w.nbytes == raw.nbytes
    got = jax.jit(dequantize)(jax.tree.map(jax.numpy.asarray, w))
    want = gguf.quants.dequantize(raw, QTYPES[fmt])
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(to_gguf_bytes(w), raw)


def test_nibble_order_and_fields_of_a_block_built_by_hand():
    """One q4_1 block: d = 0.5, m = -2, byte j = j | (15 - j) << 4: element j < 16 is
    j * 0.5 - 2, element 16 + j is (15 - j) * 0.5 - 2. The same quants as q4_0 (no m):
    (nibble - 8) * 0.5."""
    qs = np.array([j | (15 - j) << 4 for j in range(16)], np.uint8)
    nib = np.r_[np.arange(16), 15 - np.arange(16)].astype(np.float32)
    raw = np.concatenate([np.float16(0.5)[None].view(np.uint8), np.float16(-2)[None].view(np.uint8),
                          qs])[None]
    np.testing.assert_array_equal(np.asarray(dequantize(from_gguf_bytes(raw, "q4_1")))[0],
                                  nib * 0.5 - 2)
    raw0 = np.concatenate([np.float16(0.5)[None].view(np.uint8), qs])[None]
    np.testing.assert_array_equal(np.asarray(dequantize(from_gguf_bytes(raw0, "q4_0")))[0],
                                  (nib - 8) * 0.5)


def test_every_quantised_tensor_of_the_real_model_dequantises_as_llama_cpp(smollm2_gguf):
    """The 210 Q4_1 layer matrices and the Q8_0 token embedding (the tied LM head)."""
    reader = gguf.GGUFReader(smollm2_gguf)
    deq = jax.jit(dequantize)
    seen = {}
    for t in reader.tensors:
        fmt = GGUF_TYPES.get(t.tensor_type.name)
        if fmt is None:
            continue
        w = from_gguf_bytes(t.data, fmt)
        assert w.matrix_shape == (int(t.shape[1]), int(t.shape[0])), t.name  # GGUF lists [in, out]
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(_bits(deq(jax.tree.map(jax.numpy.asarray, w))), _bits(want),
                                      err_msg=t.name)
        seen[fmt] = seen.get(fmt, 0) + 1
    assert seen == {"q4_1": 210, "q8_0": 1}


@pytest.mark.parametrize("raw,fmt,match", [
    (np.zeros((2, 40), np.uint8), "q4_2", "must be one of"),
    (np.zeros((2, 41), np.uint8), "q4_1", "whole 20-byte blocks"),
    (np.zeros((2, 34), np.uint8), "q4_0", "whole 18-byte blocks"),
])
def test_bad_input_names_the_format_and_the_block_size(raw, fmt, match):
    with pytest.raises(ValueError, match=match):
        from_gguf_bytes(raw, fmt)


def test_weight_is_a_pytree_of_its_arrays():
    w = from_gguf_bytes(np.zeros((2, 40), np.uint8), "q4_1")
    leaves, tree = jax.tree.flatten(w)
    assert len(leaves) == 3 and jax.tree.unflatten(tree, leaves).fmt == "q4_1"
    assert isinstance(from_gguf_bytes(np.zeros((2, 34), np.uint8), "q8_0"), GGMLWeight)
