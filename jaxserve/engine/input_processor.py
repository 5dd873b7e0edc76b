"""The input processor: a request's prompt and sampling parameters -> a checked Sequence.

What only the engine knows is checked here, where the request enters (the entrypoints have
checked what they can): the prompt's length against max_model_len, token ids and top_k
against the vocabulary, logprobs and logit-bias sizes against the sampler's limits. Then
everything each step does for the request on the host is tried once, alone: packing its
sampling parameters and logits controls, building its grammar matcher, detokenizer and stop
checker. A request that cannot pass is refused with InvalidRequest naming the field and the
limit, so it can never fail a batch. Plain Python (+ numpy for the controls row).

Source: vLLM v1's InputProcessor (request validation before the engine core).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.sequence import Sequence
from jaxserve.sample.logits_processors import LogitsControls, bias_entries
from jaxserve.sample.sampler import SamplingBatch
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.tokenization.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

log = logging.getLogger(__name__)


class InputProcessor:
    """Makes the Sequences of one engine. `eos_token_ids`: the model's and the tokenizer's
    end-of-sequence ids (they count against max_logit_bias with min_tokens)."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 tokenizer: Tokenizer, eos_token_ids: frozenset[int]):
        self.model_config = model_config
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._rng = np.random.default_rng(engine_config.seed)
        self._grammar_tok = None  # structured output's tokenizer (_grammar_tokenizer)

    def process(self, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, lora_name: str | None = None,
                cache_salt: bytes | None = None, pooling: str | None = None) -> Sequence:
        """The Sequence of a new request (run with LoRA adapter `lora_name`, None: the
        base; cache_salt: its page hashes' seed, the adapter's; pooling: an embedding
        request's, Sequence.pooling). Raises InvalidRequest:
        empty prompt, token id outside the vocabulary, prompt of >= max_model_len tokens
        (no room for output), top_k above the vocabulary size, sampler limits
        (`_check_sampler_limits`), or parameters that cannot be packed for the device."""
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequest("prompt", "prompt is empty")
        limit = self.engine_config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest("prompt", f"prompt has {len(ids)} tokens; max_model_len is "
                                           f"{limit} (prompt + at least 1 output token)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise InvalidRequest("top_k", f"must be at most the vocabulary size {vocab} "
                                          f"(0 or -1: off), got {params.top_k}")
        self._check_sampler_limits(params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        try:  # what every step does for this request on the host, tried once, alone
            SamplingBatch.from_params([params], [seed], [0], 1)
            controls = self._controls_row(params, len(ids))
            matcher = (self._grammar_tokenizer().matcher(params.structured_outputs)
                       if params.structured_outputs is not None else None)
            detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        except InvalidRequest:
            raise
        except Exception as e:
            log.warning("request %r refused: %r", request_id, e)
            raise InvalidRequest("request", "the engine cannot take these sampling "
                                            "parameters or this prompt") from e
        return Sequence(request_id=request_id, prompt_ids=ids, params=params, seed=seed,
                        controls=controls, matcher=matcher, detokenizer=detokenizer,
                        stop_checker=stop_checker, lora_name=lora_name, cache_salt=cache_salt,
                        pooling=pooling)

    def _check_sampler_limits(self, params: SamplingParams) -> None:
        """What only the engine knows about a request's sampler fields: token ids against
        the vocabulary, logprobs against SamplerConfig.max_logprobs, the bias table's size
        against max_logit_bias. Raises InvalidRequest naming the field and the limit."""
        vocab = self.model_config.vocab_size
        limit = self.engine_config.sampler.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequest(name, f"at most {limit} (the server's max_logprobs), "
                                           f"got {value}")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(name, f"token id {bad} is outside the vocabulary "
                                           f"[0, {vocab})")
        if params.uses_controls:
            n = len(self._bias_entries(params))
            size = self.engine_config.sampler.max_logit_bias
            if n > size:
                raise InvalidRequest("logit_bias", f"at most {size} entries (the server's "
                                     f"max_logit_bias; with min_tokens, the stop token ids and "
                                     f"EOS ids count too), got {n}")

    def _grammar_tokenizer(self):
        """The tokenizer's grammar-engine view, built at the first constrained request (~1 s
        for a 50k vocabulary) and kept."""
        if self._grammar_tok is None:
            from jaxserve.sample.grammar import GrammarTokenizer
            self._grammar_tok = GrammarTokenizer(self.tokenizer.backend,
                                                 self.model_config.vocab_size,
                                                 sorted(self.eos_token_ids))
        return self._grammar_tok

    def _bias_entries(self, params: SamplingParams) -> list[tuple]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return bias_entries(dict(params.logit_bias), params.min_tokens, stop_ids)

    def _controls_row(self, params: SamplingParams, prompt_len: int) -> LogitsControls | None:
        """The request's row of the logits-controls table (None if it uses none)."""
        if not params.uses_controls:
            return None
        c = LogitsControls.neutral(1, self.engine_config.sampler.max_logit_bias,
                                   self.model_config.vocab_size)
        entries = self._bias_entries(params)
        for j, (token, value, until) in enumerate(entries):
            c.bias_ids[0, j], c.bias_values[0, j], c.bias_until[0, j] = token, value, until
        c.presence_penalty[0] = params.presence_penalty
        c.frequency_penalty[0] = params.frequency_penalty
        c.repetition_penalty[0] = params.repetition_penalty
        c.prompt_len[0] = prompt_len
        return LogitsControls(**{k: v[0] for k, v in dataclasses.asdict(c).items()})
