"""Per-request sampling parameters, validated where a request enters (HTTP, `generate`).

Semantics match vLLM's `SamplingParams`: temperature 0 is greedy; top_k <= 0 (or -1) and
top_p == 1 and min_p == 0 disable those filters; filters apply in the order top-k, top-p,
min-p on the temperature-scaled distribution.
"""

from __future__ import annotations

import dataclasses
import math


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

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
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


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
