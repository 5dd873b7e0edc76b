"""Speculative decoding: proposers (host n-gram lookup, draft models) and the on-device
rejection sampler that verifies their drafts. See jaxserve.config.SpeculativeConfig."""
