"""Build a Hugging Face `tokenizers.Tokenizer` (tokenizer.json) from a GGUF vocabulary.

A GGUF has no tokenizer.json: it stores llama.cpp's `tokenizer.ggml.*` metadata (token
list, token types, merges, special ids, the name of the pre-tokenizer). Byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) is rebuilt here:

  vocab/merges -> `models.BPE` (tokens outside the byte alphabet re-spelt in it);
  `tokenizer.ggml.pre` -> the split regex llama.cpp uses for that name (llama-vocab.cpp);
  token type CONTROL (3) -> special added tokens, USER_DEFINED (4) -> plain added tokens;
  decoder `ByteLevel`.

Matches transformers' GGUF tokenizer (integrations/gguf/gguf_tokenizer_mapping.py) on the
vocabulary and added tokens; for `smollm` it uses SmolLM2's own tokenizer.json
pre-tokenizer (individual digits + GPT-2 regex), which is llama.cpp's `smollm` pre-type.
SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`) are not supported.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from jaxserve.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

# Meta's Llama 3 tokenizer.json split (llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's tokenizer.json split (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): single digits.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(regex: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# `tokenizer.ggml.pre` -> pre-tokenizer (names as llama.cpp's convert_hf_to_gguf writes them).
PRE_TOKENIZERS: Mapping[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2, "gpt2": _gpt2, "smollm": _smollm,
    "llama-bpe": _split(LLAMA3_SPLIT), "llama3": _split(LLAMA3_SPLIT),
    "qwen2": _split(QWEN2_SPLIT), "deepseek-r1-qwen": _split(QWEN2_SPLIT),
}
# llama.cpp sets ignore_merges for the Llama 3 pre-type (as Meta's tokenizer.json does).
_IGNORE_MERGES = {"llama-bpe", "llama3"}

_BYTE_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())
_TO_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def _byte_level_spelling(token: str) -> str:
    """`token` as byte-level BPE spells it (unchanged if it already uses only the 256-char
    byte alphabet, as GGUF byte-level vocabularies do; raw text is re-spelt byte by byte)."""
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(piece for piece, _ in _TO_BYTE_LEVEL.pre_tokenize_str(token))


def build_gguf_tokenizer(md: Mapping[str, Any], where: str = "GGUF") -> Tokenizer:
    """A `tokenizers.Tokenizer` from GGUF metadata `md` (key -> value, as
    `gguf.ReaderField.contents()` gives them).

    Raises CheckpointError naming `where` and the tokenizer model if it is not byte-level
    BPE ('gpt2'), or if the token list is missing. An unknown `tokenizer.ggml.pre` falls back
    to the GPT-2 regex with a warning (llama.cpp's default pre-type).
    """
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{where}: unsupported GGUF tokenizer model {kind!r}; supported: "
                              f"'gpt2' (byte-level BPE)")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{where}: GGUF metadata lacks tokenizer.ggml.tokens")
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        log.warning("%s: unknown tokenizer.ggml.pre %r; using the GPT-2 split", where, pre)
    vocab = {_byte_level_spelling(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", ())]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                               ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = PRE_TOKENIZERS.get(pre, _gpt2)()
    tok.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens")
    # A CONTROL token spelt outside the byte alphabet is a llama.cpp mislabel (as transformers).
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty == CONTROL and set(t) <= _BYTE_ALPHABET]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED and t in vocab]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    return tok


def gguf_tokenizer_config(md: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json content from GGUF metadata: chat_template
    (`tokenizer.chat_template`), bos/eos/unk/pad token strings (from their ids),
    add_bos_token / add_eos_token (`tokenizer.ggml.add_*_token`, default False).
    Matches transformers' `get_gguf_tokenizer` for byte-level vocabularies."""
    tokens = md.get("tokenizer.ggml.tokens") or []
    cfg: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        tid = md.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= tid < len(tokens):
            cfg[name] = tokens[tid]
    cfg["add_bos_token"] = bool(md.get("tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if md.get("tokenizer.chat_template"):
        cfg["chat_template"] = md["tokenizer.chat_template"]
    return cfg


def tokenizer_from_gguf_metadata(md: Mapping[str, Any], where: str = "GGUF") -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config dict) of GGUF metadata `md`; raises
    CheckpointError as `build_gguf_tokenizer`."""
    return build_gguf_tokenizer(md, where).to_str(), gguf_tokenizer_config(md)
