"""Per-request sampling parameters, validated where a request enters (HTTP, `generate`).

Semantics match vLLM's `SamplingParams`: temperature 0 is greedy; top_k <= 0 (or -1) and
top_p == 1 and min_p == 0 disable those filters; filters apply in the order top-k, top-p,
min-p on the temperature-scaled distribution.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


# The seed range the OpenAI API and vLLM accept (a signed 64-bit integer); the engine maps a
# seed to a PRNG key by its two's-complement 64 bits, so distinct seeds never share a key.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


class InvalidRequest(ValueError):
    """A request parameter is out of range; `field` names it (HTTP 400 at the edge)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    max_tokens: most tokens generated (>= 1).
    temperature: >= 0; 0 means greedy (argmax).
    top_k: keep the k most likely tokens; 0 or -1 disables (the engine refuses more than
        the vocabulary size).
    top_p: keep the smallest set of tokens whose probability sum reaches top_p; in (0, 1].
    min_p: drop tokens whose probability is below min_p * p(most likely); in [0, 1].
    seed: makes sampling reproducible: same seed and prompt -> same tokens whatever else
        runs in the batch; any signed 64-bit integer [SEED_MIN, SEED_MAX]. None draws a
        seed from the engine's generator.
    stop: strings that end generation; the matched stop string is not returned.
    stop_token_ids: token ids that end generation (in addition to EOS unless ignore_eos).
    ignore_eos: keep generating past EOS (benchmarks).
    include_stop_str_in_output: return the stop string too (vLLM's flag; default off).
    min_tokens: EOS, stop_token_ids and stop strings cannot end the output before this
        many tokens (vLLM; EOS and stop token ids are masked on device); <= max_tokens.
        It yields to structured output: a grammar whose value is complete (EOS or a stop
        token id is all it allows) ends the output there, short of min_tokens.
    presence_penalty, frequency_penalty: in [-2, 2] (OpenAI): subtract penalty x (1 if
        the token is in the output so far) / x (its count there) from its logit.
    repetition_penalty: > 0, 1 = off (vLLM / HF): a token in the prompt or output has
        its logit divided by it if positive, multiplied if not.
    logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI), before the
        penalties; a dict, or (id, bias) pairs; kept as sorted pairs.
    logprobs: how many most likely tokens to report at each output token besides the
        sampled one (vLLM; 0: only the sampled token's logprob; None: none).
    prompt_logprobs: the same for each prompt token (the first has none); such a request
        computes its whole prompt (it takes no cached prefix).
    skip_special_tokens: leave special tokens' text out of the output text (HF decode's
        flag; default on, as vLLM).
    structured_outputs: a jaxserve.sample.grammar.StructuredOutput the output must
        match (a JSON schema, any JSON object, a regex, a choice, a grammar), or None.
    Logprobs are the log-softmax of the model's raw logits, before logit_bias, penalties,
    temperature or filters (vLLM's default).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: Any = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field out of range."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidRequest("top_k", f"must be an integer >= -1 (0 or -1: off), "
                                          f"got {self.top_k!r}")
        if not _finite(self.top_p) or not (0 < self.top_p <= 1):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not (0 <= self.min_p <= 1):
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequest("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}] "
                                         f"(signed 64-bit), got {_short(self.seed)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _int(t) or t < 0:
                raise InvalidRequest("stop_token_ids", f"must be token ids (integers >= 0), "
                                                       f"got {_short(t)}")
        if not _int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be an integer in [0, max_tokens="
                                               f"{self.max_tokens}], got {_short(self.min_tokens)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise InvalidRequest(name, f"must be in [-2, 2], got {_short(value)}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest("repetition_penalty",
                                 f"must be > 0 (1: off), got {_short(self.repetition_penalty)}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("logit_bias", "a token id appears twice")
        for t, b in self.logit_bias:
            if not _int(t) or t < 0:
                raise InvalidRequest("logit_bias", f"keys must be token ids (integers >= 0), "
                                                   f"got {_short(t)}")
            if not _finite(b) or not -100 <= b <= 100:
                raise InvalidRequest("logit_bias", f"biases must be in [-100, 100], got "
                                                   f"{_short(b)} for token {t}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _int(value) or value < 0):
                raise InvalidRequest(name, f"must be an integer >= 0 or None, got {_short(value)}")

    @property
    def uses_controls(self) -> bool:
        """Whether sampling changes the logits before temperature (logit_bias, min_tokens,
        penalties, a structured-output mask): `jaxserve.sample.logits_processors`."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1
                    or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _short(x) -> str:
    """repr(x), cut to 40 characters; a huge integer by its size (Python refuses to print
    one of over 4300 digits, and it must not fill an error message)."""
    if isinstance(x, int) and abs(x) >= 10**30:
        return f"an integer of {x.bit_length()} bits"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
