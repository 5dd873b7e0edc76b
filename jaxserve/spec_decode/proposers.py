"""The proposer a SpeculativeConfig stands for, as the engine's host side sees it."""

from __future__ import annotations

from jaxserve.config import ConfigError, SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramProposer


class DeviceProposer:
    """Drafts proposed on device inside the verify step (a draft model or an EAGLE head:
    jaxserve.spec_decode.draft_model / eagle): the host plans `k` draft rows per sequence,
    whose tokens the step fills in."""

    needs_context = False
    proposes_ahead = True  # before the step that samples a sequence's last token is read

    def propose(self, context, k: int) -> list[int]:
        """k placeholder draft tokens (the step overwrites them)."""
        return [0] * max(0, k)


def make_proposer(spec: SpeculativeConfig | None) -> NgramProposer | DeviceProposer | None:
    """The host-side proposer of `spec` (None when speculative decoding is off). Raises
    ConfigError for an unknown method."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method in ("draft_model", "eagle"):
        return DeviceProposer()
    raise ConfigError(f"SpeculativeConfig.method {spec.method!r} is not known")
