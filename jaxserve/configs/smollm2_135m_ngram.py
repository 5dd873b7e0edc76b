"""SmolLM2-135M-Instruct (configs/smollm2_135m_bf16.py: bf16 matmuls, the baseline its
measurements compare with) with n-gram speculative decoding.

For workloads whose answers repeat their prompts (editing text or code, quoting a
passage): prompt lookup proposes the tokens that followed the last few generated ones
where they occurred before, and the model verifies up to 4 of them per step. On a CPU a
verify step of one sequence (5 rows) costs little more than a decode step, so a single
stream gains on such prompts (and somewhat on ordinary chat); with more streams the verify
steps turn compute-bound and chat loses (PERFORMANCE.md, "Speculative decoding"), hence
disable_by_batch_size 2. Up to 4 verify rounds per dispatch (verify_steps: the n-gram
lookup runs on device between them): 1.05-1.06x the decode rate of one round per dispatch
on copy prompts (PERFORMANCE.md, "Verify rounds on device"). The same as
`python serve.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 2,
"verify_steps": 4}'`.
"""

import dataclasses

from jaxserve.config import SpeculativeConfig, load_config

_BASE = load_config("smollm2_135m_bf16")

CONFIG = dataclasses.replace(
    _BASE,
    name="smollm2_135m_ngram",
    engine=dataclasses.replace(
        _BASE.engine,
        speculative=SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=4,   # 5-row verify steps: the one-pass matmul (<= 6 rows)
            prompt_lookup_max=4,
            prompt_lookup_min=1,        # more proposals: 2.0-2.1x vs 1.99x with 2 (copy)
            disable_by_batch_size=2,
            verify_steps=4,
        )),
)
