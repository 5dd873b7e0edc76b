"""The proposer a SpeculativeConfig stands for."""

from __future__ import annotations

from jaxserve.config import ConfigError, SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramProposer


def make_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
    """The host-side proposer of `spec` (None when speculative decoding is off). Raises
    ConfigError for a method this build cannot run yet."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    raise ConfigError(f"SpeculativeConfig.method {spec.method!r} is not available yet "
                      "(implemented: 'ngram')")
