"""SmolLM2-135M-Instruct (configs/smollm2_135m_bf16.py: bf16 matmuls, the model the head
was trained against) with speculative decoding by the EAGLE head that ships in
jaxserve/spec_decode/heads/smollm2_135m (trained for this model by
`python -m tools.train_draft_head`; its config.json records how, and its held-out
acceptance). One decoder layer over the fused features of the model's layers 2, 15 and 27
(EAGLE-3-style) proposes 3 tokens a step from a 4,096-token draft vocabulary; the model verifies them in the same dispatch. For
ordinary chat traffic of few streams; from 2 streams on the verify steps turn
compute-bound on this 2-core CPU (PERFORMANCE.md, "Speculative decoding"). Up to 4 verify
rounds per dispatch (verify_steps): 1.02x the decode rate of one round per dispatch here
(PERFORMANCE.md, "Verify rounds on device"), more where the host's share of a step is
larger (a GPU).
"""

import dataclasses
from pathlib import Path

from jaxserve.config import SpeculativeConfig, load_config

_PACKAGE = Path(__file__).resolve().parent.parent  # jaxserve/, where the head ships
_BASE = load_config("smollm2_135m_bf16")

CONFIG = dataclasses.replace(
    _BASE,
    name="smollm2_135m_eagle",
    engine=dataclasses.replace(
        _BASE.engine,
        speculative=SpeculativeConfig(
            method="eagle",
            model=str(_PACKAGE / "spec_decode" / "heads" / "smollm2_135m"),
            num_speculative_tokens=3,
            disable_by_batch_size=2,
            verify_steps=4,
        )),
)
