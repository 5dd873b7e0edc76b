"""The tests' own GPTQ / AWQ / compressed-tensors writers: a round-to-nearest quantiser and
each format's packing written from its reference implementation (not from jaxserve's
reader), so that reading what these write checks the reader against an independent
account of the format.

References: AutoGPTQ qlinear_cuda_old.py `QuantLinear.pack` (qweight packs consecutive
inputs, qzeros consecutive outputs, 32 / bits per int32 from the lowest bits; v1 stores
zero - 1); AutoAWQ gemm.py `WQLinear_GEMM.from_linear` (order [0, 2, 4, 6, 1, 3, 5, 7]
along the outputs); compressed-tensors pack_quantized.py `pack_to_int32` (signed values
plus 2^(bits - 1); weights along the inputs, zero points along the outputs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's 'bfloat16' dtype name)
import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Variant:
    """One checkpoint format to write: method, bits, group (None: per channel),
    symmetric, GPTQ v1 (zero - 1 stored) and the scale dtype."""

    method: str
    bits: int = 4
    group: int | None = 128
    sym: bool = True
    v1: bool = True
    scale_dtype: str = "float16"
    act_order: bool = False  # GPTQ desc_act: each layer's groups over a random input order

    @property
    def id(self) -> str:
        g = f"g{self.group}" if self.group else "ch"
        extra = ("-v1" if self.v1 else "-v2") if self.method == "gptq" else ""
        extra += "-actorder" if self.act_order else ""
        return f"{self.method}-{self.bits}b-{g}-{'sym' if self.sym else 'asym'}{extra}"


def group_index(n_in: int, group: int | None, order: np.ndarray | None = None) -> np.ndarray:
    """Each input's group: i // group (the last group shorter when group does not divide
    n_in, as GPTQ's g_idx), all 0 per channel; with `order` (a permutation of the inputs,
    GPTQ desc_act's), input order[j] is in group j // group."""
    gi = np.arange(n_in) // (group or n_in)
    if order is None:
        return gi
    out = np.empty_like(gi)
    out[order] = gi
    return out


def rtn(w: np.ndarray, bits: int, group: int | None, sym: bool, scale_dtype: str,
        gi: np.ndarray | None = None):
    """Round-to-nearest quantisation of w f32 [out, in] per output row and group ->
    (u u8 [out, in] in 0..2^bits-1, z i32 [out, groups], s [out, groups] of scale_dtype)
    with w ~ s * (u - z) per group (gi: each input's group, default group_index).
    Symmetric: z = 2^(bits-1), s = max|w| / (2^(bits-1)-1); asymmetric:
    s = (max - min) / (2^bits - 1), z = round(-min / s)."""
    out, n_in = w.shape
    gi = group_index(n_in, group) if gi is None else gi
    groups = int(gi.max()) + 1
    w = w.astype(np.float32)
    top = (1 << bits) - 1
    reduce = lambda f: np.stack([f(w[:, gi == g], axis=1) for g in range(groups)], 1)  # noqa: E731
    if sym:
        mid = 1 << (bits - 1)
        s = reduce(lambda a, axis: np.abs(a).max(axis)) / (mid - 1)
        s = np.where(s == 0, 1.0, s).astype(scale_dtype).astype(np.float32)
        z = np.full(s.shape, mid, np.int32)
    else:
        lo, hi = np.minimum(reduce(np.min), 0), np.maximum(reduce(np.max), 0)
        s = (hi - lo) / top
        s = np.where(s == 0, 1.0, s).astype(scale_dtype).astype(np.float32)
        z = np.clip(np.round(-lo / s), 0, top).astype(np.int32)
    u = np.clip(np.round(w / s[:, gi]) + z[:, gi], 0, top).astype(np.uint8)
    return u, z, s.astype(scale_dtype)


def dequantized(u, z, s, group: int | None, gi: np.ndarray | None = None) -> np.ndarray:
    """The test's own dequantisation: s * (u - z) per element's group (gi, default
    group_index), f32 [out, in]."""
    gi = group_index(u.shape[1], group) if gi is None else gi
    return (u.astype(np.float32) - z[:, gi]) * np.asarray(s, np.float32)[:, gi]


def _pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Pack unsigned codes along `axis`, 32 / bits per int32, the first (or order[i]-th
    of each run) in the lowest bits."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    packed = np.zeros((v.shape[0] // per,) + v.shape[1:], np.uint32)
    for i in range(per):
        src = order[i] if order is not None else i
        packed |= v[src::per] << np.uint32(bits * i)
    # contiguous: safetensors' numpy save_file writes an array's buffer as it lies
    return np.ascontiguousarray(np.moveaxis(packed, 0, axis)).view(np.int32)


def pack(variant: Variant, prefix: str, u, z, s, gi=None) -> dict[str, np.ndarray]:
    """The stored tensors of one linear layer (u, z, s as `rtn` gives them, gi its inputs'
    groups when not in order) in `variant`'s format."""
    out, n_in = u.shape
    b = variant.bits
    if variant.method == "gptq":
        zs = z - 1 if variant.v1 else z
        return {f"{prefix}.qweight": _pack(u.T, b, 0),
                f"{prefix}.qzeros": _pack((zs.T & ((1 << b) - 1)), b, 1),
                f"{prefix}.scales": np.ascontiguousarray(s.T).astype(np.float16),
                f"{prefix}.g_idx": (group_index(n_in, variant.group) if gi is None
                                    else gi).astype(np.int32)}
    if variant.method == "awq":
        order = lambda a: np.concatenate([a[:, c * 8:(c + 1) * 8][:, AWQ_ORDER]  # noqa: E731
                                          for c in range(a.shape[1] // 8)], axis=1)
        return {f"{prefix}.qweight": _pack(order(u.T), b, 1),
                f"{prefix}.qzeros": _pack(order(z.T), b, 1),
                f"{prefix}.scales": np.ascontiguousarray(s.T).astype(np.float16)}
    # compressed-tensors: signed values plus 2^(bits-1), i.e. the unsigned codes
    t = {f"{prefix}.weight_packed": _pack(u, b, 1),
         f"{prefix}.weight_scale": np.asarray(s),
         f"{prefix}.weight_shape": np.array([out, n_in], np.int64)}
    if not variant.sym:
        t[f"{prefix}.weight_zero_point"] = _pack(z.astype(np.uint32), b, 0)
    return t


def quantization_config(variant: Variant) -> dict:
    """config.json's quantization_config for `variant`."""
    if variant.method == "gptq":
        return {"quant_method": "gptq", "bits": variant.bits, "group_size": variant.group or -1,
                "desc_act": False, "sym": variant.sym,
                "checkpoint_format": "gptq" if variant.v1 else "gptq_v2"}
    if variant.method == "awq":
        return {"quant_method": "awq", "bits": variant.bits, "group_size": variant.group,
                "zero_point": True, "version": "gemm"}
    weights = {"num_bits": variant.bits, "type": "int", "symmetric": variant.sym,
               "strategy": "group" if variant.group else "channel",
               "group_size": variant.group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"]}


def float_tensors(src: Path) -> dict[str, np.ndarray]:
    """The tensors of HF directory `src`'s model.safetensors, a tied embedding under its
    HF name (safetensors' save_model keeps a tied table once, under either name)."""
    from safetensors.numpy import load_file
    stored = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("tie_word_embeddings") and "model.embed_tokens.weight" not in stored:
        stored["model.embed_tokens.weight"] = stored.pop("lm_head.weight")
    return stored


def write_quantized_dir(src: Path, out: Path, variant: Variant) -> dict[str, tuple]:
    """An HF directory at `out`: the float HF directory `src` (config.json,
    model.safetensors, tokenizer files) with every decoder linear layer quantised
    (`rtn`) and packed in `variant`'s format (act_order: each layer's groups over its own
    random input order), the rest copied. Returns {"<prefix>.weight": (u, z, s, gi)} of
    every quantised layer (gi None when its groups are in order)."""
    import shutil

    from safetensors.numpy import save_file
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(variant)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors, codes = {}, {}
    rng = np.random.default_rng(0)
    for name, w in float_tensors(src).items():
        prefix = name[:-len(".weight")]
        if name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS:
            gi = (group_index(w.shape[1], variant.group, rng.permutation(w.shape[1]))
                  if variant.act_order else None)
            u, z, s = rtn(np.asarray(w, np.float32), variant.bits, variant.group, variant.sym,
                          variant.scale_dtype, gi)
            tensors.update(pack(variant, prefix, u, z, s, gi))
            codes[name] = (u, z, s, gi)
        else:
            tensors[name] = w
    save_file(tensors, out / "model.safetensors")
    return codes

