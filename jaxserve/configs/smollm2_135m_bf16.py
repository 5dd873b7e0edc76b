"""SmolLM2-135M-Instruct (configs/smollm2_135m.py) with its GGUF Q4_1 file dequantised to
f32 at conversion and served by bf16 matmuls (the C++ kernel over bf16 copies of the
weights, f32 activations for single-stream decode): within bf16's rounding of HF
transformers' f32 model (tests/test_real_model_parity.py), 3.2x the weight bytes of the
default's Q4_1 blocks. The reference the speculative configs and the tests' small engine
(tests/configs/smollm2_small.py) build on, and bench_peers' `jaxserve` peer (against
llama.cpp serving a BF16 file).
"""

import dataclasses

from jaxserve.config import load_config

CONFIG = dataclasses.replace(load_config("smollm2_135m"), name="smollm2_135m_bf16",
                             quantization=None)
