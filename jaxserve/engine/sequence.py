"""A request's host-side state while the engine serves it. Plain Python."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

from jaxserve.sampling_params import SamplingParams


# Output token sampled by a step that is still running on device: the engine appends one
# per token the step samples at dispatch (so the next step is planned with the right
# length) and overwrites them when it reads the step's results.
PLACEHOLDER = -1


class TokenLogprobs(NamedTuple):
    """One token's logprob and the most likely tokens at its position: top ((token id,
    logprob), ...), most likely first, as many as the request asked for. Log-softmax of
    the raw logits."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued; needs a prefill of all its tokens (again, if preempted)
    RUNNING = "running"    # its K/V live in its pages; decoding


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request, from admission until it finishes. Each field has one writer.

    Set once, when the request is taken (jaxserve.engine.input_processor):
    request_id, prompt_ids (token ids), params, seed (resolved sampling seed); controls (its
    row of the logits-controls table, None: it uses none); matcher (with
    params.structured_outputs, its grammar state, jaxserve.sample.grammar.GrammarMatcher);
    detokenizer / stop_checker (text state); lora_name (the LoRA adapter it runs with,
    None: the base model) and cache_salt (its first page hash's parent: the adapter's,
    jaxserve.engine.lora_manager); pooling (an embedding request: the engine's
    EngineConfig.pooling; it samples one token, dropped, and finishes). The objects in
    matcher, detokenizer and stop_checker are advanced by the output processor.

    Written by the scheduler (jaxserve.engine.scheduler): output_ids (token ids; the last
    ones are PLACEHOLDERs while the step that samples them runs: one, or decode_steps of a
    multi-step decode), status (waiting / running), num_computed (tokens whose K/V are in
    its pages), admitted (a counter value, larger = admitted more recently: preemption
    order), num_preemptions, finish_reason (None while live; set once, when it finishes).

    Written by the LoRA manager (jaxserve.engine.lora_manager): lora_slot (its adapter's
    device slot while it runs; 0: none).

    Written by the KV cache manager (jaxserve.engine.kv_cache_manager): block_table (page
    ids holding its K/V, in order), page_hashes (chained hashes of its full pages of known
    tokens, as far as computed: jaxserve.engine.page_pool.page_hashes), num_cached_pages
    (pages of its block table registered in the prefix cache).

    Written by the output processor (jaxserve.engine.output_processor): text (the output
    text so far), logprobs (with params.logprobs, one TokenLogprobs per output token read
    back), prompt_logprobs (with params.prompt_logprobs, one per prompt token; None for the
    first, and for those not computed yet); for an embedding request, pooled_sum (mean
    pooling: [D] f64, its prompt rows' hidden states added up so far) and embedding (the
    L2-normalised pooled vector, once its prompt is computed).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    controls: Any = None
    matcher: Any = None
    detokenizer: Any = None
    stop_checker: Any = None
    lora_name: str | None = None
    cache_salt: bytes | None = None
    pooling: str | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    admitted: int = -1
    num_preemptions: int = 0
    finish_reason: str | None = None
    block_table: list[int] = dataclasses.field(default_factory=list)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_pages: int = 0
    lora_slot: int = 0
    text: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    pooled_sum: Any = None
    embedding: list | None = None

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt row must be computed (no cached prefix): prompt logprobs
        still to compute, or a mean-pooled embedding."""
        return self.needs_prompt_logprobs or self.pooling == "mean"

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt token's logprobs are still to compute (then the whole prompt
        is computed: no cached prefix)."""
        return self.prompt_logprobs is not None and any(
            lp is None for lp in self.prompt_logprobs[1:])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def ids(self, start: int, stop: int) -> list[int]:
        """Tokens start .. stop - 1 of prompt + outputs, without copying the rest of them
        (the batch builder asks for a few tokens of long sequences every step)."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_known(self) -> int:
        """Tokens whose ids are known (all but the trailing PLACEHOLDERs)."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] == PLACEHOLDER:
            n -= 1
        return len(self.prompt_ids) + n

    @property
    def has_placeholder(self) -> bool:
        """Whether the last output token is still being sampled on device."""
        return bool(self.output_ids) and self.output_ids[-1] == PLACEHOLDER

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
