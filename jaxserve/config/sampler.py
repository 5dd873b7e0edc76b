"""The sampler's group (SamplerConfig): what a request may ask of the sampler."""

from __future__ import annotations

import dataclasses

from jaxserve.config.validation import ConfigError, _positive


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """What a request may ask of the sampler (sizes of the step's sampling outputs)."""

    max_logprobs: int = 20
    """Most top logprobs a request may ask for per token (vLLM's max_logprobs, and its
    default 20, OpenAI's limit for chat). The step computes this many only when a row asks
    for any (jaxserve.sample.sampler.top_logprobs); 0 compiles none."""
    max_logit_bias: int = 300
    """Entries of the per-row logit-bias table (OpenAI accepts 300 logit_bias tokens): a
    request's logit_bias tokens, plus, with min_tokens, its stop token ids and EOS ids
    (masked until min_tokens). Transferred only in steps where a row uses one
    (jaxserve.sample.logits_processors)."""

    def __post_init__(self):
        _positive("SamplerConfig", self, ("max_logit_bias",))
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ConfigError(f"SamplerConfig.max_logprobs must be an integer >= 0, "
                              f"got {self.max_logprobs!r}")
