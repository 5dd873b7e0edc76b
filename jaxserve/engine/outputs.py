"""What the engine reports about a request after each step."""

from __future__ import annotations

import dataclasses

FINISH_STOP = "stop"      # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"    # cancelled (client gone, abort_request)
FINISH_ERROR = "error"    # the engine failed this request (`RequestOutput.error` says why)


@dataclasses.dataclass
class RequestOutput:
    """One request's progress after an engine step.

    token_ids / text: everything generated so far (text never contains a stop string
    unless the request asked for it, and never ends in a broken UTF-8 sequence).
    new_token_ids / new_text: what this step added (the streaming delta).
    finish_reason: None while running; "stop", "length", "abort" or "error" once finished.
    error: with finish_reason "error", what failed (for logs; clients get a generic
        message, never this text).
    logprobs: with SamplingParams.logprobs, one TokenLogprobs per token of token_ids
        (jaxserve.engine.sequence.TokenLogprobs; the new tokens' are the last
        len(new_token_ids)); else None.
    prompt_logprobs: with SamplingParams.prompt_logprobs, one per prompt token, None for
        the first (complete from the first output with a token on); else None.
    embedding: an embedding request's L2-normalised pooled hidden state ([hidden_size]
        floats), once finished; else None.
    """

    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    embedding: list | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
