"""Streaming text: token ids -> text deltas (`IncrementalDetokenizer`) and stop strings
(`StopChecker`). Plain Python, one instance of each per request, driven by the engine.

Neither is thread-safe; the engine thread owns them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from jaxserve.tokenization.tokenizer import Tokenizer

# Prompt tokens decoded as left context of the first output token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for decoders whose output for a token
# depends on its neighbours (SentencePiece's leading-space handling).
CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas as they are generated.

    Algorithm (vLLM `detokenize_incrementally`, `vllm/transformers_utils/detokenizer_utils.py`,
    and TGI's `decode_token`, which work on ids): keep `prefix_offset <= read_offset` into the
    ids seen so far. Text up to `read_offset` has been emitted. On new ids decode
    `ids[prefix_offset:read_offset]` (prefix_text) and `ids[prefix_offset:]` (new_text); if
    new_text is longer and does not end in U+FFFD (an incomplete UTF-8 sequence: byte-level
    BPE splits a multi-byte character over tokens), emit `new_text[len(prefix_text):]` and
    advance both offsets; otherwise emit nothing and wait for more ids. Decoding a small
    window with some left context is O(1) per token and keeps decoders that depend on the
    previous token (SentencePiece spaces) right.

    Guarantee: for a byte-level BPE tokenizer (GPT-2, Llama 3, SmolLM2) the concatenation of
    all deltas equals `tokenizer.decode(output_ids, skip_special_tokens)` whenever that text
    does not end in an incomplete character, and no delta contains U+FFFD unless that text
    does. (SentencePiece tokenizers keep the leading space of the first output token, which a
    standalone decode would strip: that is the text in context, as vLLM returns it.)

    tokenizer: the model's Tokenizer. prompt_ids: the prompt (its last CONTEXT_TOKENS ids are
    the left context). skip_special_tokens: drop special tokens' text (HF decode's flag).
    """

    def __init__(self, tokenizer: "Tokenizer", prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(t) for t in list(prompt_ids)[-CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append output token ids; return the text they complete ("" if none yet).

        `new_ids`: one id per decode step, or several (speculative decoding) at once.
        """
        self._ids.extend(int(t) for t in new_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing printable yet (an incomplete character, or special tokens)
        delta = new_text[len(prefix_text):]
        # Keep only the window still needed: ids from the old read offset on.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return delta


class StopChecker:
    """Finds stop strings in a stream of text deltas without ever emitting one.

    `feed(delta)` returns the text safe to emit now: it holds back the longest tail that is a
    proper prefix of some stop string (it may become one with the next delta) and, once a
    stop string appears, truncates before it (after it if `include_stop_str_in_output`) and
    reports stopped. With several stop strings the one that starts first wins (the longer on
    a tie). `flush()` releases the held-back tail when the request ends for another reason
    (EOS, max_tokens). Semantics of vLLM's `stop` / `include_stop_str_in_output`
    (`vllm/v1/engine/detokenizer.py: check_stop_strings`), which match OpenAI's `stop`.

    stop_strings: non-empty strings (empty ones are ignored).
    """

    def __init__(self, stop_strings: Sequence[str], include_stop_str_in_output: bool = False):
        self._stops = tuple(s for s in stop_strings if s)
        self._include = include_stop_str_in_output
        self._held = ""
        self._done = False

    @property
    def held_back(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str, check: bool = True) -> tuple[str, bool]:
        """Take the next text delta; return (text to emit now, stopped). After a stop, further
        feeds return ("", True). check False: emit it all, matching nothing (the output is
        shorter than its min_tokens, vLLM's rule)."""
        if self._done:
            return "", True
        text = self._held + delta
        if not self._stops or not check:
            self._held = ""
            return text, False
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self._done, self._held = True, ""
            return text[:start + len(stop)] if self._include else text[:start], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """Release the held-back text (the request ended without a stop string); later feeds
        return ("", True)."""
        out, self._held, self._done = self._held, "", True
        return out

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best = None
        for s in self._stops:
            i = text.find(s)
            if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        return best

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[len(text) - k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
