"""The output processor: tokens read back from a step -> text, stop decisions, logprobs and
the RequestOutput each request's caller receives. Plain Python.

For each sampled token in order it advances the request's grammar matcher, detokenizer and
stop checker, and decides whether the request finishes there: an EOS or stop token id
(whose text is not returned), a stop string (matched from min_tokens output tokens on; EOS
and stop token ids cannot be sampled before: they are masked on device), max_tokens or
max_model_len. Tokens after the finishing one were sampled in vain and are dropped. It
returns what it decided (`TokenUpdate`); the engine has the scheduler record the tokens
and the finish, then asks here for the RequestOutput snapshot.

Writes, of a Sequence: `text`, `logprobs`, `prompt_logprobs`, an embedding request's
`pooled_sum` and `embedding` (and advances the state objects in `matcher`, `detokenizer`,
`stop_checker`).

Source: vLLM v1's OutputProcessor and its detokenizer / stop-string checks (StopChecker);
the legacy logprobs shapes of the OpenAI API.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.engine.outputs import FINISH_LENGTH, FINISH_STOP, RequestOutput
from jaxserve.engine.sequence import PLACEHOLDER, Sequence, TokenLogprobs


@dataclasses.dataclass
class TokenUpdate:
    """What a step's tokens did to one request: `tokens` kept (up to and including the one
    that finished it), the `text` they added, and `finish_reason` (None: still running)."""

    tokens: list[int]
    text: str
    finish_reason: str | None


class OutputProcessor:
    """Output processing of one engine. eos_token_ids: the model's and the tokenizer's."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, seq: Sequence, index: int, tokens: list[int],
                logprobs: list[TokenLogprobs] | None = None) -> TokenUpdate:
        """Process the sampled `tokens` of live `seq` at output positions `index`, `index +
        1`, ... in order, up to the first that finishes it (see the module docstring).
        logprobs: the tokens' TokenLogprobs, for a request that asked. Raises
        RuntimeError if the grammar refuses a token (a bug: the mask allowed it)."""
        p = seq.params
        kept, new_text, reason = [], "", None
        for j, (i, token) in enumerate(enumerate(tokens, start=index)):
            kept.append(token)
            if seq.logprobs is not None:
                del seq.logprobs[i:]  # a recomputed sequence's
                seq.logprobs.append(logprobs[j])
            stopped_by_string = False
            if seq.matcher is not None and not seq.matcher.accept(token):
                raise RuntimeError(f"the grammar refused sampled token {token}: "
                                   f"{seq.matcher.error}")
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason = FINISH_STOP  # the stop token's text is not returned
            else:
                text, stopped_by_string = seq.stop_checker.feed(seq.detokenizer.add([token]),
                                                                i + 1 > p.min_tokens)
                new_text += text
                if stopped_by_string:
                    reason = FINISH_STOP
            if reason is None and (i + 1 >= p.max_tokens
                                   or len(seq.prompt_ids) + i + 1 >= self.max_model_len):
                reason = FINISH_LENGTH
            if reason is not None:
                if not stopped_by_string:
                    new_text += seq.stop_checker.flush()  # held back for a stop string that never came
                if seq.logprobs is not None:
                    del seq.logprobs[i + 1:]
                break
        seq.text += new_text
        return TokenUpdate(kept, new_text, reason)

    @staticmethod
    def make_output(seq: Sequence, new_ids: list[int], new_text: str,
                    num_known: int | None = None) -> RequestOutput:
        """Snapshot of `seq`; num_known: output tokens already read (default: all but the
        trailing PLACEHOLDERs)."""
        if num_known is None:
            num_known = (seq.output_ids.index(PLACEHOLDER) if seq.has_placeholder
                         else len(seq.output_ids))
        return RequestOutput(
            request_id=seq.request_id, num_prompt_tokens=len(seq.prompt_ids),
            token_ids=seq.output_ids[:num_known], new_token_ids=new_ids, text=seq.text,
            new_text=new_text, finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            logprobs=None if seq.logprobs is None else seq.logprobs[:num_known],
            prompt_logprobs=seq.prompt_logprobs, embedding=seq.embedding)

    @staticmethod
    def record_pooled(seq: Sequence, pooled, start: int, n: int) -> None:
        """A step's pooled hidden state ([D] f32) of embedding request `seq`'s prompt
        chunk of n rows from position `start`: mean pooling adds the chunk's sum (a chunk
        at position 0 starts the sum over: a recomputed prompt); the chunk that ends the
        prompt sets seq.embedding, L2-normalised (before its sampled token finishes it).
        Source: vLLM's MEAN / LAST poolers with normalize."""
        row = np.asarray(pooled, np.float64)
        if seq.pooling == "mean":
            seq.pooled_sum = row if start == 0 else seq.pooled_sum + row
        if start + n >= len(seq.prompt_ids):
            vec = seq.pooled_sum / len(seq.prompt_ids) if seq.pooling == "mean" else row
            norm = float(np.linalg.norm(vec))
            seq.embedding = (vec / norm if norm > 0 else vec).astype(np.float32).tolist()

    @staticmethod
    def token_logprobs(seq: Sequence, fetched, b: int, m: int) -> list[TokenLogprobs] | None:
        """TokenLogprobs of the first m tokens of column b of a fetched step, for a
        sequence that asked for logprobs (else None)."""
        if seq.logprobs is None:
            return None
        k = seq.params.logprobs
        tokens, lps = fetched.tokens[:m, b].tolist(), fetched.logprobs[:m, b].tolist()
        if not k:
            return [TokenLogprobs(t, lp) for t, lp in zip(tokens, lps)]
        ids = fetched.extra["top_ids"][:m, b, :k].tolist()
        tops = fetched.extra["top_logprobs"][:m, b, :k].tolist()
        return [TokenLogprobs(t, lp, tuple(zip(i, p)))
                for t, lp, i, p in zip(tokens, lps, ids, tops)]

    @staticmethod
    def record_prompt_logprobs(seq: Sequence, extra: dict, row: int, start: int, n: int) -> None:
        """seq's prompt logprobs from a step's rows row .. row + n - 1 (its chunk from
        position `start`): the row at position p gives prompt token p + 1's."""
        k = seq.params.prompt_logprobs
        stop = min(start + n, len(seq.prompt_ids) - 1)
        for i, pos in enumerate(range(start, stop), start=row):
            top = ()
            if k:
                top = tuple(zip(extra["prompt_top_ids"][i, :k].tolist(),
                                extra["prompt_top_logprobs"][i, :k].tolist()))
            seq.prompt_logprobs[pos + 1] = TokenLogprobs(
                seq.prompt_ids[pos + 1], float(extra["prompt_logprobs"][i]), top)
