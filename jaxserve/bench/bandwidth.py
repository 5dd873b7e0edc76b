"""The memory-bandwidth bound of decoding: the bytes of weights one decode step reads per
sequence, in the format the engine serves, and the device's read bandwidth measured with
an XLA reduction. Used by `jaxserve bench generate` and tools/membw.py (and through it
tools/bench_peers.py): decoding one stream reads every weight once per token, so tokens/s
cannot exceed (read bandwidth) / (weight bytes per token).
"""

from __future__ import annotations

import math
import statistics
import time


def weight_bytes_per_token(model, engine) -> dict[str, int]:
    """Bytes of weights one decode step of one sequence reads, by part: the layers'
    projections and the LM head (norm weights and the one embedding row are negligible
    and left out). model: ModelConfig; engine: EngineConfig (its bf16_matmul_min_rows /
    weight_quant pick the format)."""
    from jaxserve.model.params import param_specs
    from jaxserve.model.params import PROJECTIONS

    spec = param_specs(model).layers[0]
    layer = sum(math.prod(getattr(spec, name).shape) for name in PROJECTIONS)
    D, V = model.hidden_size, model.vocab_size
    itemsize = 4 if model.dtype == "float32" else 2
    proj = head = itemsize
    if engine.kernels.bf16_matmul_min_rows == 1:  # decode (1 row) uses the bf16 copies
        proj = head = 2
    elif engine.kernels.weight_quant is not None:  # int8 / fp8 projections, head in the model dtype
        proj = 1
    return {"layers": model.num_layers * layer * proj, "lm_head": V * D * head}


def ggml_weight_bytes_per_token(params) -> dict[str, int] | None:
    """weight_bytes_per_token of a model served in GGUF's own blocks (`quantization=
    "gguf"`: jaxserve.model.ggml_weight), counted from its loaded params (a Params: the
    layers' projections, fused or not, and the LM head, or the embedding it is tied to),
    since a GGUF file picks a block format per tensor (SmolLM2-135M's Q4_1 file keeps its
    tied embedding in Q8_0). None if any projection or the head is not GGML blocks (then
    the config's formats decide: weight_bytes_per_token)."""
    import jax

    from jaxserve.model.ggml_weight import GGMLWeight
    from jaxserve.model.layer_loop import StackedLayers
    from jaxserve.model.params import PROJECTIONS
    from jaxserve.model.weight_layouts import FusedWeight

    def ggml_bytes(w) -> int | None:
        w = w.w if isinstance(w, FusedWeight) else w
        return sum(x.nbytes for x in jax.tree.leaves(w)) if isinstance(w, GGMLWeight) else None

    layers = params.layers
    layers = [layers.layers] if isinstance(layers, StackedLayers) else list(layers)
    parts = [ggml_bytes(getattr(layer, name)) for layer in layers for name in PROJECTIONS
             if getattr(layer, name) is not None]
    head = ggml_bytes(params.lm_head if params.lm_head is not None else params.embed)
    if not parts or head is None or any(b is None for b in parts):
        return None
    return {"layers": sum(parts), "lm_head": head}


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 7, samples: int = 1,
                        interval_s: float = 1.0, warmup_s: float = 0.5) -> list[float]:
    """Read bandwidth samples in GB/s (1e9 bytes/s), `samples` of them `interval_s` seconds
    apart. Each is the array's bytes over (the median of `repeats` XLA sums of a gib-GiB
    f32 array, less the median of as many of the same sum over 1,024 elements: a call's
    fixed cost, dispatch, launch and the wait for the scalar). On an H100 machine that cost
    was ~0.15 ms against ~0.35 ms to read 1 GiB: timing the sum alone read 1.7-2.0 TB/s
    where the card copies at ~3 TB/s (PERFORMANCE.md, "The GPU run of session 22"); on a
    CPU it is a few microseconds of ~50 ms. Before the first sample the large sum runs for
    `warmup_s` seconds: an idle GPU starts at its lowest clocks (an H200 read 345 MHz), and
    the unwarmed probe of session 27 read 2.3-3.7 TB/s on one H200 from one process to the
    next. On CPU the array lies in transparent huge pages where Linux grants them, as the
    engine's weights do (KernelConfig.cpu_huge_pages; in 4 KiB pages an AMD Zen 4 VM read
    ~27 GB/s, and single-stream decode in huge pages ran above that bound). Raises
    ValueError if the large sum is not slower than the small one (a machine too noisy to
    measure on)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.worker.huge_pages import advise_huge_pages

    n = int(gib * 2**30) // 4
    x, tiny = jnp.ones((n,), jnp.float32), jnp.ones((1024,), jnp.float32)
    advise_huge_pages(x)  # on CPU in huge pages, as the engine's weights (cpu_huge_pages)
    total = jax.jit(jnp.sum)
    for a in (x, tiny):
        total(a).block_until_ready()  # compiles both shapes
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:  # the device's clocks up
        total(x).block_until_ready()

    def median_seconds(a) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            total(a).block_until_ready()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    out = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        seconds = median_seconds(x) - median_seconds(tiny)
        if seconds <= 0:
            raise ValueError(f"read_bandwidth_gb_s: summing {gib} GiB was not slower than "
                             f"summing 1,024 floats: too noisy to measure")
        out.append(n * 4 / seconds / 1e9)
    return out


def bound_from_samples(samples_gb_s: list[float], weight_bytes: dict[str, int]) -> dict:
    """{"read_gb_s" (the median sample), "samples_gb_s", "weight_bytes", "bytes_per_token",
    "bound_tok_s"} from bandwidth samples and the weight bytes read per token by part."""
    per_token = sum(weight_bytes.values())
    bw = statistics.median(samples_gb_s)
    return {"read_gb_s": round(bw, 2), "samples_gb_s": [round(x, 2) for x in samples_gb_s],
            "weight_bytes": weight_bytes, "bytes_per_token": per_token,
            "bound_tok_s": round(bw * 1e9 / per_token, 1)}
