"""Speculative decoding's group (SpeculativeConfig, vLLM's `--speculative-config` object)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.config.validation import ConfigError

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle")
MAX_SPECULATIVE_TOKENS = 16
MAX_VERIFY_STEPS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config`, the same JSON object): a cheap
    proposer guesses up to `num_speculative_tokens` tokens per decoding sequence, the target
    model verifies them all in one step, and rejection sampling keeps exactly the target's
    output distribution (jaxserve.spec_decode). Requests need no change.
    """

    method: str = dataclasses.field(metadata={"choices": SPECULATIVE_METHODS})
    """The proposer: "ngram" (prompt lookup over the sequence's own prompt + output),
    "draft_model" (a smaller model sharing the tokenizer) or "eagle" (a draft head over the
    target's hidden states)."""
    num_speculative_tokens: int
    """k, the most draft tokens verified per sequence and step (1..16). A verify step
    computes k + 1 token rows per sequence."""
    prompt_lookup_max: int | None = None
    """ngram only, the longest suffix n-gram looked up (tokens; the longest that occurs
    earlier wins). Default 4."""
    prompt_lookup_min: int | None = None
    """ngram only, the shortest suffix n-gram looked up (tokens). Default 2."""
    model: str | None = None
    """draft_model / eagle: the draft's checkpoint directory."""
    disable_by_batch_size: int = 4
    """Speculate only while at most this many sequences run and none waits (vLLM's name;
    beyond it the batch is compute-bound and verifying k extra rows per sequence costs
    more than it saves: PERFORMANCE.md, "Speculative decoding"). At most max_num_seqs; the
    verify step is compiled for the sequence buckets up to it."""

    draft_confidence_threshold: float = 0.0
    """draft_model / eagle: a sequence's drafts end before the first to which the drafter
    (its raw softmax, at the token it proposed) gives a probability below this (0..1; 0:
    always num_speculative_tokens), as llama.cpp's `--draft-p-min` and Hugging Face's
    `assistant_confidence_threshold` stop their drafters. With the C++ CPU matmul, where a
    verify row costs time (~0.8 ms a row on SmolLM2-135M: a round of 4 rows ~1.25x a
    decode step's), the proposal loop ends once no sequence takes another draft and a
    round left without drafts runs a decode step's forward; elsewhere (a GPU, where rows
    cost next to nothing) it only drops drafts, so leave it 0 there. On SmolLM2's EAGLE
    head 0.2 measured 1.01x the speed of 0 (PERFORMANCE.md, "Drafts the drafter
    doubts"): the shipped config leaves it off."""

    verify_steps: int = 1
    """Verify rounds per dispatched step (1..16), what SchedulerConfig.decode_steps is to
    plain decode: round r + 1 verifies drafts proposed on device after the tokens round r
    kept (n-gram lookup over the token pool, the draft model, the EAGLE head), with no
    trip to the host between rounds; the host's work per step is then shared by up to
    verify_steps x (k + 1) tokens. Taken while no request waits, no running sequence
    samples under a grammar and each has room for every round's drafts (max_tokens,
    max_model_len, free pages); otherwise one round. Tokens after a stop are dropped.
    Ours: vLLM verifies once per step (PERFORMANCE.md, "Speculative decoding")."""

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, "
                              f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"SpeculativeConfig.num_speculative_tokens must be an integer in "
                              f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1:
            raise ConfigError(f"SpeculativeConfig.disable_by_batch_size must be an integer >= 1, "
                              f"got {self.disable_by_batch_size!r}")
        if (not isinstance(self.verify_steps, int) or isinstance(self.verify_steps, bool)
                or not 1 <= self.verify_steps <= MAX_VERIFY_STEPS):
            raise ConfigError(f"SpeculativeConfig.verify_steps must be an integer in "
                              f"1..{MAX_VERIFY_STEPS}, got {self.verify_steps!r}")
        t = self.draft_confidence_threshold
        if (isinstance(t, bool) or not isinstance(t, (int, float))
                or not 0.0 <= t < 1.0):
            raise ConfigError(f"SpeculativeConfig.draft_confidence_threshold must be a number "
                              f"in [0, 1), got {t!r}")
        object.__setattr__(self, "draft_confidence_threshold", float(t))
        if self.method == "ngram":
            if t:
                raise ConfigError("SpeculativeConfig.draft_confidence_threshold is for "
                                  "draft_model / eagle (an n-gram lookup has no "
                                  "probabilities)")
            if self.model is not None:
                raise ConfigError("SpeculativeConfig.model is for draft_model / eagle; ngram "
                                  "looks up the sequence's own tokens")
            hi = 4 if self.prompt_lookup_max is None else self.prompt_lookup_max
            lo = min(2, hi) if self.prompt_lookup_min is None else self.prompt_lookup_min
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ConfigError(f"SpeculativeConfig.prompt_lookup_min ({lo!r}) and "
                                  f"prompt_lookup_max ({hi!r}) must be integers with "
                                  "1 <= prompt_lookup_min <= prompt_lookup_max")
            object.__setattr__(self, "prompt_lookup_max", hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
        else:
            if not self.model:
                raise ConfigError(f"SpeculativeConfig.model is required for method "
                                  f"{self.method!r} (the draft's checkpoint directory)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ConfigError("SpeculativeConfig.prompt_lookup_max / prompt_lookup_min "
                                  "are for method 'ngram'")

    @classmethod
    def from_dict(cls, d: "dict[str, Any] | str") -> "SpeculativeConfig":
        """From vLLM's JSON object (a dict, or its JSON text). Raises ConfigError for
        invalid JSON, an unknown key or a missing / bad value."""
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown key(s) {unknown}; known: "
                              f"{sorted(known)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ConfigError(f"speculative_config needs {key!r}")
        return cls(**d)
