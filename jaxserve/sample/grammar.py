"""Structured output: constrain a request's tokens to a JSON schema, any JSON object, a
regex, a list of choices or a Lark grammar, through llguidance (the grammar engine chosen
by measurement: PERFORMANCE.md, "Structured output"; tools/measure_grammar_engines.py).

Host side only (plain Python + llguidance, no JAX): the engine makes one `GrammarMatcher`
per constrained request at admission; before each step that samples for the request it
writes the matcher's next-token bitmask ([ceil(vocab / 32)] int32, bit t of word t // 32
set = token t allowed) into the request's row of the step's logits controls, which the
device applies as -inf (jaxserve.sample.logits_processors); after the step it advances the
matcher with the sampled token. The grammar compiles in the request's parse (the
server's worker thread), so a bad schema is a 400 naming the field.

Source: vLLM's structured outputs (request fields `structured_outputs` {json, regex,
choice, grammar, json_object}, the older `guided_*` names, OpenAI's `response_format`,
named `tool_choice`), and its packed-bitmask layout (xgrammar / llguidance).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.sampling_params import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# llguidance's JSON compile options: no free whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. kind: "json" (value: a JSON schema, as JSON
    text), "json_object" (any JSON object; value ignored), "regex" (a regular expression,
    matched whole), "choice" (value: a JSON list of strings, one of which is output
    exactly), "grammar" (a Lark grammar, llguidance's dialect, or GBNF). field: the request
    field it came from (for errors). after: the constraint starts once the output has this
    text (a reasoning model's "</think>"; "" = from the first token). Source: vLLM's
    structured outputs with a reasoning parser (the grammar is not applied until the
    reasoning ends)."""

    kind: str
    value: str = ""
    field: str = "structured_outputs"
    after: str = ""

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint. Raises InvalidRequest (naming
        `field`) if it cannot be built."""
        import llguidance
        fmt = {"json": "json_schema", "json_object": "json_schema", "regex": "regex",
               "choice": "choice", "grammar": "grammar"}.get(self.kind)
        if fmt is None:
            raise InvalidRequest(self.field, f"unknown kind {self.kind!r} (one of {KINDS})")
        text = '{"type": "object"}' if self.kind == "json_object" else self.value
        try:
            if fmt == "json_schema":  # one line, json.dumps' separators (a schema's
                # "x-guidance" may say otherwise): small models otherwise emit whitespace
                # runs where JSON allows them
                return llguidance.LLMatcher.grammar_from_json_schema(
                    text, defaults=JSON_OPTIONS)
            return llguidance.grammar_from(fmt, text)
        except Exception as e:  # the library's own message names what is wrong
            raise InvalidRequest(self.field, f"invalid {self.kind}: {str(e)[:300]}") from None

    def validate(self) -> None:
        """Raise InvalidRequest (naming `field`) unless the grammar compiles."""
        import llguidance
        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(self.field, f"invalid {self.kind}: {error[:300]}")


class GrammarTokenizer:
    """llguidance's view of the model's tokenizer, built once per engine (~1 s for a 50k
    vocabulary). backend: a `tokenizers.Tokenizer`; vocab_size: the model's (logits) size;
    eos_token_ids: the ids that end a constrained output."""

    def __init__(self, backend: Any, vocab_size: int, eos_token_ids: list[int]):
        import llguidance
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                         eos_token=sorted(eos_token_ids))

    def matcher(self, spec: StructuredOutput) -> "GrammarMatcher":
        """The grammar state of one request constrained by `spec` (a matcher that waits
        for spec.after first when it is set). Raises InvalidRequest if it is refused."""
        if spec.after:
            return DeferredMatcher(self, spec)
        return GrammarMatcher(self, spec)


class GrammarMatcher:
    """One request's grammar state. Raises InvalidRequest if the grammar is refused."""

    def __init__(self, tokenizer: GrammarTokenizer, spec: StructuredOutput):
        import llguidance
        self.words = tokenizer.words
        self._m = llguidance.LLMatcher(tokenizer.ll, spec.grammar())
        if self._m.is_error():
            raise InvalidRequest(spec.field, f"invalid {spec.kind}: "
                                             f"{self._m.get_error()[:300]}")

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the next-token bitmask into out: [words] int32, C-contiguous."""
        assert out.dtype == np.int32 and out.flags["C_CONTIGUOUS"] and out.size == self.words
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> bool:
        """Advance with a sampled token; False if the grammar refuses it (then the matcher
        is in error)."""
        return bool(self._m.consume_token(token))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows no alternative to from here (llguidance's
        fast-forward tokens, the canonical tokenization of the bytes it forces; [] when
        the next token is a free choice or only EOS is left). The matcher is not
        advanced."""
        return list(self._m.compute_ff_tokens())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return self._m.is_stopped()


class DeferredMatcher(GrammarMatcher):
    """A grammar that applies only after spec.after appears in the output (the end of a
    reasoning section): every token is allowed until then, and the constraint starts with
    the token after the one that completes that text (the rest of that token, often a
    newline, is not held to the grammar). Source: vLLM's structured outputs
    (`reasoner.is_reasoning_end`)."""

    def __init__(self, tokenizer: GrammarTokenizer, spec: StructuredOutput):
        super().__init__(tokenizer, spec)
        self._ll = tokenizer.ll
        self._after = spec.after.encode()
        self._tail = b""  # the output's last bytes, as many as could start spec.after
        self.active = False

    def fill_bitmask(self, out: np.ndarray) -> None:
        if self.active:
            super().fill_bitmask(out)
        else:
            out.fill(-1)

    def forced_tokens(self) -> list[int]:
        return super().forced_tokens() if self.active else []

    def accept(self, token: int) -> bool:
        if self.active:
            return super().accept(token)
        text = self._tail + self._ll.decode_bytes([token])
        self.active = self._after in text
        self._tail = text[max(0, len(text) - len(self._after) + 1):]
        return True

    @property
    def done(self) -> bool:
        return self.active and super().done
