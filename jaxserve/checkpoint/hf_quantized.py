"""Weight-only quantised Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors
pack-quantized) read into GGML blocks, so that they are served by the same block kernels
as a GGUF file (jaxserve.model.ggml_weight), their integer codes and scales unchanged.

Every format here stores, per linear layer W [out, in], integer codes u (unsigned,
0 .. 2^bits - 1), one scale s and one zero point z (unsigned) per output feature and group
of `group_size` consecutive inputs (or per output feature: channel), and means
W[o, i] = s[o, g] * (u[o, i] - z[o, g]) with g = i // group_size (the last group shorter
when group_size does not divide `in`: SmolLM2's 576 inputs are 4.5 groups of 128). A group
of 32, 64, 128 ... inputs is one or more GGML blocks of 32 that share the group's scale and
zero point:

| codes, zero points                | GGML block | fields                               |
|-----------------------------------|------------|--------------------------------------|
| 4-bit, every z = 8 (symmetric)    | Q4_0       | d = s; nibbles u (element (u-8)*d)   |
| 4-bit, any z (asymmetric)         | Q4_1       | d = s, m = -(s*z); nibbles u         |
| 8-bit, every z = 128 (symmetric)  | Q8_0       | d = s; qs = u - 128                  |

d and m are f16 (GGML's scale type). Q4_0 and Q8_0 are exact for f16 scales (GPTQ, AWQ)
and for bf16 / f32 scales that f16 holds exactly (the normal range of both); Q4_1's
m = -(s*z) is rounded once to f16 (at most 2^-11 of |s*z|, far below the format's own
step s). Which table row applies is read off the stored zero points per tensor, not the
config's `sym`.

Packing, by format (the source files each follows):

- **GPTQ** (AutoGPTQ v1 `checkpoint_format` "gptq", GPTQModel v2 "gptq_v2";
  auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `pack`, gptqmodel/utils/model.py
  `convert_gptq_v1_to_v2_format`): `qweight` i32 [in * bits / 32, out], 32 / bits codes
  of consecutive inputs per int32, the first in the lowest bits; `qzeros` i32
  [groups, out * bits / 32], consecutive outputs packed the same way, holding z - 1 in v1
  and z in v2; `scales` f16 [groups, out]; `g_idx` i32 [in] (each input's group).
  bits 4 or 8.
- **AWQ** (AutoAWQ GEMM; awq/modules/linear/gemm.py `WQLinear_GEMM.from_linear`,
  awq/utils/packing_utils.py `AWQ_ORDER`): `qweight` i32 [in, out / 8] and `qzeros`
  i32 [groups, out / 8], eight 4-bit codes of outputs 8c .. 8c + 7 per int32 in the order
  [0, 2, 4, 6, 1, 3, 5, 7] from the lowest bits; `scales` f16 [groups, out]; z as stored.
- **compressed-tensors** `pack-quantized` (compressed_tensors/compressors/
  quantized_compressors/pack_quantized.py `pack_to_int32`): `weight_packed` i32
  [out, in * bits / 32], consecutive inputs, the first in the lowest bits, each code the
  signed value plus 2^(bits - 1); `weight_scale` [out, groups] (the model's float dtype);
  `weight_zero_point` (asymmetric only) i32 [out * bits / 32, groups], consecutive outputs
  packed the same way, signed plus 2^(bits - 1); `weight_shape` [2] = (out, in).
  strategy "group" or "channel", num_bits 4 or 8, type "int", no activation quantisation.

Act-order (GPTQ `desc_act`, compressed-tensors `actorder` "group": a g_idx that is not
i // group_size) puts inputs of one group anywhere in the row, so no block of 32
consecutive inputs shares one scale: such a layer is served dequantised, exactly
s[g_idx] * (u - z[g_idx]) in the checkpoint's float dtype (`dequantize_linear`), the
others of the checkpoint in blocks; a warning says how many (serving the codes would
need the activations gathered into group order in the model: not yet).

compressed-tensors `float-quantized` (fp8 e4m3 `weight` times `weight_scale` per output
channel or per tensor; compressed_tensors/compressors/quantized_compressors/
naive_quantized.py `FloatQuantizationCompressor`) is read dequantised (an fp8 value
times its f32 scale, rounded once to f32), and its activation quantisation ignored (W8A16, as vLLM on GPUs without fp8):
`-q fp8` then serves the projections as fp8 again, quantised per output channel at load.

Not read (a one-line CheckpointError naming the field, before any weight is read):
other bit widths, groups that are not whole blocks of 32, AWQ GEMV / Marlin / Exllama
packings, integer activation quantisation (W8A8 int) and 8-bit asymmetric codes (no GGML
block holds them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.config import HF_QUANTIZATIONS
from jaxserve.model.ggml_weight import BLOCK, GGMLWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # packed position p holds output AWQ_ORDER[p] of 8
# each format's stored tensors of a linear layer, by suffix (after "<layer>.")
_PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "awq": ("qweight", "qzeros", "scales"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point",
                                 "weight_shape", "weight_g_idx")}
_CODES = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
# compressed-tensors float-quantized: the stored tensors of a linear layer
_FLOAT_PARTS = ("weight", "weight_scale", "input_scale")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's linear layers are quantised (its quantization_config).

    method: "gptq", "awq" or "compressed-tensors"; bits: 4 or 8; group_size: inputs per
    group (a multiple of 32), None for one scale per output feature; zero_offset: added to
    the stored zero points (1 for GPTQ v1's z - 1); symmetric: compressed-tensors' flag
    (its symmetric checkpoints store no zero points), None where zero points are stored;
    float_weights: compressed-tensors `float-quantized` (fp8 e4m3 weights times a scale
    per output channel or per tensor; read dequantised)."""

    method: str
    bits: int
    group_size: int | None
    zero_offset: int = 0
    symmetric: bool | None = None
    float_weights: bool = False  # compressed-tensors float-quantized: fp8 e4m3 weights

    def describe(self) -> str:
        """e.g. "gptq 4-bit, group 128" (for logs and the checkpoint's provenance)."""
        group = f"group {self.group_size}" if self.group_size else "per channel"
        kind = "fp8" if self.float_weights else f"{self.bits}-bit"
        return f"{self.method} {kind}, {group}"


def _field(qc: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present in `qc`, else default."""
    return next((qc[n] for n in names if n in qc), default)


def _group_size(value: Any, where: str) -> int | None:
    """A checkpoint's group size: None for per-channel (-1, 0, None), else an int that
    is a multiple of 32. Raises CheckpointError naming `where`."""
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < BLOCK or value % BLOCK:
        raise CheckpointError(f"{where}: group_size {value!r} is not served (a multiple of "
                              f"{BLOCK}, or -1 for per channel: GGML blocks of {BLOCK} inputs)")
    return value


def _bits(value: Any, where: str, allowed: tuple[int, ...]) -> int:
    if value not in allowed:
        raise CheckpointError(f"{where}: bits {value!r} is not served (only {list(allowed)})")
    return value


def _compressed_tensors_scheme(qc: dict[str, Any], where: str) -> QuantScheme:
    """The one weight scheme of a compressed-tensors quantization_config."""
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError(f"{where}: compressed-tensors config has no config_groups")
    schemes = set()
    for name, group in groups.items():
        gfmt = group.get("format") or fmt
        w = group.get("weights") or {}
        if gfmt == "float-quantized":
            if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("strategy") not in (
                    "channel", "tensor"):
                raise CheckpointError(f"{where}: config group {name!r}: float-quantized weights "
                                      "are served as fp8 (type 'float', num_bits 8) per channel "
                                      "or per tensor only")
            # fp8 activations (W8A8, dynamic or static scales): the weights are served
            # dequantised and the activations unquantised (vLLM's W8A16 fallback on GPUs
            # without fp8)
            schemes.add(QuantScheme("compressed-tensors", 8, None, float_weights=True))
            continue
        if gfmt != "pack-quantized":
            raise CheckpointError(f"{where}: compressed-tensors format {gfmt!r} of config group "
                                  f"{name!r} is not served (only 'pack-quantized' int4 / int8 "
                                  "and 'float-quantized' fp8 weights)")
        if group.get("input_activations") or group.get("output_activations"):
            raise CheckpointError(f"{where}: config group {name!r} quantises activations "
                                  "(W8A8); only weight-only schemes are served")
        if w.get("type", "int") != "int":
            raise CheckpointError(f"{where}: config group {name!r} has weights of type "
                                  f"{w.get('type')!r}; only 'int' is served")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise CheckpointError(f"{where}: config group {name!r} has strategy {strategy!r}; "
                                  "only 'group' and 'channel' are served")
        group_size = _group_size(w.get("group_size") if strategy == "group" else None,
                                 f"{where}: config group {name!r}")
        if strategy == "group" and group_size is None:
            raise CheckpointError(f"{where}: config group {name!r} has strategy 'group' "
                                  "without a group_size")
        schemes.add(QuantScheme("compressed-tensors", _bits(w.get("num_bits"), where, (4, 8)),
                                group_size, 0, bool(w.get("symmetric", True))))
    if len(schemes) > 1:
        raise CheckpointError(f"{where}: config groups with different weight schemes "
                              f"({sorted(s.describe() for s in schemes)}) are not served")
    return schemes.pop()


def quant_scheme(hf_config: dict[str, Any], path: Path | None = None) -> QuantScheme | None:
    """The QuantScheme of an HF directory: config.json's `quantization_config`, or an older
    AutoGPTQ directory's quantize_config.json; None for an unquantised checkpoint.
    Raises CheckpointError (one line, naming the field and value) for a method or setting
    that is not served: see the module docstring."""
    qc = hf_config.get("quantization_config")
    where = "config.json quantization_config"
    if qc is None and path is not None and (path / "quantize_config.json").is_file():
        import json
        qc, where = json.loads((path / "quantize_config.json").read_text()), "quantize_config.json"
        qc.setdefault("quant_method", "gptq")
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        fmt = _field(qc, "checkpoint_format", "format", default="gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not served "
                                  "(only 'gptq' and 'gptq_v2')")
        return QuantScheme("gptq", _bits(qc.get("bits"), where, (4, 8)),
                           _group_size(qc.get("group_size"), where), 1 if fmt == "gptq" else 0)
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(f"{where}: AWQ version {version!r} is not served (only 'gemm')")
        if not qc.get("zero_point", True):
            raise CheckpointError(f"{where}: AWQ without zero points is not served")
        return QuantScheme("awq", _bits(_field(qc, "bits", "w_bit"), where, (4,)),
                           _group_size(_field(qc, "group_size", "q_group_size"), where))
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    raise CheckpointError(f"{where}: quant_method {qc.get('quant_method')!r} is not served "
                          f"(one of {list(HF_QUANTIZATIONS)})")


def unpack_int32(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Codes packed 32 / bits per int32 along `axis` (the first in the lowest bits) ->
    u8 with that axis 32 / bits times longer."""
    per = 32 // bits
    p = np.moveaxis(np.ascontiguousarray(packed).view(np.uint32), axis, -1)
    shifts = np.arange(per, dtype=np.uint32) * bits
    codes = (p[..., None] >> shifts) & ((1 << bits) - 1)  # [..., n, per]
    codes = codes.astype(np.uint8).reshape(*p.shape[:-1], -1)
    return np.moveaxis(codes, -1, axis)


def linear_prefixes(scheme: QuantScheme, names: set[str]) -> set[str]:
    """The quantised linear layers of a checkpoint: prefixes p (e.g.
    "model.layers.0.mlp.up_proj") whose codes tensor p.<qweight / weight_packed> (fp8:
    whose weight_scale) exists."""
    suffix = ".weight_scale" if scheme.float_weights else "." + _CODES[scheme.method]
    return {n[:-len(suffix)] for n in names if n.endswith(suffix)}


def part_names(scheme: QuantScheme, prefix: str) -> tuple[str, ...]:
    """Every tensor name a quantised linear `prefix` may store."""
    parts = _FLOAT_PARTS if scheme.float_weights else _PARTS[scheme.method]
    return tuple(f"{prefix}.{p}" for p in parts)


def linear_shape(scheme: QuantScheme, prefix: str,
                 shape: Callable[[str], tuple[int, ...] | None]) -> tuple[int, int]:
    """(out, in) of quantised linear `prefix`, from its stored tensors' shapes."""
    if scheme.float_weights:
        return tuple(shape(f"{prefix}.weight"))
    codes = shape(f"{prefix}.{_CODES[scheme.method]}")
    per = 32 // scheme.bits
    if scheme.method == "gptq":
        return codes[1], codes[0] * per
    if scheme.method == "awq":
        return codes[1] * per, codes[0]
    return codes[0], codes[1] * per


def check_parts(scheme: QuantScheme, prefix: str,
                shape: Callable[[str], tuple[int, ...] | None]) -> tuple[int, int]:
    """(out, in) of quantised linear `prefix`, after checking from the stored shapes alone
    (no data read) that every tensor it needs is present and shaped as its format says.
    Raises CheckpointError naming the first missing or mis-shaped tensor."""
    if scheme.float_weights:
        w, sc = shape(f"{prefix}.weight"), shape(f"{prefix}.weight_scale")
        if w is None or len(w) != 2:
            raise CheckpointError(f"tensor {prefix}.weight is missing or not 2-D")
        if sc is None or tuple(sc) not in ((w[0], 1), (w[0],), (1,), ()):
            raise CheckpointError(f"tensor {prefix}.weight_scale has shape {sc}, expected "
                                  f"{(w[0], 1)} (per channel) or (1,) (per tensor)")
        return tuple(w)
    out, n_in = linear_shape(scheme, prefix, shape)
    groups = _groups(scheme, n_in, prefix)
    per = 32 // scheme.bits
    if scheme.method == "compressed-tensors":
        expected = {"weight_scale": [(out, groups)] + ([(out,)] if groups == 1 else [])}
        if not scheme.symmetric:
            expected["weight_zero_point"] = [(-(-out // per), groups)]
    else:
        expected = {"scales": [(groups, out)], "qzeros": [(groups, -(-out // per))]}
    for part, shapes in expected.items():
        got = shape(f"{prefix}.{part}")
        if got is None:
            raise CheckpointError(f"missing tensor {prefix}.{part}")
        if tuple(got) not in shapes:
            raise CheckpointError(f"tensor {prefix}.{part} has shape {tuple(got)}, expected "
                                  f"{shapes[0]}")
    return out, n_in


def _groups(scheme: QuantScheme, n_in: int, where: str) -> int:
    """Groups of `n_in` inputs (the last may be shorter, as GPTQ's g_idx = i // group_size
    makes it), which must be whole GGML blocks. Raises CheckpointError naming `where`."""
    if n_in % BLOCK:
        raise CheckpointError(f"{where}: {n_in} inputs are not whole blocks of {BLOCK}")
    return 1 if scheme.group_size is None else -(-n_in // scheme.group_size)


def _zeros(scheme: QuantScheme, prefix: str, read: Callable[[str], np.ndarray],
           has: Callable[[str], bool]) -> np.ndarray | None:
    """Zero points i32 [>= out, groups] of linear `prefix` as stored (padding rows kept;
    GPTQ v1's offset added; AWQ's order undone), or None for a symmetric
    compressed-tensors scheme (every z = 2^(bits - 1), nothing stored)."""
    bits = scheme.bits
    if scheme.method == "compressed-tensors":
        if scheme.symmetric:
            return None
        if not has(f"{prefix}.weight_zero_point"):
            raise CheckpointError(f"missing tensor {prefix}.weight_zero_point (the scheme is "
                                  "asymmetric)")
        return unpack_int32(read(f"{prefix}.weight_zero_point"), bits, 0).astype(np.int32)
    if not has(f"{prefix}.qzeros"):
        raise CheckpointError(f"missing tensor {prefix}.qzeros")
    z = unpack_int32(read(f"{prefix}.qzeros"), bits, 1)
    z = (_awq_natural(z) if scheme.method == "awq" else z).astype(np.int32)
    return z.T + scheme.zero_offset


def _format(bits: int, z: np.ndarray | None, prefix: str) -> str:
    """The GGML format of codes of `bits` with zero points z (None: all 2^(bits - 1)).
    Raises CheckpointError for asymmetric 8-bit codes (no GGML block holds them)."""
    mid = 1 << (bits - 1)
    symmetric = z is None or bool(np.all(z == mid))
    if bits == 8:
        if not symmetric:
            raise CheckpointError(f"{prefix}: asymmetric 8-bit weights (zero points other "
                                  f"than {mid}) are not served")
        return "q8_0"
    return "q4_0" if symmetric else "q4_1"


def block_format(scheme: QuantScheme, prefix: str, read: Callable[[str], np.ndarray],
                 has: Callable[[str], bool]) -> str:
    """The GGML format `read_blocks` gives linear `prefix` ("q4_0", "q4_1" or "q8_0"),
    decided by its zero points alone (no codes read). Raises CheckpointError as
    `read_blocks` does for them."""
    return _format(scheme.bits, _zeros(scheme, prefix, read, has), prefix)


def _g_idx_name(scheme: QuantScheme, prefix: str) -> str:
    return f"{prefix}.{'weight_g_idx' if scheme.method == 'compressed-tensors' else 'g_idx'}"


def act_order(scheme: QuantScheme, prefix: str, n_in: int, read: Callable[[str], np.ndarray],
              has: Callable[[str], bool]) -> np.ndarray | None:
    """Linear `prefix`'s g_idx (int64 [in]: each input's group) when its groups are
    activation-ordered, None when they are in order (i // group_size) or no g_idx is
    stored. Raises CheckpointError for a g_idx of the wrong shape or range."""
    name = _g_idx_name(scheme, prefix)
    if not has(name):
        return None
    g_idx = read(name).astype(np.int64)
    groups = _groups(scheme, n_in, prefix)
    if g_idx.shape != (n_in,) or g_idx.min(initial=0) < 0 or g_idx.max(initial=0) >= groups:
        raise CheckpointError(f"tensor {name} must be [{n_in}] group indices in [0, {groups})")
    in_order = np.arange(n_in) // (scheme.group_size or n_in)
    return None if np.array_equal(g_idx, in_order) else g_idx


def read_codes(scheme: QuantScheme, prefix: str, read: Callable[[str], np.ndarray],
               has: Callable[[str], bool], act_ordered: bool = False
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(u u8 [out, in], z i32 [out, groups] or None, s f32 [out, groups]) of quantised
    linear `prefix`: codes, zero points (None: all 2^(bits - 1)) and scales as the module
    docstring defines them, W = s * (u - z) per group. read / has: the source's tensor
    reader and presence test. Raises CheckpointError naming the tensor when one is
    missing or mis-shaped, or when the groups are activation-ordered (g_idx) unless
    `act_ordered` (the caller reads them: dequantize_linear)."""
    name = lambda part: f"{prefix}.{part}"  # noqa: E731
    codes_name, scales_name = ((_CODES[scheme.method], "scales") if scheme.method != "compressed-tensors"
                               else ("weight_packed", "weight_scale"))
    for n in (codes_name, scales_name):
        if not has(name(n)):
            raise CheckpointError(f"missing tensor {name(n)}")
    if scheme.method == "gptq":
        u = unpack_int32(read(name("qweight")), scheme.bits, 0).T  # [out, in]
    elif scheme.method == "awq":
        u = _awq_natural(unpack_int32(read(name("qweight")), scheme.bits, 1)).T
    else:
        u = unpack_int32(read(name("weight_packed")), scheme.bits, 1)
        if has(name("weight_shape")):
            out, n_in = (int(v) for v in read(name("weight_shape")))
            u = u[:out, :n_in]
    out, n_in = u.shape
    groups = _groups(scheme, n_in, prefix)
    s = read(name(scales_name))
    if scheme.method != "compressed-tensors":
        s = s.T  # [groups, out] -> [out, groups]
    elif s.size == out * groups:
        s = s.reshape(out, groups)
    if s.shape != (out, groups):
        raise CheckpointError(f"tensor {name(scales_name)} holds scales of shape "
                              f"{tuple(s.shape)}, expected {(out, groups)} (out, groups)")
    if not act_ordered and act_order(scheme, prefix, n_in, read, has) is not None:
        raise CheckpointError(f"tensor {_g_idx_name(scheme, prefix)} is not in group order "
                              "(activation-ordered groups: desc_act / actorder): read it with "
                              "dequantize_linear, not as blocks")
    z = _zeros(scheme, prefix, read, has)
    if z is not None:
        if z.shape[0] < out or z.shape[1] != groups:
            raise CheckpointError(f"zero points of {prefix} have shape {tuple(z.shape)}, "
                                  f"expected {(out, groups)} (out, groups)")
        z = z[:out]
    return u, z, np.asarray(s, np.float32)


def _awq_natural(u: np.ndarray) -> np.ndarray:
    """[rows, 8c] codes in AWQ's packed order -> the outputs' natural order."""
    rows, cols = u.shape
    natural = np.empty_like(u).reshape(rows, cols // 8, 8)
    natural[..., list(AWQ_ORDER)] = u.reshape(rows, cols // 8, 8)
    return natural.reshape(rows, cols)


def _f16(a: np.ndarray, what: str, prefix: str) -> np.ndarray:
    out = a.astype(np.float16)
    if not np.all(np.isfinite(out)):
        raise CheckpointError(f"{prefix}: a {what} overflows f16 (GGML's scale type)")
    return out


def to_blocks(u: np.ndarray, z: np.ndarray | None, s: np.ndarray, bits: int,
              group_size: int | None, prefix: str = "weight") -> GGMLWeight:
    """Codes u u8 [out, in], zero points z i32 [out, groups] (None: all 2^(bits - 1)) and
    scales s f32 [out, groups] (W = s * (u - z) per group of `group_size` inputs, a
    multiple of 32; None: one group) as a GGMLWeight of numpy arrays: Q4_0, Q4_1 or Q8_0
    per the module docstring's table. Raises CheckpointError (naming `prefix`) for
    asymmetric 8-bit codes or a scale f16 cannot hold."""
    out, n_in = u.shape
    fmt = _format(bits, z, prefix)
    group_of_block = np.arange(n_in // BLOCK) * BLOCK // (group_size or n_in)
    d = _f16(s[:, group_of_block], "scale", prefix)  # [out, in / 32]
    if fmt == "q8_0":
        qs = (u.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
        return GGMLWeight(qs=qs.reshape(out, n_in // BLOCK, BLOCK), d=d, m=None, fmt=fmt)
    blocks = u.reshape(out, n_in // BLOCK, BLOCK)
    qs = (blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8)
    if fmt == "q4_0":
        return GGMLWeight(qs=qs, d=d, m=None, fmt=fmt)
    zs = z[:, group_of_block].astype(np.float32) * s[:, group_of_block]
    return GGMLWeight(qs=qs, d=d, m=_f16(-zs, "zero point times scale", prefix), fmt=fmt)


def dequantize_linear(scheme: QuantScheme, prefix: str, read: Callable[[str], np.ndarray],
                      has: Callable[[str], bool]) -> np.ndarray:
    """Quantised linear `prefix` as floats, f32 [out, in]: s[o, g] * (u[o, i] - z[o, g])
    with g = g_idx[i] (activation-ordered groups) or i // group_size, one f32 subtraction
    and one product per weight (exact for codes and zero points below 2^24). Raises
    CheckpointError as read_codes does."""
    if scheme.float_weights:  # fp8 e4m3 times its scale, rounded once to f32
        w = read(f"{prefix}.weight").astype(np.float32)
        scale = np.asarray(read(f"{prefix}.weight_scale"), np.float32)
        return w * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(()))
    u, z, s = read_codes(scheme, prefix, read, has, act_ordered=True)
    g = act_order(scheme, prefix, u.shape[1], read, has)
    if g is None:
        g = np.arange(u.shape[1]) // (scheme.group_size or u.shape[1])
    zs = np.float32(1 << (scheme.bits - 1)) if z is None else z[:, g].astype(np.float32)
    return (u.astype(np.float32) - zs) * s[:, g]


def read_blocks(scheme: QuantScheme, prefix: str, read: Callable[[str], np.ndarray],
                has: Callable[[str], bool]) -> GGMLWeight:
    """Quantised linear `prefix` as GGML blocks [out, in] (numpy arrays): `read_codes`,
    then `to_blocks`. Raises CheckpointError as they do."""
    u, z, s = read_codes(scheme, prefix, read, has)
    return to_blocks(u, z, s, scheme.bits, scheme.group_size, prefix)
